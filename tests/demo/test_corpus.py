"""The demo corpus: what the model is trained on must be what the server renders."""

from __future__ import annotations

import pytest

from ds4jax.chat import specials
from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.render import render, render_text
from ds4jax.chat.spm_tokenizer import SpmTokenizer, train_spm
from ds4jax.demo.corpus import (
    CITIES,
    held_out_tasks,
    run_tool,
    training_bodies,
    weather_report,
)
from ds4jax.demo.train import assistant_mask, encode_corpus, finished_conversation


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> SpmTokenizer:
    d = tmp_path_factory.mktemp("spm")
    text = "\n".join(render_text(parse_messages_request(b).conversation)
                     for b in training_bodies(400, 7))  # fmt: skip
    (d / "c.txt").write_text(text, encoding="utf-8")
    return SpmTokenizer(train_spm(d / "c.txt", 600, d / "demo"))


def test_bodies_are_valid_requests_and_reproducible() -> None:
    a, b = training_bodies(50, 3), training_bodies(50, 3)
    assert a == b and a != training_bodies(50, 4)
    for body in a:
        parse_messages_request(body)  # every example is a request the server accepts
    tools = {m["content"][-1].get("name") for body in a for m in body["messages"][1:2]}
    assert {"add", "get_weather"} <= tools


def test_tools_compute_what_the_answers_quote() -> None:
    assert run_tool("add", {"a": 12, "b": 30}) == "42"
    assert run_tool("get_weather", {"city": "Paris"}) == weather_report("Paris")
    assert len({weather_report(c) for c in CITIES}) > len(CITIES) // 2
    with pytest.raises(ValueError):
        run_tool("rm", {})


def test_held_out_prompts_are_disjoint_from_training() -> None:
    seen = {b["messages"][0]["content"] for b in training_bodies(3000, 0)}
    tasks = held_out_tasks(50, 99, seen)
    assert len(tasks) == 50 and not {t.prompt for t in tasks} & seen
    assert sum(t.tool == "add" for t in tasks) == 25
    assert all(t.tool == "get_weather" for t in tasks[1::2])


def test_mask_covers_exactly_the_assistant_turns(spm: SpmTokenizer) -> None:
    body = training_bodies(20, 5)[0]
    ids = spm.encode_segments(render(finished_conversation(body)))
    mask = assistant_mask(ids, spm)
    picked = [t for t, m in zip(ids, mask, strict=True) if m]
    # every assistant turn, the last one too, ends with its EOS: that teaches stopping
    turns = sum(m["role"] == "assistant" for m in body["messages"])
    assert picked.count(spm.eos_id) == ids.count(spm.eos_id) == turns >= 1
    assert ids[-1] == spm.eos_id
    text = spm.decode(picked)
    assert specials.USER not in text and "<tool_result>" not in text
    assert "## Tools" not in text
    calls = [m for m in body["messages"] if m["role"] == "assistant"]
    for m in calls:
        for block in m["content"]:
            if block["type"] == "text":
                assert block["text"] in text
            if block["type"] == "tool_use":
                assert f'invoke name="{block["name"]}"' in text


def test_encoded_corpus_splits_at_the_first_user_turn(spm: SpmTokenizer) -> None:
    bodies = training_bodies(30, 6)
    corpus = encode_corpus(bodies, spm, 200)
    user = spm.special_id(specials.USER)
    for i, body in enumerate(bodies):
        ids = spm.encode_segments(render(finished_conversation(body)))
        prefix = corpus.prefixes[corpus.group[i]]
        n = len(ids) - len(prefix)
        assert ids[: len(prefix)] == prefix and corpus.suffix[i, 0] == user
        assert list(corpus.suffix[i, :n]) == ids[len(prefix) :]
        assert corpus.mask[i, n:].sum() == 0
    with pytest.raises(ValueError, match="after the prefix"):
        encode_corpus(bodies, spm, 20)
