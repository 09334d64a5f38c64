"""Retained frontiers kept in pages (`Engine(paged_pages=…)`, `kvstore.page_store`): the
interleaved conversations of `test_sessions` behave exactly as on dense states — same
paths, same greedy text — while the retained states cost the distinct pages they hold, and
pages go back to the pool when nothing holds them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ds4jax.engine import Engine, EngineError
from ds4jax.kvstore.pages import pages_for
from ds4jax.model.page_io import PagedFrontier
from tests.continuation.conftest import TOOLS, like
from tests.continuation.test_sessions import (
    SYSTEM,
    fresh,
    interleavings,
    play_both,
    prepared,
    same_outcomes,
)

#: many steps of a few programs: compiled as served (`tests/conftest.py`)
pytestmark = pytest.mark.optimized


@pytest.fixture(scope="module")
def engines(_engine: Engine) -> tuple[Engine, Engine]:
    def make(**kw) -> Engine:
        e = _engine
        return like(e, sessions=6, fork_points=True, **kw)

    return make(), make(paged_pages=256)


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])  # fmt: skip
@given(plan=interleavings())
def test_paged_frontiers_serve_interleaved_conversations_as_dense_ones(engines, plan) -> None:
    dense, paged = engines
    want, got = play_both(dense, paged, plan)
    assert same_outcomes(got, want)
    frontiers = [s.live for s in paged.pool.sessions if s.live is not None]
    frontiers += [f.frontier for f in paged.pool.forks]
    assert frontiers and all(isinstance(f.state, PagedFrontier) for f in frontiers)
    for f in frontiers:  # each holds exactly its tokens' pages
        assert f.state.tokens == f.pos and len(f.state.table.pages) == pages_for(f.pos)
    # the retained states cost their distinct pages: a dense state each costs its capacity
    assert paged.pool.state_bytes() < dense.pool.state_bytes()


def test_a_retry_costs_one_page_at_most_and_released_pages_come_back(engines) -> None:
    _, engine = engines
    engine = fresh(engine, 4)
    store = engine.pages
    store._drain()
    start = store.pool.used
    body = {"system": SYSTEM * 40, "tools": TOOLS,
            "messages": [{"role": "user", "content": "List the files, please."}]}  # fmt: skip
    first = engine.run(prepared(engine, body, 4))
    assert first.prompt_tokens > 256  # a prompt over one page
    after_first = store.pool.used - start
    retry = engine.run(prepared(engine, body, 4))
    assert retry.prefilled == 0 and retry.raw_text == first.raw_text
    # the retry shares the prompt's full pages; its reply adds at most its tail page
    assert store.pool.used - start - after_first <= 1
    point = next(f for f in engine.pool.forks if f.frontier.pos == first.prompt_tokens)
    cold = engine.logits_for(point.frontier.tokens)
    dense = store.dense(point.frontier.state)
    assert np.abs(cold - np.asarray(dense.logits)).max() <= 1e-5
    engine.reset()  # nothing holds the frontiers now: their pages are freed
    del point, dense
    store._drain()
    assert store.pool.used == start


def test_a_row_the_full_pool_cannot_grow_is_refused_overloaded_and_nothing_is_lost(engines):
    """Three pages hold a 710-token prompt's frontiers and its reply, which decoded in
    place into the prompt's tail page; its retry's row needs a copy of that page, and no
    fork point or idle session can give one up (all hold the same pages): the retry is
    refused with 529 (`overloaded_error`), the first reply's frontier is intact, and once
    the pool has room the retry serves as on dense states. (Rows hold pages, not copies:
    a pool too small for a row refuses it rather than decode it dense.)"""
    dense, big = engines
    small = Engine(big.cfg, big.params, big.tokenizer, max_len=big.max_len,
                   chunk_sizes=big.chunk_sizes, sessions=2, fork_points=True,
                   paged_pages=4)  # fmt: skip
    body = {"system": SYSTEM * 40, "tools": TOOLS,
            "messages": [{"role": "user", "content": "List the files, please."}]}  # fmt: skip
    dense = fresh(dense, 2)
    want = [dense.run(prepared(dense, body, 4)) for _ in range(2)]  # a prompt, its retry
    first = small.run(prepared(small, body, 4))
    assert (first.source, first.raw_text) == (want[0].source, want[0].raw_text)
    with pytest.raises(EngineError) as refused:
        small.run(prepared(small, body, 4))
    assert refused.value.status == 529 and refused.value.error_type == "overloaded_error"
    live = small.pool.sessions[first.session].live
    logits = np.asarray(small.pages.dense(live.state).logits)
    assert np.abs(logits - small.logits_for(live.tokens)).max() <= 1e-5
    small.pages.limit = 8  # room to grow: the retry is served as the dense engine served it,
    again = small.run(prepared(small, body, 4))  # from the prompt end its refusal left live
    assert (again.cached, again.raw_text) == (want[1].cached, want[1].raw_text)


def test_the_state_before_think_and_the_prompt_end_share_their_pages(engines) -> None:
    """Thinking on, no tools: the fork point before `<think>` is kept, and the prompt end
    grows from it by one token in place; the next turn forks from it as on dense states."""
    dense, paged = engines
    ask = {"role": "user", "content": "Tell me about JAX. " * 30}
    body = {"messages": [ask, {"role": "assistant", "content": "JAX is"},
                         {"role": "user", "content": "Go on."}]}  # fmt: skip
    runs = []
    for engine in (fresh(dense, 2), fresh(paged, 2)):
        first = engine.run(prepared(engine, {"messages": [ask]}, 3))
        runs.append((first.raw_text, engine.run(prepared(engine, body, 2))))
    (t_dense, r_dense), (t_paged, r_paged) = runs
    assert t_paged == t_dense and r_paged.source is r_dense.source
    assert (r_paged.cached, r_paged.raw_text) == (r_dense.cached, r_dense.raw_text)
    before, end = sorted((f.frontier for f in paged.pool.forks if f.frontier.pos <=
                          r_paged.cached + 1), key=lambda f: f.pos)[-2:]  # fmt: skip
    assert end.pos == before.pos + 1 and end.state.table.pages == before.state.table.pages


def test_sub_agents_on_one_system_prompt_store_its_full_pages_once(engines) -> None:
    """Two conversations that start with the same long system prompt and tools but ask
    different things: both prefill cold, and the second's frontiers point at the first's
    full pages of the shared prefix; the replies are the dense engine's."""
    dense, paged = engines
    system = SYSTEM * 40

    def body(ask: str) -> dict:
        return {"system": system, "tools": TOOLS, "messages": [{"role": "user", "content": ask}]}

    asks = ["List the files, please.", "Which test fails?"]
    want = [(r.source, r.raw_text) for r in
            (fresh(dense, 4).run(prepared(dense, body(a), 3)) for a in asks)]  # fmt: skip
    engine = fresh(paged, 4)
    got = [engine.run(prepared(engine, body(a), 3)) for a in asks]
    assert [(r.source, r.raw_text) for r in got] == want
    first, second = (engine.pool.sessions[r.session].live.state.table for r in got)
    common = min(r.prompt_tokens for r in got) // 256 - 1  # full pages before the asks differ
    assert common >= 1 and first.pages[:common] == second.pages[:common]
