"""Many conversations on one engine: resident sessions, fork points, routing (issue 13).

The engine here is the tiny config in exact math (quantization simulation off) with the
pool on, so "continued equals cold" is checked to float32 rounding. Hypothesis interleaves
two to six scripted conversations — agents sharing one system prompt and tool list (a
sub-agent's situation), each running tool loops (one or two parallel calls, teacher
forced), greedy answers, retries, side requests, and tool_result-only requests that must be
refused — and checks each request against the single-session rules and each conversation
against itself run alone.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.continuation.types import LIVE_GONE_MESSAGE, CacheSource
from ds4jax.engine import Engine, EngineError, Prepared, Result, SamplingParams
from tests.continuation.conftest import TOOLS, forced, like

#: many steps of a few programs: compiled as served (`tests/conftest.py`)
pytestmark = pytest.mark.optimized

SYSTEM = "You are one of several agents working on the same repository."
GREEDY = SamplingParams(temperature=0.0)
STEPS = ["next", "next", "retry", "side", "refused"]
STEPS = ["next", "next", "retry", "side", "refused"]


@pytest.fixture(scope="module")
def pool_engine(_engine: Engine) -> Engine:
    return Engine(
        _engine.cfg,
        _engine.params,
        _engine.tokenizer,
        max_len=_engine.max_len,
        chunk_sizes=_engine.chunk_sizes,
        sessions=6,
        fork_points=True,
    )


def fresh(engine: Engine, sessions: int, budget_states: int | None = None,
          budget_bytes: int | None = None) -> Engine:  # fmt: skip
    """`engine` with no session or tool memory, under a budget of `budget_states` dense
    states or `budget_bytes` (a paged engine's few pages), or none."""
    if budget_states is not None:
        budget_bytes = budget_states * engine.state_nbytes
    engine._pool_args["budget"] = budget_bytes
    engine.pool = type(engine.pool).create(sessions, **engine._pool_args)
    engine.tool_memory = type(engine.tool_memory)()
    return engine


def calls_text(commands: list[str]) -> str:
    invokes = "".join(
        '<｜DSML｜invoke name="bash">\n'
        f'<｜DSML｜parameter name="command" string="true">{c}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        for c in commands
    )
    return f"I should run it.</think>\n\n<｜DSML｜tool_calls>\n{invokes}</｜DSML｜tool_calls>"


def prepared(engine: Engine, body: dict[str, Any], max_tokens: int) -> Prepared:
    return engine.prepare_request(
        parse_messages_request(body), max_tokens=max_tokens, sampling=GREEDY
    )


# ------------------------------------------------------------------ retry = fork point


def test_a_retry_reuses_the_whole_prompt_and_equals_a_cold_prefill(pool_engine, caplog):
    engine = fresh(pool_engine, 4)
    body = {"system": SYSTEM, "tools": TOOLS,
            "messages": [{"role": "user", "content": "List the files, please."}]}  # fmt: skip
    first = engine.run(prepared(engine, body, 4))
    owner, owner_live = first.session, engine.pool.sessions[first.session].live
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        retry = engine.run(prepared(engine, body, 4))
    assert retry.source is CacheSource.FORK and retry.forked_from == owner
    assert retry.prefilled == 0 and retry.cached == first.prompt_tokens
    assert retry.session != owner  # a new session; the owner's frontier is untouched
    assert engine.pool.sessions[owner].live is owner_live
    assert f"fork from={owner} at={first.prompt_tokens} session={retry.session}" in caplog.text
    assert retry.raw_text == first.raw_text  # greedy: the same reply
    point = next(f for f in engine.pool.forks if f.frontier.pos == first.prompt_tokens)
    cold = engine.logits_for(point.frontier.tokens)
    assert np.abs(cold - np.asarray(point.frontier.state.logits)).max() <= 1e-5
    assert engine.stats()["hits"] == {**{s.value: 0 for s in CacheSource}, "none": 1,
                                      "fork-point": 1}  # fmt: skip


def tool_call_and_follow(engine: Engine) -> tuple[Result, dict]:
    """A task whose reply is a (forced) `bash ls` call, and the request that replays the
    call and sends its result: the body that continues the live state by tool id."""
    main = {"system": SYSTEM, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Fix the failing test."}]}  # fmt: skip
    res = engine.run(prepared(engine, main, 200), forced_tokens=forced(engine, calls_text(["ls"])))
    follow = copy.deepcopy(main)
    follow["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should run it."},
            {"type": "tool_use", "id": res.tool_ids[0], "name": "bash", "input": {"command": "ls"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": res.tool_ids[0], "content": "a.py"}]},
    ]  # fmt: skip
    return res, follow


def play_both(reference: Engine, other: Engine, plan, budget_states: int | None = None,
              budget_bytes: int | None = None):  # fmt: skip
    """An `interleavings` plan played on a reference engine and on `other` (its budget in
    states or bytes, if any), each with a session per conversation line: (want, got)."""
    scripts, parallel, order = plan
    lines = sum(1 + s.count("retry") + s.count("side") for s in scripts)
    want = play(fresh(reference, lines), dict(enumerate(scripts)), parallel, order)
    other = fresh(other, lines, budget_states, budget_bytes)
    got = play(other, dict(enumerate(scripts)), parallel, order)
    return want, got


def same_outcomes(got: dict, want: dict, source: bool = True) -> bool:
    """Two `play`s gave the same outcome kinds and texts (and sources, with `source`)."""

    def view(out: dict) -> dict:
        return {i: [(o.kind, o.source if source else None, o.text) for o in run]
                for i, run in out.items()}  # fmt: skip

    return view(got) == view(want)


def test_a_side_request_never_takes_the_main_session(pool_engine):
    engine = fresh(pool_engine, 2)
    res, follow = tool_call_and_follow(engine)
    side = {"system": SYSTEM, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Write a title for this chat."}]}  # fmt: skip
    assert engine.run(prepared(engine, side, 2)).session != res.session
    back = engine.run(prepared(engine, follow, 2))
    assert back.source is CacheSource.LIVE_TOOL and back.session == res.session


def test_a_reply_cut_short_still_shares_its_prompt(pool_engine):
    """Thinking on, no tools: the next request replays the turn as `<｜Assistant｜></think>…`,
    so it continues from the fork point kept just before the prompt's `<think>`."""
    engine = fresh(pool_engine, 2)
    ask = {"role": "user", "content": "Tell me about JAX."}
    first = engine.run(prepared(engine, {"messages": [ask]}, 3))
    assert first.finish == "max_tokens"
    body = {"messages": [ask, {"role": "assistant", "content": "JAX is"},
                         {"role": "user", "content": "Go on."}]}  # fmt: skip
    req = prepared(engine, body, 2)
    res = engine.run(req)
    assert res.source is CacheSource.FORK and res.cached == first.prompt_tokens - 1
    prompt = engine.pool.sessions[res.session].live.tokens[: res.cached + res.prefilled]
    assert engine.tokenizer.decode(prompt) == "".join(s.text for s in req.view.segments)
    point = next(f for f in engine.pool.forks if f.frontier.tokens == prompt)
    cold = engine.logits_for(prompt)
    assert np.abs(cold - np.asarray(point.frontier.state.logits)).max() <= 1e-5


def test_single_session_engine_keeps_the_original_rules(engine):
    # (the reset engine: a test before may have switched its pool's fork points on)
    assert len(engine.pool.sessions) == 1 and not engine.pool.keep_forks


def test_the_budget_counts_what_a_state_really_holds(_engine):
    assert _engine.state_nbytes == sum(x.nbytes for x in jax.tree.leaves(_engine._empty))


def test_a_budget_smaller_than_one_state_is_refused(_engine):
    with pytest.raises(ValueError, match="holds no state"):
        like(_engine, state_budget_bytes=10)


# ------------------------------------------------------------------ interleavings


@dataclass
class Conversation:
    """One agent's client: its history, the tool call awaiting results, its last request."""

    index: int
    messages: list[dict] = field(default_factory=list)
    pending: tuple[list[str], list[str]] | None = None  # (ids, commands)
    last: tuple[dict, list[int] | None, int] | None = None  # (body, forced, max_tokens)
    turn: int = 0

    def body(self, messages: list[dict]) -> dict:
        return {"system": SYSTEM, "tools": TOOLS, "messages": messages}

    def replayed_call(self) -> list[dict]:
        ids, commands = self.pending
        call = [{"type": "thinking", "thinking": "I should run it."}]
        call += [{"type": "tool_use", "id": i, "name": "bash", "input": {"command": c}}
                 for i, c in zip(ids, commands, strict=True)]  # fmt: skip
        results = [{"type": "tool_result", "tool_use_id": i, "content": f"ran {c}"}
                   for i, c in zip(ids, commands, strict=True)]  # fmt: skip
        return [{"role": "assistant", "content": call}, {"role": "user", "content": results}]


@dataclass
class Outcome:
    kind: str  # "ok" | "400" | "409"
    source: CacheSource | None = None
    text: str = ""


def run_step(engine: Engine, conv: Conversation, step: str, parallel: bool) -> Outcome:
    """One client action; asserts the per-request properties and returns what happened."""
    if step == "refused":
        if conv.pending is not None and len(conv.pending[0]) == 2:
            # answer one of two live calls, without replaying them: a 409, nothing changes
            ids = conv.pending[0][:1]
            expect = "409"
        else:
            ids, expect = ["toolu_" + "0" * 31 + str(conv.index)], "400"
        results = [{"type": "tool_result", "tool_use_id": i, "content": "x"} for i in ids]
        body = conv.body([{"role": "user", "content": results}])
        before = [(s.live, s.bindings.tool, s.bindings.thinking) for s in engine.pool.sessions]
        forks_before = list(engine.pool.forks)
        with pytest.raises(EngineError) as err:
            engine.run(prepared(engine, body, 2))
        assert str(err.value.status) == expect
        if expect == "409":
            assert err.value.message == LIVE_GONE_MESSAGE
        after = [(s.live, s.bindings.tool, s.bindings.thinking) for s in engine.pool.sessions]
        assert after == before and engine.pool.forks == forks_before
        return Outcome(expect)

    if step == "retry" and conv.last is not None:
        body, force, max_tokens = conv.last
    elif step == "side":  # a title request over the finished part of the history
        body = conv.body([*conv.messages, {"role": "user", "content": "Title this chat."}])
        force, max_tokens = None, 2
    elif conv.pending is not None:  # the tool results: must continue live
        conv.messages += conv.replayed_call()
        conv.pending = None
        body, force, max_tokens = conv.body(list(conv.messages)), None, 3
    else:  # a new task: the model calls one or two tools
        conv.turn += 1
        if conv.messages and conv.messages[-1]["role"] != "assistant":
            conv.messages.append({"role": "assistant", "content": "Done."})
        conv.messages.append(
            {"role": "user", "content": f"Task {conv.index}.{conv.turn}: inspect the tree."}
        )
        commands = [f"ls {conv.index}{conv.turn}"] + (
            [f"cat {conv.index}{conv.turn}"] if parallel else []
        )
        force = forced(engine, calls_text(commands))
        body, max_tokens = conv.body(list(conv.messages)), 200
        conv.pending = ([], commands)

    req = prepared(engine, body, max_tokens)
    retained = {f.frontier.tokens for f in engine.pool.forks}
    lives = {s.slot: s.live for s in engine.pool.sessions}
    res: Result = engine.run(req, forced_tokens=force)
    live = engine.pool.sessions[res.session].live
    prompt = live.tokens[: res.cached + res.prefilled]

    # cached + prefilled is the prompt: the request's own render, or, on the live tool
    # path, the sampled state + EOS + the tool-result turn
    if res.source is CacheSource.LIVE_TOOL:
        assert lives[res.session] is not None and res.cached == lives[res.session].pos
        assert prompt[res.cached] == engine.tokenizer.eos_id
    else:
        assert engine.tokenizer.decode(prompt) == "".join(s.text for s in req.view.segments)
    if step == "retry" and force is not None and req.view.tokens in retained:
        assert res.source is CacheSource.FORK and res.prefilled == 0
    if res.source is CacheSource.FORK:
        assert lives[res.forked_from] is engine.pool.sessions[res.forked_from].live or (
            res.forked_from == res.session and len(engine.pool.sessions) == 1
        )
    budget = engine.pool.budget
    assert budget is None or engine.pool.state_bytes() <= budget

    conv.last = (body, force, max_tokens)
    if force is not None:
        conv.pending = (res.tool_ids, conv.pending[1])
        assert len(res.tool_ids) == len(conv.pending[1])
    return Outcome("ok", res.source, res.raw_text)


@st.composite
def interleavings(draw):
    n = draw(st.integers(2, 6))
    scripts = [draw(st.lists(st.sampled_from(STEPS), min_size=1, max_size=4)) for _ in range(n)]
    parallel = [draw(st.booleans()) for _ in range(n)]
    order = draw(st.permutations([i for i, s in enumerate(scripts) for _ in s]))
    return scripts, parallel, order


def play(engine: Engine, scripts: dict[int, list[str]], parallel, order) -> dict:
    convs = {i: Conversation(i) for i in scripts}
    cursor = dict.fromkeys(scripts, 0)
    out: dict[int, list[Outcome]] = {i: [] for i in scripts}
    for i in order:
        step = scripts[i][cursor[i]]
        cursor[i] += 1
        out[i].append(run_step(engine, convs[i], step, parallel[i]))
    return out


def tool_result_turns(script: list[str]) -> int:
    """How many steps of a script send tool results (the client model of `run_step`)."""
    pending, last, n = False, None, 0
    for step in script:
        if step == "retry" and last is not None:
            step = last
            if step == "call":
                pending = True
            continue
        if step == "side":
            last = "side"
        elif step in ("next", "retry"):
            if pending:
                n, pending, last = n + 1, False, "answer"
            else:
                pending, last = True, "call"
    return n


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])  # fmt: skip
@given(plan=interleavings(), tight=st.booleans())
def test_interleaved_conversations_each_behave_as_if_alone(pool_engine, plan, tight):
    scripts, parallel, order = plan
    # enough sessions for every line of conversation (each retry and side request forks
    # or opens one); `tight` adds a state budget that forces fork-point evictions
    lines = sum(1 + s.count("retry") + s.count("side") for s in scripts)
    engine = fresh(pool_engine, lines, budget_states=lines + 2 if tight else None)
    scripts = dict(enumerate(scripts))
    together = play(engine, scripts, parallel, order)
    for i, outcomes in together.items():
        # every tool-result turn continued live
        live = [o for o in outcomes if o.source is CacheSource.LIVE_TOOL]
        assert len(live) == tool_result_turns(scripts[i])
        alone = play(fresh(pool_engine, lines), {i: scripts[i]}, parallel, [i] * len(scripts[i]))
        assert [(o.kind, o.text) for o in outcomes] == [(o.kind, o.text) for o in alone[i]]
