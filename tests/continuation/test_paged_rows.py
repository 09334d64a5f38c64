"""Decode rows that hold pages, not copies (issue 26, "batch rows hold no copies"): with a
page pool the engine's batch holds the rows' small parts only, each row reads and writes
its pages through its table (`model.batch.paged_step`), and requests decoded together
give the dense engine's replies; each leaves as a frontier sharing its prompt's pages."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from ds4jax.engine import Engine
from ds4jax.kvstore.disk import DiskStore
from ds4jax.model.page_io import PagedFrontier
from tests.continuation.conftest import like
from tests.continuation.test_batching import active_rows, fresh, prepared
from tests.continuation.test_sessions import interleavings, play_both, same_outcomes


@pytest.fixture(scope="module")
def engines(_engine: Engine) -> tuple[Engine, Engine]:
    kw = dict(sessions=6, fork_points=True, max_batch=4)
    return like(_engine, **kw), like(_engine, paged_pages=256, **kw)


def test_rows_in_pages_decode_together_as_dense_rows(engines) -> None:
    dense, paged = (fresh(e) for e in engines)
    texts = ["Name three rivers.", "Count to five, slowly, in words. " * 12, "What is JAX?"]
    want = [dense.submit(prepared(dense, t, 10)) for t in texts]
    while dense.busy:
        dense.tick()
    used = paged.pages.pool.used
    tickets = [paged.submit(prepared(paged, t, 10)) for t in texts]
    most = checked = 0
    while paged.busy:
        paged.tick()
        most = max(most, active_rows(paged))
        for row, ticket in enumerate(paged._rows):
            if ticket is not None:  # its session's live frontier is the prompt end meanwhile
                # the row reads the prompt end's pages, its full ones shared, not copied
                prompt = ticket.session.live.state.table
                full = prompt.tokens // 256
                assert paged._tables[row].pages[:full] == prompt.pages[:full]
                checked += 1
    assert most == 3 and checked
    assert all(ls.comp is None and ls.idx is None for ls in paged._batch.layers)
    for w, t in zip(want, tickets, strict=True):
        assert t.error is None and w.error is None
        assert (t.result.raw_text, t.result.finish) == (w.result.raw_text, w.result.finish)
        live = paged.pool.sessions[t.result.session].live
        cold = paged.logits_for(live.tokens)
        assert np.abs(cold - np.asarray(paged.pages.dense(live.state).logits)).max() <= 1e-5
    assert paged._tables == [None] * 4
    paged.reset()  # nothing holds the frontiers or rows now: every page is free again
    del live, t, tickets  # (a ticket holds its session, and so its frontiers)
    gc.collect()
    paged.pages._drain()
    assert paged.pages.pool.used == used


def _under_pressure(calm: Engine, paged: Engine, store_dir, plan, tol: float) -> None:
    """The interleaved agents of `test_sessions` on rows in pages with room for a few
    pages: evicted sessions go to a small host-RAM tier, its overflow to a disk store, and
    come back from either. Every turn gives the unpressured engine's text; every page a
    retained frontier holds is held (none freed under it, none leaked); and every live
    frontier equals a cold prefill of its tokens (to `tol`)."""
    store = DiskStore(store_dir, "paged-rows", cfg=paged.cfg, max_len=paged.max_len,
                      tokenizer=paged.tokenizer, min_tokens=1)  # fmt: skip
    pressed = like(
        paged,
        sessions=6,
        fork_points=True,
        max_batch=4,
        paged_pages=256,
        store=store,
        background_saves=False,
        host_budget_bytes=2 * paged.state_nbytes,
    )
    p = pressed.pages
    want, got = play_both(calm, pressed, plan, budget_bytes=4 * p.page_nbytes + 3 * p.small_nbytes)
    assert same_outcomes(got, want, source=False)
    assert pressed.pool.state_bytes() <= pressed.pool.budget
    gc.collect()  # a frontier releases its pages when collected: some wait in ref cycles
    p._drain()
    frontiers = [s.live for s in pressed.pool.sessions if s.live is not None]
    frontiers += [f.frontier for f in pressed.pool.forks]
    paged_states = [f.state for f in frontiers if isinstance(f.state, PagedFrontier)]
    assert paged_states
    held = set().union(*(s.table.pages for s in paged_states))
    assert all(p.pool.refs[q] > 0 for q in held) and p.pool.used == len(held)
    for f in frontiers:
        if isinstance(f.state, PagedFrontier):
            cold = pressed.logits_for(f.tokens)
            assert np.abs(cold - np.asarray(p.dense(f.state).logits)).max() <= tol


PRESSURE = dict(deadline=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])  # fmt: skip


@settings(max_examples=2, **PRESSURE)
@given(plan=interleavings())
def test_under_page_pressure_with_host_ram_and_disk_every_turn_is_the_calm_one(
    engines, tmp_path_factory, plan
) -> None:
    _under_pressure(*engines, tmp_path_factory.mktemp("kv"), plan, 1e-5)


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def rounded_engines(_engine: Engine, request) -> tuple[Engine, Engine]:
    cfg, kw = (
        _engine.cfg.replace(state_dtype=request.param),
        dict(sessions=6, fork_points=True, max_batch=4),
    )
    return like(_engine, cfg, **kw), like(_engine, cfg, paged_pages=256, **kw)


@settings(max_examples=1, **PRESSURE)
@given(plan=interleavings())
def test_under_page_pressure_rounded_states_give_the_calm_ones_turns(
    rounded_engines, tmp_path_factory, plan
) -> None:
    """The same in bf16 and fp8 states (fp8: the release's records in the pages, on the
    host and on disk): every turn is the calm engine's of that dtype; a frontier matches a
    cold prefill as such chunkings agree (1e-2: a 1-ulp matmul difference can tip a
    rounding to the state dtype)."""
    _under_pressure(*rounded_engines, tmp_path_factory.mktemp("kv"), plan, 1e-2)
