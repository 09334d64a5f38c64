"""The tokens a call's name may take under `tool_choice` any (`chat.tool_names`), on the
real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4jax.chat import specials
from ds4jax.chat.tokenizer import V4Tokenizer
from ds4jax.chat.tool_names import NAME_END, NameIndex, allowed, targets

NAMES = ["get_weather", "get_time", "search", "Read", "read", "read_file",
         "mcp__github__create_issue", "a"]  # fmt: skip


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
        assert any(g.startswith(tok.token_bytes(t)) for g in goals), tok.token_bytes(t)
    assert not set(first) & index.special
    for bad in ("foo", " get", "Get", '"'):  # another name, a space, a case, an empty name
        assert tok.encode_text(bad)[0] not in first, bad


def test_a_name_ends_at_its_line_end_and_never_runs_on(index) -> None:
    """`">\\n` closes the name, and no token past it is allowed: a run-on such as `">$` or
    `">{` left the call's markup broken (the demo model took one in 40% of its turns)."""
    goals = targets(NAMES)
    tok = index.tokenizer
    after = allowed(index, b'read">', goals)
    assert [tok.token_bytes(t) for t in after] == [b"\n"]
    before_close = {tok.token_bytes(t) for t in allowed(index, b"read", goals)}
    assert b'"' in before_close and b"_file" in before_close  # closing, or `read_file`
    assert not any(len(b) > 3 and b.startswith(b'">') for b in before_close)
    assert b'">{' not in before_close and b'">\n\n' not in before_close
    assert allowed(index, b'read">\n', goals) == []  # spelled out: the call goes on freely


def test_each_name_as_the_tokenizer_spells_it_is_allowed_step_by_step(index) -> None:
    goals = targets(NAMES)
    tok = index.tokenizer
    for name in NAMES:
        written = b""
        for t in tok.encode_text(name + NAME_END):
            assert t in allowed(index, written, goals), (name, written, tok.token_bytes(t))
            written += tok.token_bytes(t)
        assert written in goals and allowed(index, written, goals) == []


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_walk_through_the_allowed_tokens_names_a_declared_tool(index, data) -> None:
    goals = targets(NAMES)
    written = b""
    for _ in range(64):
        options = allowed(index, written, goals)
        if not options:
            break
        written += index.tokenizer.token_bytes(data.draw(st.sampled_from(options)))
    assert written in goals
    assert written.removesuffix(NAME_END.encode()).decode() in NAMES
