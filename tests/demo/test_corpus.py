"""The demo corpus: what the model is trained on must be what the server renders."""

from __future__ import annotations

import random

import pytest

from ds4jax.chat import specials
from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.render import render, render_text
from ds4jax.chat.spm_tokenizer import SpmTokenizer, train_spm
from ds4jax.demo.corpus import (
    CITIES,
    KINDS,
    REFUSAL,
    draw_task,
    held_out,
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
    a, b = training_bodies(80, 3), training_bodies(80, 3)
    assert a == b and a != training_bodies(80, 4)
    for body in a:
        parse_messages_request(body)  # every example is a request the server accepts
    tools = {
        block.get("name")
        for body in a
        for m in body["messages"]
        if m["role"] == "assistant"
        for block in m["content"]
    }
    assert {"add", "get_weather"} <= tools


def test_tools_compute_what_the_answers_quote() -> None:
    assert run_tool("add", {"a": 12, "b": 30}) == "42"
    assert run_tool("get_weather", {"city": "Paris"}) == weather_report("Paris")
    assert weather_report("paris") == weather_report("PARIS") == weather_report("Paris")
    assert len({weather_report(c) for c in CITIES}) > len(CITIES) // 2
    with pytest.raises(ValueError):
        run_tool("rm", {})


def test_every_kind_of_conversation_is_drawn() -> None:
    rng = random.Random(0)
    tasks = [draw_task(rng) for _ in range(600)]
    kinds = {t.kind for t in tasks}
    assert kinds == set(KINDS)
    parallel = [t for t in tasks if t.kind == "parallel"]
    assert {len(t.rounds[0].calls) for t in parallel} == {2, 3}
    follow = [t for t in tasks if t.kind == "followup"]
    assert all(len(t.rounds) == 2 for t in follow)

    # "now add 5 to that": the previous result is the first operand
    def chained(t) -> bool:
        first, second = t.rounds[0].calls[0], t.rounds[1].calls
        return (
            bool(second)
            and first.tool == "add"
            and second[0].args["a"] == int(run_tool("add", first.args))
        )

    assert any(chained(t) for t in follow)
    assert any(not t.rounds[1].calls and t.rounds[1].reply for t in follow)  # from history
    assert all(t.rounds[0].reply == REFUSAL for t in tasks if t.kind == "refusal")
    # arguments are the operands as the sentence mentions them (separators dropped)
    for t in tasks:
        for r in t.rounds:
            for c in r.calls:
                if c.tool == "get_weather":
                    assert c.args["city"] in r.prompt
                elif r is t.rounds[0] or t.kind != "followup":
                    for v in (c.args["a"], c.args["b"]):
                        assert str(v) in r.prompt or f"{v:,}" in r.prompt, r.prompt


@pytest.mark.parametrize("kind", ["single", "parallel", "followup", "refusal"])
def test_held_out_prompts_come_from_templates_training_never_saw(kind: str) -> None:
    """Training draws only training templates; the held-out draw only held-out ones: no
    sentence frame of the evaluation occurs in training, though its parts all do."""
    rng = random.Random(1)
    train = [draw_task(rng, kind=kind) for _ in range(400)]
    held = held_out_tasks(60, 5, kind)
    assert not any(held_out(t.template) for t in train)
    assert all(held_out(t.template) for t in held)
    assert not {t.template for t in train} & {t.template for t in held}
    assert len({t.template for t in held}) > 30  # many frames, not a few


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
    corpus = encode_corpus(bodies, spm, (64, 400))
    user = spm.special_id(specials.USER)
    for i, body in enumerate(bodies):
        ids = spm.encode_segments(render(finished_conversation(body)))
        prefix = corpus.prefixes[corpus.group[i]]
        n = len(ids) - len(prefix)
        assert ids[: len(prefix)] == prefix and corpus.suffix[i, 0] == user
        assert list(corpus.suffix[i, :n]) == ids[len(prefix) :]
        assert corpus.mask[i, n:].sum() == 0
        assert corpus.bucket[i] == (0 if n <= 64 else 1)
    with pytest.raises(ValueError, match="after the prefix"):
        encode_corpus(bodies, spm, (20,))
