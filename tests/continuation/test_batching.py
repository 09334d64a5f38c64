"""Continuous batching on the real engine (issue 14): requests decode together, a prefill
interleaves chunk by chunk with the others' tokens, and every request's output and final
frontier are those of the same request served alone.

The engine is the tiny config in exact math with the session pool and batches of up to 4.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.continuation.types import CacheSource
from ds4jax.engine import Engine, SamplingParams
from ds4jax.engine.requests import Cancelled
from ds4jax.engine.ticket import Ticket
from ds4jax.interleave import PASS_BOUND, chunk_limit
from tests.continuation.conftest import TOOLS, forced, like, tool_call_text

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def batch_engine(_engine: Engine) -> Engine:
    return like(_engine, sessions=6, fork_points=True, max_batch=4)


def fresh(engine: Engine) -> Engine:
    engine.pool = type(engine.pool).create(len(engine.pool.sessions), **engine._pool_args)
    engine.tool_memory = type(engine.tool_memory)()
    return engine


def prepared(engine: Engine, text: str, max_tokens: int, stops: list[str] | None = None,
             sampling: SamplingParams = GREEDY, tools: bool = False):  # fmt: skip
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}],
                            "thinking": {"type": "disabled"}}  # fmt: skip
    if stops:
        body["stop_sequences"] = stops
    if tools:
        body["tools"] = TOOLS
    return engine.prepare_request(parse_messages_request(body), max_tokens=max_tokens,
                                  sampling=sampling)  # fmt: skip


def active_rows(engine: Engine) -> int:
    return sum(t is not None for t in engine._rows)


def test_requests_decode_together_and_equal_their_solo_runs(batch_engine) -> None:
    engine = fresh(batch_engine)
    texts = ["Name three rivers.", "Count to five.", "What is JAX?"]
    solo = []
    for t in texts:
        fresh(engine)
        solo.append(engine.run(prepared(engine, t, 10)))
    fresh(engine)
    tickets = [engine.submit(prepared(engine, t, 10)) for t in texts]
    most = 0
    while engine.busy:
        engine.tick()
        most = max(most, active_rows(engine))
    assert most == 3  # all three stepped together
    for s, t in zip(solo, tickets, strict=True):
        assert t.error is None and t.result.raw_text == s.raw_text
        assert t.result.output_tokens == s.output_tokens and t.result.finish == s.finish
    lives = [engine.pool.sessions[t.result.session].live for t in tickets]
    assert len({t.result.session for t in tickets}) == 3
    for live in lives:  # every row's final state equals a cold prefill of its tokens
        cold = engine.logits_for(live.tokens)
        assert np.abs(cold - np.asarray(live.state.logits)).max() <= 1e-5


def batch_rows(engine: Engine) -> int:
    import jax

    return jax.tree.leaves(engine._batch)[0].shape[0]


def test_the_batch_holds_the_rows_its_steps_run(batch_engine) -> None:
    """The dense batch grows to the bucket of the rows admitted and shrinks to the rows
    still decoding (a step of fewer rows than the batch holds copied their states out and
    back); the long request's reply is its solo reply through both."""
    engine = fresh(batch_engine)
    solo = engine.run(prepared(engine, "Name three rivers.", 12))
    fresh(engine)
    seen = []
    long = engine.submit(prepared(engine, "Name three rivers.", 12))
    shorts = [engine.submit(prepared(engine, t, 2)) for t in ("Count to five.", "Hi.")]
    while engine.busy:
        engine.tick()
        seen.append((active_rows(engine), batch_rows(engine)))
    assert (3, 4) in seen and (1, 1) in seen, seen  # grew to 4 rows, shrank back to 1
    assert all(rows >= active for active, rows in seen)
    assert long.error is None and long.result.raw_text == solo.raw_text
    assert all(t.error is None for t in shorts)


def test_a_long_prefill_delays_the_others_by_one_chunk_per_step(batch_engine) -> None:
    engine = fresh(batch_engine)
    short = engine.submit(prepared(engine, "Tell a story.", 40))
    while active_rows(engine) == 0:  # the short request is decoding
        engine.tick()
    long_text = " ".join(f"Rule {i}: keep the tree tidy." for i in range(60))
    long = engine.submit(prepared(engine, long_text, 2))
    chunks = 0
    while short.decoder is not None and not short.finished.is_set() and long.decoder is None:
        before = len(short.decoder.generated)
        engine.tick()
        chunks += bool(engine._prefilling) or long.decoder is not None
        # one token a tick while the prompt prefills (the tick that ends it may burst)
        assert (len(short.decoder.generated) == before + 1 or short.finished.is_set()
                or long.decoder is not None)  # fmt: skip
    assert chunks >= 5  # the long prompt really took several steps
    while engine.busy:
        engine.tick()
    assert short.error is None and long.error is None


def test_a_short_request_overtakes_a_long_prefill(batch_engine) -> None:
    """A request whose prompt fits one chunk starts beside a long prompt in flight and
    is answered before that prompt's prefill ends (before, it waited the whole prefill
    out); one longer than a chunk waits its turn; every reply is its reply served alone."""
    engine = fresh(batch_engine)
    texts = {
        "long": " ".join(f"Rule {i}: keep the tree tidy." for i in range(60)),
        "short": "Hi.",
        "medium": " ".join(f"Note {i}: water the plants." for i in range(12)),
    }
    solo = {}
    for name, text in texts.items():
        fresh(engine)
        solo[name] = engine.run(prepared(engine, text, 4))
    fresh(engine)
    long = engine.submit(prepared(engine, texts["long"], 4))
    engine.tick()
    assert engine._prefilling == [long] and len(long.tokens) - long.done_tokens > 5 * 64
    short = engine.submit(prepared(engine, texts["short"], 4))
    engine.tick()
    assert short.decoder is not None and engine._prefilling == [long]  # started, prefilled
    while not short.finished.is_set():
        engine.tick()
    assert long.decoder is None  # the long prompt still prefills
    medium = engine.submit(prepared(engine, texts["medium"], 4))
    engine.tick()
    assert len(medium.prepared.view.tokens) > max(engine.chunk_sizes)
    assert list(engine.waiting) == [medium] and long.decoder is None  # it waits
    while engine.busy:
        engine.tick()
    for name, ticket in (("long", long), ("short", short), ("medium", medium)):
        assert ticket.error is None and ticket.result.raw_text == solo[name].raw_text, name
        assert ticket.result.output_tokens == solo[name].output_tokens


def test_a_prefill_keeps_one_chunk_queued_ahead_and_no_more(batch_engine) -> None:
    """Each tick dispatches the prompt's next chunk and waits for the one before it: a
    short request admitted at any tick queues behind one chunk, not the whole prompt
    (dispatched without waiting, a 15k-token prompt's chunks were all queued within
    milliseconds, and a short request waited 9 s for its first token over HTTP)."""
    engine = fresh(batch_engine)
    long = engine.submit(prepared(engine, " ".join(f"Rule {i}: keep it tidy." for i in range(90)),
                                  2))  # fmt: skip
    ready = []
    while long.decoder is None:
        before = long.state  # the state the tick's chunk grows
        engine.tick()
        if before is not None and long.decoder is None:  # (its end waits for all)
            ready.append(before.logits.is_ready())
    assert len(ready) >= 5 and all(ready)
    while engine.busy:
        engine.tick()


def test_a_new_request_waits_rather_than_replace_an_agent_between_tool_turns(_engine) -> None:
    """With the other session holding an agent between two tool turns, a new short request
    beside a long prompt in flight could only replace the agent's session: it waits for
    the prompt (with two sessions, two agents' first turns started beside a long prompt
    displaced each other and no tool turn continued live). The agent's tool-result turn,
    arriving after it, starts at once all the same — it takes no session — and continues
    live."""
    engine = like(_engine, sessions=2, max_batch=4)
    body = {"system": "You are an agent.", "tools": TOOLS,
            "messages": [{"role": "user", "content": "list"}]}  # fmt: skip
    first = engine.run(engine.prepare_request(parse_messages_request(body), max_tokens=200),
                       forced_tokens=forced(engine, tool_call_text("ls")))  # fmt: skip
    long = engine.submit(prepared(engine, " ".join(f"Rule {i}: tidy." for i in range(120)), 2))
    engine.tick()
    assert engine._prefilling == [long]
    newcomer = engine.submit(prepared(engine, "Hi.", 2))
    engine.tick()
    assert list(engine.waiting) == [newcomer] and engine._prefilling == [long]  # it waits
    turn = engine.submit(engine.prepare_request(
        parse_messages_request(ls_result_turn(body, first.tool_ids[0])), max_tokens=2,
        sampling=GREEDY))  # fmt: skip
    newcomer.passed = PASS_BOUND  # as if later requests had started past it this often:
    engine.tick()  # no more do
    assert list(engine.waiting) == [newcomer, turn] and turn.decoder is None
    newcomer.passed = 0
    engine.tick()
    assert turn.decoder is not None and long.decoder is None  # started beside the prompt
    assert newcomer.passed == 1
    assert list(engine.waiting) == [newcomer]
    while engine.busy:
        engine.tick()
    assert turn.result.source is CacheSource.LIVE_TOOL and turn.result.session == first.session
    assert all(t.error is None for t in (long, newcomer, turn))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_a_prompt_that_arrives_while_rows_decode_rides_in_their_steps(batch_engine,
                                                                        paged) -> None:  # fmt: skip
    """`stall_bound`: while the short request decodes, each tick evaluates no more of the
    long prompt than `interleave.chunk_limit` allows for the costs measured so far (the
    first such chunk the smallest size: no chunk cost known yet), inside the decode step
    (mixed steps: chunk costs are recorded); alone, the same prompt runs in whole chunks;
    the long request's output and final state are those of its run alone. Dense rows and
    rows in pages alike."""
    e = batch_engine
    engine = Engine(e.cfg, e.params, e.tokenizer, max_len=e.max_len, chunk_sizes=(4, 16, 64),
                    sessions=6, fork_points=True, max_batch=4, stall_bound=2.0,
                    paged_pages=256 if paged else None)  # fmt: skip
    long_text = " ".join(f"Rule {i}: keep the tree tidy." for i in range(40))

    def advances(ticket: Ticket) -> list[tuple[int, int]]:
        """(tokens the tick prefilled, the bound before it) until the prompt is done."""
        out = []
        while ticket.decoder is None and not ticket.finished.is_set():
            done, step = ticket.done_tokens, engine._step_size()
            limit = chunk_limit(engine.chunk_sizes, step, engine.tick_costs, engine.stall_bound)
            engine.tick()
            if ticket.tokens:  # admitted
                out.append((ticket.done_tokens - done, limit if step else 0))
        return out

    fresh(engine)
    alone_ticket = engine.submit(prepared(engine, long_text, 6))
    alone = advances(alone_ticket)
    assert alone[0][0] == 64 and all(bound == 0 for _, bound in alone)  # whole chunks
    while engine.busy:
        engine.tick()
    fresh(engine)
    stop = threading.Event()
    short = engine.submit(prepared(engine, "Tell a story.", 200), cancel=stop)
    while active_rows(engine) == 0:
        engine.tick()
    long = engine.submit(prepared(engine, long_text, 6))
    bounded = advances(long)
    assert short.decoder is not None and not short.finished.is_set()  # it decoded throughout
    assert bounded[0] == (4, 4)  # nothing measured: the smallest chunk
    assert all(n <= bound for n, bound in bounded)
    assert len(bounded) > len(alone)
    while not long.finished.is_set():
        engine.tick()
    assert long.error is None and long.result.output_tokens == alone_ticket.result.output_tokens
    assert long.result.raw_text == alone_ticket.result.raw_text
    assert engine.tick_costs.chunk_s and set(engine.tick_costs.chunk_s) <= {4, 16, 64}  # mixed
    assert engine.mixed_prompt_tokens == sum(n for n, _ in bounded) and engine.mixed_steps
    live = engine.pool.sessions[long.result.session].live
    assert np.abs(engine.logits_for(live.tokens) - np.asarray(live.state.logits)).max() <= 1e-5
    stop.set()
    while engine.busy:
        engine.tick()


def test_a_cancelled_row_leaves_and_the_others_go_on(batch_engine) -> None:
    engine = fresh(batch_engine)
    fresh(engine)
    alone = engine.run(prepared(engine, "Keep talking.", 12))
    fresh(engine)
    cancel = threading.Event()
    two = lambda: len(gone.decoder.generated) == 2 and cancel.set()  # noqa: E731
    gone = engine.submit(prepared(engine, "Say many words.", 12), cancel=cancel, on_token=two)
    stays = engine.submit(prepared(engine, "Keep talking.", 12))
    while engine.busy:
        engine.tick()
    assert engine.bursts  # cancelled inside a burst: the row stepped back to its 2 tokens
    assert gone.result.finish == "cancelled" and gone.result.output_tokens == 2
    assert stays.result.raw_text == alone.raw_text
    live = engine.pool.sessions[gone.result.session].live  # consistent where it stopped
    assert np.abs(engine.logits_for(live.tokens) - np.asarray(live.state.logits)).max() <= 1e-5


def test_a_request_withdrawn_while_it_waits_is_never_routed(_engine) -> None:
    """Its client left while every row was busy: when a row frees it is dropped, not
    routed into a slot — no session's live frontier is replaced for a client that is gone
    (before, it displaced the idle session, prefilled its whole prompt, then ended)."""
    engine = like(_engine, sessions=2, fork_points=True, max_batch=1)
    a = engine.run(prepared(engine, "Name three rivers.", 4))
    b = engine.submit(prepared(engine, "Count to five.", 8))
    while b.decoder is None:
        engine.tick()
    cancel = threading.Event()
    c = engine.submit(prepared(engine, "Say many words. " * 20, 8), cancel=cancel)
    engine.tick()
    assert c.routed is None  # waiting for the one row
    cancel.set()
    while engine.busy:
        engine.tick()
    assert isinstance(c.error, Cancelled) and c.routed is None and c.finished.is_set()
    lives = {s.slot: s.live for s in engine.pool.sessions}
    assert lives[a.session] is not None and lives[b.result.session] is not None
    assert a.session != b.result.session
    b_text = engine.segments_of(lives[b.result.session].tokens)
    assert "Count to five." in "".join(seg.text for seg in b_text)
    assert len(engine.pool.forks) == 2  # the two prompt ends; nothing of c's


@pytest.mark.parametrize("paged", [False, True])
def test_a_prefill_withdrawn_keeps_its_prefix_as_a_fork_point(_engine, paged: bool) -> None:
    """Its client left while its prompt prefilled: the prefill stops at the next chunk,
    the session the route would replace keeps its live frontier, and the prefix evaluated
    so far is a fork point a retry of the same request continues from (dense, or kept in
    pages)."""
    engine = like(_engine, sessions=1, fork_points=True, max_batch=1,
                  paged_pages=256 if paged else None)  # fmt: skip
    long_text = "The engine keeps the sampled state as the truth. " * 12
    solo = engine.run(prepared(engine, long_text, 6))
    engine.reset()
    a = engine.run(prepared(engine, "Name three rivers.", 4))
    a_live = engine.pool.sessions[a.session].live
    cancel = threading.Event()
    c = engine.submit(prepared(engine, long_text, 6), cancel=cancel)
    engine.tick()  # routed (into a's slot, the only one) and its first chunk evaluated
    assert c.routed is not None and 0 < c.done_tokens < len(c.tokens)
    done = c.done_tokens
    cancel.set()
    while engine.busy:
        engine.tick()
    got = c.result
    assert c.error is None and c.decoder is None  # it never took a row
    assert got.finish == "cancelled" and got.output_tokens == 0 and got.prefilled == done
    assert engine.pool.sessions[a.session].live is a_live  # not displaced
    (point,) = [f for f in engine.pool.forks if f.frontier.tokens == tuple(c.tokens[:done])]
    assert paged == (engine.pages is not None and hasattr(point.frontier.state, "table"))
    cold = engine.logits_for(point.frontier.tokens)
    kept = engine.pages.dense(point.frontier.state) if paged else point.frontier.state
    assert np.abs(cold - np.asarray(kept.logits)).max() <= 1e-5
    retry = engine.run(prepared(engine, long_text, 6))
    assert retry.source == CacheSource.FORK and retry.cached == done
    assert retry.raw_text == solo.raw_text and retry.output_tokens == solo.output_tokens


def ls_result_turn(body: dict[str, Any], tid: str) -> dict[str, Any]:
    """`body` (whose turn called `bash ls`, forced from `tool_call_text("ls")`) followed by
    that call as the client replays it and its result: the tool-result turn."""
    follow = copy.deepcopy(body)
    follow["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should run it."},
            {"type": "tool_use", "id": tid, "name": "bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tid, "content": "a.py"}]},
    ]  # fmt: skip
    return follow


def test_a_tool_loop_continues_live_after_a_batched_decode(batch_engine) -> None:
    engine = fresh(batch_engine)
    call = forced(engine, tool_call_text("ls"))
    body = {"system": "You are an agent.", "tools": TOOLS,
            "messages": [{"role": "user", "content": "list"}]}  # fmt: skip

    def turn(other: bool) -> tuple[Any, Any]:
        fresh(engine)
        req = engine.prepare_request(parse_messages_request(body), max_tokens=200)
        first = engine.submit(req, forced_tokens=call)
        if other:  # a chat decoding beside it the whole time
            engine.submit(prepared(engine, "Chat with me.", 60))
        while not first.finished.is_set():
            engine.tick()
        follow = ls_result_turn(body, first.result.tool_ids[0])
        res = engine.run(engine.prepare_request(parse_messages_request(follow), max_tokens=6,
                                                sampling=GREEDY))  # fmt: skip
        live = engine.pool.sessions[res.session].live
        while engine.busy:
            engine.tick()
        return res, live

    solo, solo_live = turn(other=False)
    batched, batched_live = turn(other=True)
    assert solo.source is batched.source is CacheSource.LIVE_TOOL
    assert batched.raw_text == solo.raw_text and batched_live.tokens == solo_live.tokens
    diff = np.asarray(batched_live.state.logits) - np.asarray(solo_live.state.logits)
    assert np.abs(diff).max() <= 1e-5


PROMPTS = ["Name a colour.", "Write a haiku.", "Describe JAX.", "List some primes.",
           "Say hello.", "Explain batching."]  # fmt: skip


@st.composite
def arrivals(draw):
    n = draw(st.integers(2, 5))
    reqs = []
    for i in range(n):
        reqs.append({
            "text": PROMPTS[i],
            "max_tokens": draw(st.integers(1, 10)),
            "arrive": draw(st.integers(0, 6)),
            "cancel": draw(st.one_of(st.none(), st.integers(1, 8))),
            "stop_at": draw(st.one_of(st.none(), st.integers(1, 6))),
        })  # fmt: skip
    return reqs


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])  # fmt: skip
@given(reqs=arrivals())
def test_random_arrivals_cancellations_and_stops_equal_solo_runs(batch_engine, reqs) -> None:
    engine = batch_engine
    solo_of: list[Any] = []
    for r in reqs:  # alone: to learn a stop sequence inside the output, then the real run
        fresh(engine)
        text = engine.run(prepared(engine, r["text"], r["max_tokens"])).raw_text
        k = r["stop_at"]
        r["stops"] = [text[k : k + 2]] if k is not None and len(text) >= k + 3 else []
        fresh(engine)
        solo = engine.run(prepared(engine, r["text"], r["max_tokens"], r["stops"]))
        solo_of.append((solo, engine.pool.sessions[solo.session].live.tokens))
    fresh(engine)
    tickets: dict[int, Ticket] = {}
    cancels: dict[int, threading.Event] = {}
    tick = 0
    while len(tickets) < len(reqs) or engine.busy:
        for i, r in enumerate(reqs):
            if i not in tickets and r["arrive"] <= tick:
                cancels[i] = threading.Event()
                tickets[i] = engine.submit(
                    prepared(engine, r["text"], r["max_tokens"], r["stops"]), cancel=cancels[i]
                )
            if i in tickets and r["cancel"] is not None and tick >= r["arrive"] + r["cancel"]:
                cancels[i].set()
        engine.tick()
        tick += 1
        assert active_rows(engine) <= 4
    for i in range(len(reqs)):
        got, (solo, solo_tokens) = tickets[i].result, solo_of[i]
        if isinstance(tickets[i].error, Cancelled):  # withdrawn before it was routed
            assert tickets[i].routed is None and reqs[i]["cancel"] is not None
            continue
        assert tickets[i].error is None
        if tickets[i].decoder is None:  # withdrawn while its prompt prefilled
            assert got.finish == "cancelled" and got.output_tokens == 0
            continue
        live = engine.pool.sessions[got.session].live
        if got.finish == "cancelled":
            assert solo.raw_text.startswith(got.raw_text)
            assert solo_tokens[: len(live.tokens)] == live.tokens
        else:
            assert (got.raw_text, got.finish, got.stop_sequence) == (
                solo.raw_text, solo.finish, solo.stop_sequence)  # fmt: skip
            assert live.tokens == solo_tokens
