"""Speculative decoding in the engine (`--speculative mtp`, issue 29): requests decoded with
speculative steps come out as without them — greedy text, finish, stop sequences,
cancellation, the live frontier (its tokens and its state) — alone or batched, with the
gate closing speculation while the batch is larger than its bound, and a tool loop
continues live after a speculative turn. The tiny config in exact math, random MTP weights
(drafts nearly always rejected: the rejection path) and teacher-forced turns (forced
second tokens: the kept path); `tests/model/test_speculative_rows.py` keeps right drafts."""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
import pytest

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.continuation.types import CacheSource
from ds4jax.engine import Engine, SamplingParams
from ds4jax.model.forward import decode_step
from ds4jax.model.params import init_params
from tests.continuation.conftest import TOOLS, forced, like, tool_call_text
from tests.continuation.test_batching import GREEDY, active_rows, fresh, ls_result_turn, prepared

TEXTS = ["Name three rivers.", "Count to five.", "What is JAX?"]


def speculating(e: Engine, **kw: Any) -> Engine:
    """`like(e, **kw)` with a random MTP block, speculating in steps of up to 4 rows."""
    mtp = init_params(e.cfg, 5, mtp_layers=1)["mtp"]
    return Engine(e.cfg, {**e.params, "mtp": mtp}, e.tokenizer, max_len=e.max_len,
                  chunk_sizes=e.chunk_sizes, speculative="mtp", speculative_max_batch=4,
                  **kw)  # fmt: skip


@pytest.fixture(scope="module")
def engines(_engine: Engine) -> tuple[Engine, Engine]:
    """(plain, speculative) engines on the same weights, batches of up to 4."""
    kw = dict(sessions=6, fork_points=True, max_batch=4)
    return like(_engine, **kw), speculating(_engine, **kw)


def together(engine: Engine, reqs: list[Any], **kw: Any) -> list[Any]:
    fresh(engine)
    tickets = [engine.submit(r, **kw) for r in reqs]
    while engine.busy:
        engine.tick()
    assert all(t.error is None for t in tickets)
    return [t.result for t in tickets]


def test_speculative_requests_equal_plain_ones(engines) -> None:
    plain, spec = engines
    want = together(plain, [prepared(plain, t, 12) for t in TEXTS])
    before = spec.spec.counts.steps, spec.spec.counts.proposed
    got = together(spec, [prepared(spec, t, 12) for t in TEXTS])
    assert spec.spec.counts.steps > before[0] and spec.spec.counts.proposed > before[1]
    for w, g in zip(want, got, strict=True):
        assert (g.raw_text, g.output_tokens, g.finish) == (w.raw_text, w.output_tokens, w.finish)
        live_w = plain.pool.sessions[w.session].live
        live_g = spec.pool.sessions[g.session].live
        assert live_g.tokens == live_w.tokens
        diff = np.asarray(live_g.state.logits) - np.asarray(live_w.state.logits)
        assert np.abs(diff).max() <= 1e-5


def test_the_gate_steps_plain_while_the_batch_is_larger(engines) -> None:
    plain, spec = engines
    want = together(plain, [prepared(plain, t, 12 - 4 * i) for i, t in enumerate(TEXTS)])
    spec.spec_max_batch = 1
    try:
        fresh(spec)
        tickets = [spec.submit(prepared(spec, t, 12 - 4 * i)) for i, t in enumerate(TEXTS)]
        steps = []
        while spec.busy:
            before = spec.spec.counts.steps
            rows = active_rows(spec)
            spec.tick()
            steps.append((rows, spec.spec.counts.steps - before))
    finally:
        spec.spec_max_batch = 4
    assert all(n == 0 for rows, n in steps if rows > 1)  # the gate held
    assert any(n for rows, n in steps if rows == 1)  # and opened for the last row
    for w, t in zip(want, tickets, strict=True):
        assert (t.result.raw_text, t.result.finish) == (w.raw_text, w.finish)


@pytest.mark.parametrize("case", ["stop", "cancel", "sampled"])
def test_stops_cancels_and_sampling_leave_the_frontier_of_their_tokens(engines, case) -> None:
    plain, spec = engines
    text = "Write a haiku."
    full = together(plain, [prepared(plain, text, 14)])[0]
    cancel = None
    if case == "stop":
        stops = [full.raw_text[5:7]]
        want = together(plain, [prepared(plain, text, 14, stops)])[0]
        got = together(spec, [prepared(spec, text, 14, stops)])[0]
        assert (got.raw_text, got.finish, got.stop_sequence) == (
            want.raw_text, want.finish, want.stop_sequence)  # fmt: skip
    elif case == "cancel":
        fresh(spec)
        cancel = threading.Event()
        ticket = spec.submit(prepared(spec, text, 14), cancel=cancel)
        for _ in range(4):
            spec.tick()
        cancel.set()
        while spec.busy:
            spec.tick()
        got = ticket.result
        assert got.finish == "cancelled" and full.raw_text.startswith(got.raw_text)
    else:
        hot = SamplingParams(temperature=1.0, seed=3)
        got = together(spec, [prepared(spec, t, 14, sampling=hot) for t in TEXTS])[0]
    live = spec.pool.sessions[got.session].live
    cold = spec.logits_for(live.tokens)
    assert np.abs(cold - np.asarray(live.state.logits)).max() <= 1e-5


def test_a_tool_loop_continues_live_after_a_speculative_turn(engines) -> None:
    call = None
    out = []
    for engine in engines:
        fresh(engine)
        call = forced(engine, tool_call_text("ls"))
        body = {"system": "You are an agent.", "tools": TOOLS,
                "messages": [{"role": "user", "content": "list"}]}  # fmt: skip
        req = engine.prepare_request(parse_messages_request(body), max_tokens=200)
        first = engine.submit(req, forced_tokens=call)
        while engine.busy:
            engine.tick()
        follow = ls_result_turn(body, first.result.tool_ids[0])
        res = engine.run(engine.prepare_request(parse_messages_request(follow), max_tokens=8,
                                                sampling=GREEDY))  # fmt: skip
        out.append((res, engine.pool.sessions[res.session].live))
    (plain, plain_live), (spec, spec_live) = out
    assert plain.source is spec.source is CacheSource.LIVE_TOOL
    assert spec.raw_text == plain.raw_text and spec_live.tokens == plain_live.tokens
    assert engines[1].spec.counts.forced > 0  # the forced call went in as second tokens too


def test_paged_rows_speculate_as_dense_ones_decode(engines) -> None:
    """With `--paged`: each step grows a row's table by two tokens and cuts it back to
    what it kept; the pages of a kept position's compressed rows are written, a rejected
    one's never. Outputs and frontiers equal plain decoding's (dense), and so do the
    paged frontiers' pages read back."""
    plain, _ = engines
    paged = speculating(plain, sessions=6, fork_points=True, max_batch=4, paged_pages=256)
    want = together(plain, [prepared(plain, t, 40) for t in TEXTS])
    got = together(paged, [prepared(paged, t, 40) for t in TEXTS])
    assert paged.spec.counts.steps > 0
    for w, g in zip(want, got, strict=True):
        assert (g.raw_text, g.output_tokens, g.finish) == (w.raw_text, w.output_tokens, w.finish)
        live = paged.pool.sessions[g.session].live
        assert live.tokens == plain.pool.sessions[w.session].live.tokens
        assert_pages_hold(paged, live)
    # the next turn of each continues from its pages exactly as from a cold prefill
    nxt = [{"messages": [{"role": "user", "content": t},
                         {"role": "assistant", "content": g.raw_text},
                         {"role": "user", "content": "And then?"}],
            "thinking": {"type": "disabled"}} for t, g in zip(TEXTS, got, strict=True)]  # fmt: skip
    second = together(paged, [paged.prepare_request(parse_messages_request(b), max_tokens=8,
                                                    sampling=GREEDY) for b in nxt])  # fmt: skip
    again = together(plain, [plain.prepare_request(parse_messages_request(b), max_tokens=8,
                                                   sampling=GREEDY) for b in nxt])  # fmt: skip
    assert [r.raw_text for r in second] == [r.raw_text for r in again]
    # teacher-forced: every second token forced, so kept — two positions a step, the
    # compressed rows completed at either written into the pages
    text = " ".join(["one two three four five six seven eight nine ten"] * 3)
    forced_before = paged.spec.counts.forced
    (res,) = together(paged, [prepared(paged, "Count.", 60)],
                      forced_tokens=forced(paged, text))  # fmt: skip
    assert paged.spec.counts.forced - forced_before > 10
    assert_pages_hold(paged, paged.pool.sessions[res.session].live)


def assert_pages_hold(engine: Engine, live: Any) -> None:
    """A paged frontier's state, read back from its pages, steps on as a cold prefill of
    its tokens does: its compressed rows are the ones its tokens make."""
    dense = engine.pages.dense(live.state)
    assert np.abs(engine.logits_for(live.tokens) - np.asarray(dense.logits)).max() <= 1e-5
    stepped = decode_step(engine.params, dense, 7, engine.cfg)
    cold = engine.logits_for([*live.tokens, 7])
    assert np.abs(cold - np.asarray(stepped.logits)).max() <= 1e-5


def test_speculation_needs_the_block_and_one_device(_engine: Engine) -> None:
    with pytest.raises(ValueError, match="MTP block"):
        like(_engine, speculative="mtp")
    params = {**_engine.params, "mtp": init_params(_engine.cfg, 5, mtp_layers=1)["mtp"]}
    with pytest.raises(ValueError, match="unknown speculative"):
        Engine(_engine.cfg, params, _engine.tokenizer, speculative="eagle")


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_warm_up_compiles_the_speculative_steps_requests_run(
    _engine: Engine, paged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up runs each size's speculative step (verify, then the block's drafts) with the
    arguments a served step has — shapes, dtypes, placement and static arguments alike, so
    one compiled program — else the first request with speculation on waits out their
    compile (measured: 5.8–7.1 s on an empty compile cache against 0.14 s)."""
    import ds4jax.engine.speculative as engine_spec
    import ds4jax.speculation as speculation

    calls: list[Any] = []

    def signature(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return (x.shape, str(x.dtype), x.committed)
        return (np.shape(x), str(getattr(x, "dtype", type(x))))

    def spy(real: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            calls.append((real.__name__, jax.tree.map(signature, args), kw))
            return real(*args, **kw)

        return call

    verify = "paged_verify_rows" if paged else "verify_rows"
    monkeypatch.setattr(engine_spec, verify, spy(getattr(engine_spec, verify)))
    monkeypatch.setattr(engine_spec, "draft_rows", spy(engine_spec.draft_rows))
    monkeypatch.setattr(speculation, "draft_rows", spy(speculation.draft_rows))
    kw = dict(paged_pages=256) if paged else {}
    e = speculating(_engine, sessions=6, max_batch=4, **kw)
    e.spec_max_batch = 2  # the gate counts active rows: sizes past it are warmed too
    e.warm_up()
    warmed, calls[:] = list(calls), []
    assert sorted({(name, c["size"]) for name, _, c in warmed}) == [
        (name, size) for name in sorted({verify, "draft_rows"}) for size in (1, 2, 4)
    ]
    together(e, [prepared(e, t, 12) for t in TEXTS])
    assert e.spec.counts.steps > 0 and calls
    assert {c["size"] for _, _, c in calls} >= {4}
    assert all(call in warmed for call in calls)


def test_a_call_naming_among_tools_steps_plain_only_while_it_spells_it(engines) -> None:
    """`tool_choice` any among several tools: the row draws its name on the host from the
    logits it holds (`Stepping._choose`), in plain steps while it spells it (or its text
    could become a call's opening), and speculates while it reasons (a first cut kept
    speculation off for the request's whole life, and every other row's with it); greedy,
    both engines write the same reasoning and call."""
    names = ["bash", "read_file", "grep_search"]
    tools = [{**TOOLS[0], "name": n} for n in names]
    body = {"tools": tools, "tool_choice": {"type": "any"},
            "thinking": {"type": "enabled", "budget_tokens": 12},
            "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
    out = []
    for engine in engines:
        fresh(engine)
        steps = engine.spec.counts.steps if engine.spec is not None else 0
        res = engine.run(engine.prepare_request(parse_messages_request(body), max_tokens=40,
                                                sampling=GREEDY))  # fmt: skip
        if engine.spec is not None:
            assert engine.spec.counts.steps > steps  # speculated while it reasoned
        out.append(res.raw_text)
    assert out[0] == out[1]
    assert any(f'invoke name="{n}">\n' in out[0] for n in names), out[0][:200]
