"""The engine's decision paths on a real model: which state a request continues from, what
it prefills, and that a continued state is exactly a cold prefill of the same tokens."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import jax
import numpy as np
import pytest

from ds4jax.continuation.types import CacheSource
from ds4jax.engine import Engine, EngineError, SamplingParams
from ds4jax.model import batch as batch_ops
from tests.continuation.conftest import TOOLS, forced, like, prepare, tool_call_text

SYSTEM = "You are a careful coding agent."


def first_turn(engine: Engine, command: str = "ls -la"):
    body = {"system": SYSTEM, "tools": TOOLS, "messages": [{"role": "user", "content": "list"}]}
    res = engine.run(
        prepare(engine, body, 200), forced_tokens=forced(engine, tool_call_text(command))
    )
    assert res.finish == "tool_use" and len(res.tool_ids) == 1
    return body, res


def tool_loop_body(body, res, result="a.txt\nb.txt", input_json=None):
    tid = res.tool_ids[0]
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I should run it.", "signature": "s"},
            {
                "type": "tool_use",
                "id": tid,
                "name": "bash",
                "input": input_json or {"command": "ls -la"},
            },
        ],
    }
    user = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": tid, "content": result}],
    }
    return dict(body, messages=[*body["messages"], assistant, user])


def assert_cold_equivalent(engine: Engine) -> None:
    live = engine.live
    cold = engine.logits_for(live.tokens)
    assert np.abs(cold - np.asarray(live.state.logits)).max() <= 1e-5


def test_live_tool_result_appends_only_the_suffix(engine: Engine, caplog) -> None:
    body, res1 = first_turn(engine)
    live_pos = engine.live.pos
    req = prepare(engine, tool_loop_body(body, res1), 1)
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        res2 = engine.run(req, forced_tokens=[])
    assert res2.source == CacheSource.LIVE_TOOL
    assert res2.cached == live_pos
    # only EOS + <U><tool_result>…</tool_result><A><think> was evaluated
    assert 0 < res2.prefilled < 20
    assert res2.cached + res2.prefilled == len(engine.live.tokens)
    assert (
        f"anthropic live continuation match=tool-output-ids ids=1 cached={live_pos}" in caplog.text
    )
    assert "prompt done" in caplog.text
    # exact replay of the sampled DSML makes the effective tokens the request's own tokens
    assert tuple(engine.live.tokens) == req.view.tokens
    assert_cold_equivalent(engine)


def test_reserialised_tool_json_still_replays_the_sampled_bytes(engine: Engine) -> None:
    body, res1 = first_turn(engine, command='echo "a" && ls')
    sampled_text = engine.tokenizer.decode(engine.live.tokens)
    # the client reorders keys and adds one: ids map to the sampled block, so it renders as sampled
    req = prepare(
        engine, tool_loop_body(body, res1, input_json={"command": 'echo "a" && ls', "x": 1})
    )
    text = "".join(s.text for s in req.view.segments)
    assert text.startswith(sampled_text)


def test_unknown_tool_result_id_is_a_400_that_changes_nothing(engine: Engine) -> None:
    first_turn(engine)
    before = (engine.live, engine.bindings.tool)
    bad = {
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}],
            }
        ],
    }
    with pytest.raises(EngineError) as info:
        prepare(engine, bad)
    assert info.value.status == 400
    assert info.value.message == (
        "Anthropic continuation state is not available for tool_use_id toolu_nope; "
        "retry by replaying the full messages history"
    )
    assert (engine.live, engine.bindings.tool) == before


def test_tool_result_only_request_gets_409_when_the_live_state_moved(engine: Engine) -> None:
    _, res1 = first_turn(engine)
    tid = res1.tool_ids[0]
    only_results = {
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tid, "content": "x"}],
            }
        ],
    }
    req = prepare(engine, only_results)  # valid now: the id is live
    assert req.view.requires_live
    # another request moves the live state before this one runs
    other = {"messages": [{"role": "user", "content": "something else"}]}
    engine.run(prepare(engine, other), forced_tokens=[])
    before = (engine.live, engine.bindings.tool, engine.bindings.thinking)
    with pytest.raises(EngineError) as info:
        engine.run(req)
    assert info.value.status == 409
    assert info.value.message == (
        "Anthropic continuation state is not available; "
        "retry by replaying the full messages history"
    )
    assert (engine.live, engine.bindings.tool, engine.bindings.thinking) == before


def test_full_replay_with_a_stale_id_falls_back_to_prefix_matching(engine: Engine) -> None:
    body, res1 = first_turn(engine)
    follow = tool_loop_body(body, res1)
    engine.reset()  # a restart: RAM state gone
    req = prepare(engine, follow)  # the tool_use is replayed, so the id needs no live state
    res = engine.run(req, forced_tokens=[])
    assert res.source == CacheSource.COLD
    assert res.prefilled == len(req.view.tokens)


def test_token_prefix_and_text_prefix_paths(engine: Engine) -> None:
    body = {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Say hi"}]}
    res1 = engine.run(prepare(engine, body), forced_tokens=forced(engine, "Hi there"))
    assert res1.source == CacheSource.COLD and res1.finish == "end_turn"
    follow = dict(
        body,
        messages=[*body["messages"], {"role": "assistant", "content": "Hi there"},
                  {"role": "user", "content": "again"}],
    )  # fmt: skip
    req = prepare(engine, follow)
    live_len = engine.live.pos
    res2 = engine.run(req, forced_tokens=[])
    assert res2.source == CacheSource.TOKEN_PREFIX and res2.cached == live_len
    assert res2.cached + res2.prefilled == len(req.view.tokens)
    assert_cold_equivalent(engine)

    # text prefix: the model emitted "s" + "trand" where the render tokenizes "strand"
    engine.reset()
    body = {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "word?"}]}
    split = engine.tokenizer.encode_text("s") + engine.tokenizer.encode_text("trand")
    engine.run(prepare(engine, body), forced_tokens=split)
    follow = dict(
        body,
        messages=[*body["messages"], {"role": "assistant", "content": "strand"},
                  {"role": "user", "content": "ok"}],
    )  # fmt: skip
    req = prepare(engine, follow)
    live_tokens = engine.live.tokens
    res3 = engine.run(req, forced_tokens=[])
    assert res3.source == CacheSource.TEXT_PREFIX
    assert engine.live.tokens[: len(live_tokens)] == live_tokens  # sampled tokens kept
    assert engine.tokenizer.decode(engine.live.tokens) == "".join(s.text for s in req.view.segments)
    assert_cold_equivalent(engine)


def test_thinking_visible_continuation_keeps_reasoning_and_evaluates_eos(engine: Engine) -> None:
    body = {"messages": [{"role": "user", "content": "2+2?"}]}  # thinking on, no tools
    res1 = engine.run(prepare(engine, body), forced_tokens=forced(engine, "add them</think>4"))
    assert res1.finish == "end_turn" and res1.message.reasoning == "add them"
    assert engine.bindings.thinking is not None
    follow = {
        "messages": [
            *body["messages"],
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "add them"},
                    {"type": "text", "text": "4"},
                ],
            },
            {"role": "user", "content": "and 3+3?"},
        ]
    }
    req = prepare(engine, follow)
    assert "add them" not in "".join(s.text for s in req.view.segments)  # dropped on replay
    pos = engine.live.pos
    res2 = engine.run(req, forced_tokens=[])
    assert res2.source == CacheSource.THINKING_VISIBLE and res2.cached == pos
    eos = engine.tokenizer.eos_id
    assert engine.live.tokens[pos] == eos  # the EOS fix: the turn's EOS is evaluated
    assert "add them" in engine.tokenizer.decode(engine.live.tokens)  # sampled state kept
    assert_cold_equivalent(engine)


def test_cancel_leaves_a_consistent_frontier(engine: Engine) -> None:
    body = {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "go"}]}
    cancel = threading.Event()
    seen = []

    def on_event(ev):
        seen.append(ev)
        cancel.set()

    res = engine.run(prepare(engine, body, 50), on_event=on_event, cancel=cancel,
                     forced_tokens=forced(engine, "one two three four five six"))  # fmt: skip
    assert res.finish == "cancelled"
    assert len(engine.live.tokens) < len(prepare(engine, body).view.tokens) + 6
    assert_cold_equivalent(engine)


def test_stop_sequence_truncates_and_reports(engine: Engine) -> None:
    body = {
        "thinking": {"type": "disabled"},
        "stop_sequences": ["STOP"],
        "messages": [{"role": "user", "content": "go"}],
    }
    res = engine.run(prepare(engine, body, 50), forced_tokens=forced(engine, "hello STOP world"))
    assert res.finish == "stop_sequence" and res.stop_sequence == "STOP"
    assert res.message.content == "hello "


def _choice_request(engine: Engine, tool_choice: dict, thinking: bool = False, budget=None,
                    tools: list | None = None, sampling: SamplingParams | None = None):  # fmt: skip
    from ds4jax.chat.anthropic import parse_messages_request

    body = {
        "tools": tools or TOOLS,
        "tool_choice": tool_choice,
        "messages": [{"role": "user", "content": "x"}],
    }
    if not thinking:
        body["thinking"] = {"type": "disabled"}
    elif budget is not None:
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
    req = parse_messages_request(body)
    return engine.prepare(
        req.conversation, max_tokens=120, has_tools=True, tool_choice=req.tool_choice,
        thinking_budget=req.thinking_budget, sampling=sampling,
    )  # fmt: skip


def test_tool_choice_tool_forces_the_call_opening_and_the_name(engine: Engine) -> None:
    rest = (
        'parameter name="command" string="true">ls</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    res = engine.run(
        _choice_request(engine, {"type": "tool", "name": "bash"}),
        forced_tokens=forced(engine, "<｜DSML｜" + rest),
    )
    assert res.finish == "tool_use"
    assert [(c.name, c.arguments) for c in res.message.tool_calls] == [("bash", {"command": "ls"})]
    assert res.message.content == ""  # nothing before the forced block


def test_tool_choice_any_with_one_tool_forces_its_name(engine: Engine) -> None:
    """`any` with a single declared tool can only mean that tool: its name is forced too
    (the demo model, told `any` with one tool `add`, called `get_weather` in 10 of 12)."""
    prepared = _choice_request(engine, {"type": "any"})
    assert prepared.force_after_think.endswith('<｜DSML｜invoke name="bash">\n')
    res = engine.run(prepared, forced_tokens=forced(engine, (
        '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")))  # fmt: skip
    assert [(c.name, c.arguments) for c in res.message.tool_calls] == [("bash", {"command": "ls"})]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_any_among_several_tools_names_a_declared_one(engine: Engine,
                                                                  temperature) -> None:  # fmt: skip
    """With several tools the model picks the name, but only among the declared ones
    (`chat.tool_names`): the tiny random model, free, spelled names nobody declared."""
    names = ["bash", "read_file", "grep_search", "WebFetch"]
    tools = [{**TOOLS[0], "name": n} for n in names]
    seen = []
    for seed in range(4 if temperature else 1):
        sampling = SamplingParams(temperature=temperature, seed=seed)
        prepared = _choice_request(engine, {"type": "any"}, tools=tools, sampling=sampling)
        assert prepared.tool_names == tuple(names)
        assert prepared.force_after_think.endswith('<｜DSML｜invoke name="')
        res = engine.run(prepared)
        called = re.search(r'<｜DSML｜invoke name="([^"]*)">\n', res.raw_text)
        assert called is not None and called.group(1) in names, res.raw_text[:200]
        seen.append(called.group(1))
    assert len(seen) == (4 if temperature else 1)


def test_every_call_of_a_forced_block_is_held_to_the_declared_names(engine: Engine) -> None:
    """A second call in the block (the model opens another `invoke name="`) is held to the
    declared names as the forced one was; the name ends at its line, then the row samples
    freely. The row's decoder, driven token by token."""
    from ds4jax.chat.segments import template
    from ds4jax.chat.tool_names import NAME_END
    from ds4jax.decoding import CHOOSE, SAMPLE, RowDecoder

    names = ["bash", "read_file", "grep_search"]
    tools = [{**TOOLS[0], "name": n} for n in names]
    prepared = _choice_request(engine, {"type": "any"}, tools=tools)
    tok = engine.tokenizer
    dec = RowDecoder(engine, prepared, engine.pool.sessions[0], list(prepared.view.tokens),
                     prepared.view.segments, lambda _e: None, None, None)  # fmt: skip

    def spell(name: str) -> None:
        for t in tok.encode_text(name + NAME_END):
            planned = dec.plan()
            assert (planned == CHOOSE and t in dec.choices) or planned == t, (name, planned)
            assert all(any(g.startswith(dec.name_written + tok.token_bytes(c))
                           for g in dec.name_goals) for c in dec.choices)  # fmt: skip
            dec.accept(t)
        assert dec.name_written is None and dec.plan() == SAMPLE

    while (planned := dec.plan()) not in (CHOOSE, SAMPLE):  # the forced opening
        dec.accept(planned)
    assert dec.raw.endswith('invoke name="') and dec.name_written == b""
    spell("read_file")
    between = '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
    between += '</｜DSML｜invoke>\n<｜DSML｜invoke name="'
    for t in tok.encode_segments(template(between)):
        dec.accept(t)
    assert dec.name_written == b""  # the second call's name is held too
    assert dec.plan() == CHOOSE and tok.encode_text("add")[0] not in dec.choices
    spell("bash")


def test_a_token_running_past_a_call_opening_is_held_and_the_window_steps_plain(
    engine: Engine,
) -> None:
    """A sampled token may straddle a second call's opening into its name (V4's `"github`
    after `invoke name=`): the name is held from what it wrote. And the row counts as
    naming (plain steps, no speculation) while its text could still become a call's
    opening or spells a name, not while it writes a call's arguments."""
    from ds4jax.chat.segments import template
    from ds4jax.decoding import CHOOSE, SAMPLE, RowDecoder

    names = ["github_search", "bash"]
    tools = [{**TOOLS[0], "name": n} for n in names]
    prepared = _choice_request(engine, {"type": "any"}, tools=tools)
    tok = engine.tokenizer
    dec = RowDecoder(engine, prepared, engine.pool.sessions[0], list(prepared.view.tokens),
                     prepared.view.segments, lambda _e: None, None, None)  # fmt: skip
    assert not dec.naming  # the opening is not forced yet
    while (planned := dec.plan()) not in (CHOOSE, SAMPLE):
        dec.accept(planned)
    assert dec.naming
    for t in tok.encode_text('bash">\n'):
        dec.accept(t)
    for t in tok.encode_segments(template('<｜DSML｜parameter name="command" string="true">')):
        dec.accept(t)
    assert dec.name_written is None and not dec.naming  # its arguments: it may speculate
    for t in tok.encode_segments(template("ls</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜")):
        dec.accept(t)
    assert dec.naming  # its text could become a call's opening
    for t in tok.encode_segments(template("invoke name=")):
        dec.accept(t)
    straddle = next(t for t, b in ((t, tok.token_bytes(t)) for t in range(tok.vocab_size))
                    if b == b'"github')  # fmt: skip
    dec.accept(straddle)
    assert dec.name_written == b"github" and dec.naming
    planned = dec.plan()
    choices = [tok.token_bytes(c) for c in dec.choices] if planned == CHOOSE else [
        tok.token_bytes(planned)]  # fmt: skip
    assert all(b'github_search">\n'.startswith(b"github" + c) for c in choices)


def test_a_forced_call_survives_an_eos_sampled_while_thinking(engine: Engine) -> None:
    """`tool_choice` any must end in a call: an EOS sampled inside the reasoning (seen: 1 in
    12 turns of the demo model) becomes the reasoning's close, then the forced opening; it
    used to end the turn `end_turn` with no call."""
    eos = engine.tokenizer.eos_id
    rest = (
        '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    res = engine.run(
        _choice_request(engine, {"type": "any"}, thinking=True),
        forced_tokens=[*forced(engine, "I am small."), eos, *forced(engine, rest)],
    )
    assert res.finish == "tool_use" and res.message.reasoning == "I am small."
    assert [(c.name, c.arguments) for c in res.message.tool_calls] == [("bash", {"command": "ls"})]
    think_end = engine.tokenizer.special_id("</think>")
    assert eos not in engine.live.tokens and think_end in engine.live.tokens


def test_a_prefill_continues_as_text_with_thinking_on(engine: Engine) -> None:
    """A final assistant turn is rendered after its closed reasoning, so its continuation is
    content — with thinking on too (it came back as a thinking block, and `budget_tokens`
    forced `</think>` into the text)."""
    from ds4jax.chat.anthropic import parse_messages_request

    body = {"messages": [{"role": "user", "content": "What is 12 plus 30?"},
                         {"role": "assistant", "content": "The answer"}],
            "thinking": {"type": "enabled", "budget_tokens": 2}}  # fmt: skip
    req = parse_messages_request(body)
    prepared = engine.prepare(req.conversation, max_tokens=8, has_tools=False,
                              thinking_budget=req.thinking_budget)  # fmt: skip
    assert not prepared.thinking
    res = engine.run(prepared, forced_tokens=forced(engine, " is forty two"))
    assert res.message.reasoning is None and res.message.content == " is forty two"
    assert res.reasoning_tokens == 0


def test_disable_parallel_tool_use_closes_the_block_after_one_call(engine: Engine) -> None:
    two_calls = (
        tool_call_text("ls")
        .replace("I should run it.</think>", "")
        .replace(
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
            '</｜DSML｜invoke>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" '
            'string="true">pwd</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        )
    )
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    res = engine.run(_choice_request(engine, choice), forced_tokens=forced(engine, two_calls))
    assert res.finish == "tool_use" and len(res.message.tool_calls) == 1


def test_thinking_budget_forces_the_end_of_reasoning(engine: Engine) -> None:
    req = _choice_request(engine, {"type": "auto"}, thinking=True, budget=3)
    res = engine.run(req, forced_tokens=forced(engine, "a b c d e f g h"))
    assert res.message.reasoning is not None
    assert engine.tokenizer.special_id("</think>") in engine.live.tokens[-res.output_tokens :]


def test_every_state_has_the_placement_warm_up_compiles_for(engine: Engine) -> None:
    """jit compiles a committed argument apart from an uncommitted one, and states taken out
    of the batch are committed: so the empty state, every frontier and every fork point
    must be committed too, or the first live continuation of each chunk size after warm-up
    compiles again (measured: seconds of TTFT on `ds4jax serve`)."""
    engine.pool.keep_forks = True
    body = {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}
    engine.run(prepare(engine, body, 2))
    states = [engine._empty, engine.live.state, *(f.frontier.state for f in engine.pool.forks)]
    assert engine.pool.forks
    for leaf in (x for s in states for x in jax.tree.leaves(s)):
        assert leaf.committed and leaf.devices() == {jax.devices()[0]}


def test_warm_up_compiles_the_burst_a_sampling_row_runs(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up runs each size's burst with the arguments a served row's burst has (shapes,
    dtypes, static arguments alike: one compiled program), so the first streams after
    start-up do not wait out its compile (seen: six streams' first 40 tokens 12–19 s)."""
    calls: list[Any] = []
    real = batch_ops.burst

    def spy(*args: Any, **kw: Any) -> Any:
        shapes = jax.tree.map(lambda x: (np.shape(x), str(getattr(x, "dtype", type(x)))), args)
        calls.append((shapes, kw))
        return real(*args, **kw)

    monkeypatch.setattr(batch_ops, "burst", spy)
    e = like(engine)
    e.warm_up()
    warmed, calls[:] = list(calls), []
    assert [kw["size"] for _, kw in warmed] == [1]
    body = {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}
    e.run(prepare(e, body, 6))
    assert e.bursts and calls and all(call in warmed for call in calls)
