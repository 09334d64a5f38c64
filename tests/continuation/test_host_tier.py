"""Under memory pressure nothing live is lost (issue 26): a session the state budget evicts
moves whole to the host-RAM tier (`kvstore.host`) and its tool results continue it live,
exactly; the tier's own overflow goes to disk or is dropped, a session waiting for tool
results last; a request whose state cannot fit beside those in flight is refused (529)
with nothing changed."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ds4jax.continuation.pool import Pool, Session, host_bytes, host_victims
from ds4jax.continuation.types import Bindings, CacheSource, LiveFrontier, ToolBinding
from ds4jax.engine import Engine, EngineError
from ds4jax.kvstore.host import HostState, least_bytes, to_host
from ds4jax.model.state import allocated_bytes
from tests.continuation.conftest import like
from tests.continuation.test_sessions import (
    SYSTEM,
    fresh,
    interleavings,
    play_both,
    prepared,
    same_outcomes,
    tool_call_and_follow,
)

#: many steps of a few programs: compiled as served (`tests/conftest.py`)
pytestmark = pytest.mark.optimized

# ------------------------------------------------------------------ pure: no model


@dataclass(frozen=True)
class _Dense:
    nbytes: int


def _pool(states: list[object], waiting: set[int] = frozenset()) -> Pool:
    pool = Pool.create(len(states), budget=10, state_nbytes=1)
    for i, st in enumerate(states):
        s: Session = pool.sessions[i]
        s.live = LiveFrontier(st, (1, 2, 3), ())
        s.used = i
        if i in waiting:
            s.bindings = Bindings(tool=ToolBinding(frozenset({f"t{i}"}), 3))
    return pool


def test_host_held_states_cost_no_device_bytes() -> None:
    pool = _pool([_Dense(4), HostState(None, 7), _Dense(3)])
    assert pool.state_bytes() == 7 and host_bytes(pool) == 7


def test_the_host_tier_gives_up_its_oldest_idle_session_first_and_a_waiting_one_last() -> None:
    pool = _pool([HostState(None, 4), HostState(None, 4), HostState(None, 4)], waiting={0})
    assert host_victims(pool, need=4, host_budget=12) == [1]  # 0 waits for tool results
    assert host_victims(pool, need=8, host_budget=12) == [1, 2]
    assert host_victims(pool, need=12, host_budget=12) == [1, 2, 0]
    assert host_victims(pool, need=13, host_budget=12) is None  # never fits
    assert host_victims(pool, need=8, host_budget=12, keep={1, 2}) is None
    assert host_victims(pool, need=0, host_budget=12) == []


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def engines(_engine: Engine) -> tuple[Engine, Engine]:
    """One engine with no memory pressure, one whose budget holds a single state and whose
    host tier holds four."""
    e = _engine

    def make(**kw) -> Engine:
        return like(e, sessions=3, fork_points=True, max_batch=2, **kw)

    return make(), make(host_budget_bytes=64 * e.state_nbytes)


def _side(engine: Engine, k: int):
    body = {"system": SYSTEM, "messages": [{"role": "user", "content": f"Side task {k}."}]}
    return engine.run(prepared(engine, body, 3))


def test_an_evicted_session_waits_in_host_ram_and_continues_live(engines) -> None:
    calm, pressed = engines
    calm, pressed = fresh(calm, 3), fresh(pressed, 3, budget_states=1)
    outcomes = []
    for engine in (calm, pressed):
        res, follow = tool_call_and_follow(engine)
        sides = [_side(engine, k) for k in range(2)]  # each evicts what came before it
        if engine is pressed:
            held = engine.pool.sessions[res.session].live
            assert isinstance(held.state, HostState)  # whole: tokens, bindings, state
            assert held.state.nbytes < allocated_bytes(held.state.dense())  # its rows only
            assert engine.pool.sessions[res.session].tool_ids == frozenset(res.tool_ids)
            assert engine.pool.state_bytes() <= engine.pool.budget
        back = engine.run(prepared(engine, follow, 3))
        outcomes.append((back, [s.raw_text for s in sides]))
    (calm_back, calm_sides), (back, sides) = outcomes
    assert back.source is CacheSource.LIVE_TOOL and back.restored == "host"
    assert calm_back.restored is None
    assert (back.raw_text, sides) == (calm_back.raw_text, calm_sides)
    live = pressed.pool.sessions[back.session].live
    cold = pressed.logits_for(live.tokens)
    assert np.abs(cold - np.asarray(live.state.logits)).max() <= 1e-5


@pytest.mark.parametrize("tokens", [0, 3, 150, 700])
def test_the_host_tier_holds_the_rows_of_the_tokens_held_and_gives_back_the_state(
    _engine: Engine, tokens: int
) -> None:
    """A spilled state costs host RAM for the rows its tokens wrote, not for its span's
    capacity, and comes back bit for bit (the cut rows are the zeros past its tokens)."""
    e = _engine
    ids = [e.tokenizer.bos_id] + [7 + i % 300 for i in range(tokens - 1)] if tokens else []
    state = e._prefill(e._fit(e._empty, tokens), ids, e.chunk_sizes) if ids else e._empty
    host = to_host(state)
    want, back = jax.device_get(state), host.dense()
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(back), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for i, ls in enumerate(host.state.layers):
        for rows in (ls.comp, ls.idx):
            if rows is not None:  # at most the rows the tokens completed
                assert rows.shape[0] <= tokens // e.cfg.compress_ratios[i] + 1
    assert host.nbytes == allocated_bytes(host.state)
    assert least_bytes(state) <= host.nbytes  # the bound `_to_host` checks before copying
    assert host.nbytes < allocated_bytes(want)


def test_a_state_that_cannot_fit_beside_those_in_flight_is_refused_unchanged(engines) -> None:
    _, engine = engines
    engine = fresh(engine, 3, budget_states=1)
    engine.host_budget, host = None, engine.host_budget
    try:
        a = {"system": SYSTEM, "messages": [{"role": "user", "content": "First."}]}
        b = {"system": SYSTEM, "messages": [{"role": "user", "content": "Second, meanwhile."}]}
        first = engine.submit(prepared(engine, a, 6))
        while engine._prefilling or not any(engine._rows):
            engine.tick()  # the first holds a row (and its state) now
        second = engine.submit(prepared(engine, b, 2))
        while not (first.finished.is_set() and second.finished.is_set()):
            engine.tick()
        assert first.error is None
        assert isinstance(second.error, EngineError) and second.error.status == 529
        assert second.error.error_type == "overloaded_error"
        others = [s for s in engine.pool.sessions if s.slot != first.result.session]
        assert all(s.live is None for s in others)  # the refused one took no slot
        retry = engine.run(prepared(engine, b, 2))  # once the first is done, it fits
        assert retry.source is not None
    finally:
        engine.host_budget = host


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])  # fmt: skip
@given(plan=interleavings())
def test_under_a_one_state_budget_no_live_session_is_lost(engines, plan) -> None:
    """The interleaved agents of `test_sessions` with room on the device for one state: each
    session the budget evicts waits in host RAM, so every turn gives the unpressured reply
    and every live tool continuation stays live (fork points, evicted first, may turn a
    retry into a prefill: the same text)."""
    calm, pressed = engines
    want, got = play_both(calm, pressed, plan, budget_states=1)
    assert same_outcomes(got, want, source=False)
    for i, out in want.items():
        for w, g in zip(out, got[i], strict=True):
            if w.source is CacheSource.LIVE_TOOL:
                assert g.source is CacheSource.LIVE_TOOL
    assert pressed.pool.state_bytes() <= pressed.pool.budget
