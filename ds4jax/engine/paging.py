"""Decode rows and retained frontiers over a page pool (`paged_pages`).

Each row holds its own references to its prompt end's pages (`PageTable`), grown before
each step — fork points and idle sessions giving up pages first when the pool is full — and
cut back to what it evaluated when it leaves as a frontier; a prompt's row is taken on its
base's data shard while that has one. Apart because all of it but the dense branch of a
row's frontier is idle without pages; `Paging` is a part of `Engine`, which owns the pool
and the tables (`core`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from ds4jax.engine.requests import EngineError
from ds4jax.kvstore.pages import OutOfPages, pages_for, shard_for
from ds4jax.model import batch as batch_ops
from ds4jax.model.page_io import PagedFrontier
from ds4jax.model.page_table import PageTable

#: one logger for the whole engine, so its lines keep the name they always had
log = logging.getLogger("ds4jax.engine")

#: pages a paged pool starts with; it doubles as frontiers need more, up to its budget
PAGED_START = 64


class Paging:
    """Page tables of the decode rows, and frontiers kept as pages."""

    def _row_for(self, base: Any) -> tuple[int, int, Any]:
        """(a free batch row for a prompt, its data shard, the paged base to grow its
        frontier from): with data shards, a row of its base's shard while that has one,
        else of the shard with a free row and the most free pages — the base's pages are
        then written again there (`shard_moves`), since a shard's rows read only its own
        pages."""
        if self.shards == 1:
            row = self._free_row()
            assert row is not None  # reserved at admission
            return row, 0, base
        pool = self.pages.pool
        home = pool.table_shard(base.table) if isinstance(base, PagedFrontier) else None
        rows = [sum(self._rows[r] is None for r in self._shard_rows(s)) for s in range(self.shards)]
        shard = shard_for(home, rows, [pool.free_in(s) for s in range(self.shards)])
        if home is not None and shard != home:
            self.shard_moves += 1
            base = None
        return self._free_row(shard), shard, base

    def _grid(self, size: int, stepping: list[int], tokens: int = 1) -> np.ndarray:
        """The page tables of rows [0, size) for a step, each stepping row's grown by the
        `tokens` it may evaluate (its tail its own); other rows' are all null pages, so
        they neither read nor write any page."""
        width = pages_for(self._batch_span)
        grid = np.zeros((size, width), np.int32)
        for row in stepping:
            try:
                self._tables[row] = self._advance(self._tables[row], tokens)
            except OutOfPages as err:  # the row ends; its session keeps its prompt end
                self._rows[row], ticket = None, self._rows[row]
                self.pages.pool.release(self._tables[row])
                self._tables[row] = None
                ticket.fail(EngineError(529, f"overloaded: the page pool is full ({err}); "
                                        "retry shortly", "overloaded_error"))  # fmt: skip
                continue
            grid[row] = self._tables[row].padded(width)
        return grid

    def _advance(self, table: PageTable, tokens: int = 1) -> PageTable:
        """A row's table grown by the tokens its step may evaluate; when the pool is full,
        fork points and idle sessions give up pages first, as the state budget orders them
        (`continuation.pool.evictions`), and the growth is tried once more."""
        try:
            return self.pages.advance(table, tokens)
        except OutOfPages as err:
            with self._state_lock:
                held = self.pool.state_bytes()
            target = held - err.wanted * self.pages.page_nbytes
            if not self._enforce_budget(None, target, pages=err.wanted):
                raise
            return self.pages.advance(table, tokens)

    def _release_tables(self) -> None:
        for row, table in enumerate(self._tables):
            if table is not None and self.pages is not None:
                self.pages.pool.release(table)
            self._tables[row] = None

    def _row_frontier(self, row: int, tokens: int) -> Any:
        """The state a row leaves with: dense, or its pages (the table cut back to the
        tokens it evaluated: a sampled EOS is not) and its small part."""
        small = batch_ops.extract(self._batch, np.int32(row))
        if self.pages is None:
            return self._fit(small, tokens)
        table, self._tables[row] = self._tables[row], None
        return self.pages.adopt(self.pages.pool.trim(table, tokens), small)

    def _keep(self, state: Any, ids: Sequence[int], base: Any, shard: int = 0) -> Any:
        """What a retained frontier holds of `state` (of the tokens `ids`): itself, or with
        paged frontiers its pages, grown from `base`'s (else on `shard`) and shared where
        another frontier's pages hold the same prefix."""
        if self.pages is None:
            return state
        tokens = len(ids)
        try:
            return self.pages.keep(state, tokens, base, ids, shard)
        except OutOfPages as err:  # kept dense instead: correct, and the budget counts it so
            log.warning("page pool full (%s): a frontier of %d tokens kept whole", err, tokens)
            return state

    def _pages_freed(self, forks: list[Any], slots: list[int]) -> int:
        """Pages no frontier or row would hold once `forks` and the sessions `slots` are
        dropped (a session whose pages its fork points share frees none of them)."""
        gone = {id(f) for f in forks}
        out = [f.frontier for f in forks] + [self.pool.sessions[i].live for i in slots]
        kept = [s.live for s in self.pool.sessions if s.slot not in slots]
        kept += [f.frontier for f in self.pool.forks if id(f) not in gone]

        def pages(frontiers: list[Any]) -> set[int]:
            states = (f.state for f in frontiers if f is not None)
            return set().union(*(s.table.pages for s in states if isinstance(s, PagedFrontier)))

        rows = set().union(*(t.pages for t in self._tables if t is not None))
        return len(pages(out) - pages(kept) - rows)
