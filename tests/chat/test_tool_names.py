"""The tokens a forced call's name may take (`chat.tool_names`), on the real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4jax.chat import specials
from ds4jax.chat.tokenizer import V4Tokenizer
from ds4jax.chat.tool_names import NameIndex, allowed, finished, targets

NAMES = ["get_weather", "get_time", "search", "Read", "Bash", "mcp__github__create_issue"]


@pytest.fixture(scope="module")
def index() -> NameIndex:
    tok = V4Tokenizer()
    return NameIndex(tok, frozenset(tok.special_id(s) for s in specials.TEMPLATE_SPECIALS))


def test_every_allowed_token_keeps_the_name_on_a_declared_one(index) -> None:
    goals = targets(NAMES)
    tok = index.tokenizer
    first = allowed(index, b"", goals)
    assert first and len(first) < 500
    for t in first:
        w = tok.token_bytes(t)
        assert any(g.startswith(w) or w.startswith(g) for g in goals), w
    assert not set(first) & index.special
    for bad in ("foo", " get", "Get", '"'):  # another name, a space, a case, an empty name
        assert tok.encode_text(bad)[0] not in first, bad


def test_each_name_as_the_tokenizer_spells_it_is_allowed_step_by_step(index) -> None:
    goals = targets(NAMES)
    tok = index.tokenizer
    for name in NAMES:
        written = b""
        for t in tok.encode_text(name + '">\n'):
            if finished(written, goals):
                break
            assert t in allowed(index, written, goals), (name, written, tok.token_bytes(t))
            written += tok.token_bytes(t)
        assert finished(written, goals) and written.startswith(f'{name}">'.encode())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_walk_through_the_allowed_tokens_names_a_declared_tool(index, data) -> None:
    goals = targets(NAMES)
    written = b""
    for _ in range(64):
        if finished(written, goals):
            break
        options = allowed(index, written, goals)
        assert options, written  # never a dead end
        written += index.tokenizer.token_bytes(data.draw(st.sampled_from(options)))
    name = written.split(b'">', 1)[0].decode()
    assert name in NAMES
