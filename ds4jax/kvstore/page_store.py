"""Retained frontiers kept in pages at rest (issue 26, first engine step): the engine's live
frontiers and fork points hold a page table and a small part instead of a full-capacity
state, so what they cost follows the tokens they hold and what two of them share (a prompt
and the session that moved on, a retry, a sub-agent on the same system prompt) is stored
once. A request still runs on a dense state: the base it continues is materialized for its
prefill, and the state a prefill or a decode leaves is written back as pages, growing from
the base's table (`kvstore.pages`: only the pages past the shared ones are written).

Pages go back to the pool when the last frontier holding them is dropped: each
`PagedFrontier` carries a finalizer that queues its table, and the queue is drained by the
engine's thread before it next takes pages, so the pool is only ever changed there.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.kvstore.pages import PAGE_TOKENS, OutOfPages, PagePool, PageTable
from ds4jax.model import page_io
from ds4jax.model import pages as layout
from ds4jax.model.state import DecodeState, init_state, span_for


class PageStore:
    def __init__(
        self, cfg: Config, spans: tuple[int, ...], num_pages: int, dtype: str = "f32",
        place: Callable[[Any], Any] = lambda x: x, start_pages: int | None = None,
    ) -> None:  # fmt: skip
        """`num_pages`: the most the pool grows to (the budget's pages); it starts with
        `start_pages` (default: all of them) and doubles when a frontier needs more, so
        its memory follows the tokens held rather than the budget."""
        self.cfg, self.spans, self.dtype, self.place = cfg, spans, dtype, place
        self.limit = num_pages
        start = num_pages if start_pages is None else max(2, min(start_pages, num_pages))
        self.pool = PagePool(start)
        self.arrays = place(layout.page_arrays(cfg, start, dtype))
        self.page_nbytes = layout.page_bytes(cfg, dtype)
        shapes = jax.eval_shape(lambda: page_io.small_part(init_state(cfg, spans[0])))
        self.small_nbytes = sum(
            int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes)
        )
        self._released: deque[PageTable] = deque()

    def keep(
        self, state: DecodeState, tokens: int, base: page_io.PagedFrontier | None = None
    ) -> page_io.PagedFrontier:
        """`state` (a dense state of `tokens` tokens) as a paged frontier; `base`, a paged
        frontier whose tokens `state` extends, lends it every page they share."""
        self._drain()
        while True:
            try:
                if base is None or base.tokens > tokens:
                    table, copies = self.pool.new(tokens), []
                    first = 0
                else:
                    table, copies = self.pool.grow(base.table, tokens - base.tokens)
                    first = base.tokens // PAGE_TOKENS
                break
            except OutOfPages as err:  # nothing changed: grow the pool, or give up
                if self.pool.num_pages >= self.limit:
                    raise
                self._extend(max(self.pool.num_pages, err.wanted))
        self.arrays = page_io.copy(self.arrays, copies)
        self.arrays = page_io.write(self.arrays, state, table, self.cfg, self.dtype, first)
        frontier = page_io.PagedFrontier(table, page_io.small_part(state))
        weakref.finalize(frontier, self._released.append, table)
        return frontier

    def dense(self, state: Any) -> DecodeState:
        """A dense state for a step: a paged frontier materialized (at the span its tokens
        need, `model.state.spans`), a dense one as it is."""
        if isinstance(state, page_io.PagedFrontier):
            span = span_for(self.spans, min(state.tokens, self.spans[-1] - 1))  # as `Engine`
            return page_io.materialize(self.arrays, state, self.cfg, span)
        return state

    def _extend(self, pages: int) -> None:
        pages = min(pages, self.limit - self.pool.num_pages)
        more = layout.page_arrays(self.cfg, pages, self.dtype)
        self.arrays = self.place(jax.tree.map(lambda a, b: jnp.concatenate([a, b]),
                                              self.arrays, more))  # fmt: skip
        self.pool.extend(pages)

    def _drain(self) -> None:
        while self._released:
            self.pool.release(self._released.popleft())
