"""Decode rows that hold pages, not copies (issue 26, "batch rows hold no copies"): with a
page pool the engine's batch holds the rows' small parts only, each row reads and writes
its pages through its table (`model.batch.paged_step`), and requests decoded together
give the dense engine's replies; each leaves as a frontier sharing its prompt's pages."""

from __future__ import annotations

import numpy as np
import pytest

from ds4jax.engine import Engine
from tests.continuation.test_batching import active_rows, fresh, prepared


@pytest.fixture(scope="module")
def engines(_engine: Engine) -> tuple[Engine, Engine]:
    def make(**kw) -> Engine:
        e = _engine
        return Engine(e.cfg, e.params, e.tokenizer, max_len=e.max_len, chunk_sizes=e.chunk_sizes,
                      sessions=6, fork_points=True, max_batch=4, **kw)  # fmt: skip

    return make(), make(paged_pages=256)


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
    paged.pages._drain()
    assert paged.pages.pool.used == used
