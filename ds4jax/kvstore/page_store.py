"""Retained frontiers kept in pages at rest (issue 26, first engine step): the engine's live
frontiers and fork points hold a page table and a small part instead of a full-capacity
state, so what they cost follows the tokens they hold and what two of them share (a prompt
and the session that moved on, a retry, a sub-agent on the same system prompt) is stored
once. A prefill runs on a dense state: the base it continues is materialized, and the state it
leaves is written back as pages, growing from the base's table (`kvstore.pages`: only the
pages past the shared ones are written). Decoding reads pages: a batch row holds a table
(`advance` before each step) and its small part, and leaves as a frontier of its own
(`adopt`), no row copied (`model.batch.paged_step`).

Conversations that merely start alike share too: a full page is indexed by the token
prefix it closes, and a frontier written later whose page closes the same prefix with the
same bytes (two cold prefills of one system prompt, chunked alike) points at the page
already held instead (`_share`) — memory only: the prefill still ran.

Pages go back to the pool when the last frontier holding them is dropped: each
`PagedFrontier` carries a finalizer that queues its table, and the queue is drained by the
engine's thread before it next takes pages, so the pool is only ever changed there.
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.kvstore.pages import OutOfPages, PagePool, pages_for
from ds4jax.model import page_io
from ds4jax.model import pages as layout
from ds4jax.model.page_table import PAGE_TOKENS, PageTable
from ds4jax.model.sharding import fetch
from ds4jax.model.state import DecodeState, init_state, span_for


def prefix_keys(token_ids: Sequence[int], pages: int) -> list[bytes]:
    """One key per full page: a hash chained over the token ids up to that page's end, so
    two frontiers' k-th pages have the same key exactly when their first (k+1)·256 tokens
    are the same (vLLM's prefix-caching block hash, for memory only here)."""
    ids = np.asarray(token_ids[: pages * PAGE_TOKENS], np.int64)
    out, h = [], b""
    for k in range(pages):
        h = hashlib.blake2b(h + ids[k * PAGE_TOKENS : (k + 1) * PAGE_TOKENS].tobytes(),
                            digest_size=16).digest()  # fmt: skip
        out.append(h)
    return out


class PageStore:
    def __init__(
        self, cfg: Config, spans: tuple[int, ...], num_pages: int, dtype: str = "f32",
        place: Callable[[Any], Any] = lambda x: x, start_pages: int | None = None,
        shards: int = 1, frontiers: int | None = None,
    ) -> None:  # fmt: skip
        """`num_pages`: the most the pool grows to (the budget's pages); it starts with
        `start_pages` (default: all of them) and doubles when a frontier needs more, so
        its memory follows the tokens held rather than the budget. `shards` > 1 (issue
        28): the pool split into that many data shards (`PagePool`), each frontier on one
        (`keep`'s `shard`); such a pool takes its budget up front, since its page ids fix
        each shard's block: rounded down to whole shards, and no more than `frontiers` (the
        most a shard ever holds: sessions, fork points and rows) hold at the longest span
        on every shard — rather than a budget sized to the host's memory."""
        self.cfg, self.spans, self.dtype, self.place = cfg, spans, dtype, place
        if shards > 1:
            if frontiers is not None:
                num_pages = min(num_pages, shards * (frontiers * pages_for(spans[-1]) + 1))
            num_pages = start_pages = num_pages // shards * shards
        self.limit = num_pages
        start = num_pages if start_pages is None else max(2, min(start_pages, num_pages))
        self.pool = PagePool(start, shards)
        self.arrays = place(layout.page_arrays(cfg, start, dtype))
        self.page_nbytes = layout.page_bytes(cfg, dtype)
        shapes = jax.eval_shape(lambda: page_io.small_part(init_state(cfg, spans[0])))
        self.small_nbytes = sum(
            int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes)
        )
        self._released: deque[PageTable] = deque()
        #: full pages by the tokens they close (`prefix_keys`), while held: what another
        #: conversation's identical prefix shares
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}

    def keep(
        self, state: DecodeState, tokens: int, base: page_io.PagedFrontier | None = None,
        token_ids: Sequence[int] | None = None, shard: int = 0,
    ) -> page_io.PagedFrontier:  # fmt: skip
        """`state` (a dense state of `tokens` tokens) as a paged frontier; `base`, a paged
        frontier whose tokens `state` extends, lends it every page they share (and its
        shard); without one, the frontier goes to `shard`. With its `token_ids`, each full
        page it wrote is shared with a held page of its shard that closes the same token
        prefix and holds the same bytes (`_share`)."""
        if base is None or base.tokens > tokens:
            table, copies = self._pages(lambda: (self.pool.new(tokens, shard), []))
            first = 0
        else:
            table, copies = self._pages(lambda: self.pool.grow(base.table, tokens - base.tokens))
            first = base.tokens // PAGE_TOKENS
        self.arrays = page_io.copy(self.arrays, copies)
        self.arrays = page_io.write(self.arrays, state, table, self.cfg, self.dtype, first)
        if token_ids is not None:
            table = self._share(table, first, token_ids)
        frontier = page_io.PagedFrontier(table, page_io.small_part(state))
        weakref.finalize(frontier, self._released.append, table)
        return frontier

    def advance(self, table: PageTable, tokens: int) -> PageTable:
        """A batch row's table grown by `tokens` in place of `table` (`PagePool.advance`),
        its copies made, the pool grown when short: the row's tail page is then its own
        to write."""
        table, copies = self._pages(lambda: self.pool.advance(table, tokens))
        self.arrays = page_io.copy(self.arrays, copies)
        return table

    def _pages(self, take: Callable[[], Any]) -> Any:
        """`take()` (a pool call that asks for pages), the pool grown and the call tried
        again while it is short and under its limit (a short pool changes nothing). At the
        limit the garbage collector runs once before giving up: a dropped frontier gives its
        pages back by finalizer, and one caught in a reference cycle would hold them until
        the collector's next pass (seen in the suite: two pages held by nothing live)."""
        self._drain()
        collected = False
        while True:
            try:
                return take()
            except OutOfPages as err:
                if self.pool.num_pages < self.limit:
                    self._extend(max(self.pool.num_pages, err.wanted))
                elif collected:
                    raise
                else:
                    collected = True
                    gc.collect()
                    self._drain()

    def adopt(self, table: PageTable, small: DecodeState) -> page_io.PagedFrontier:
        """The frontier of a batch row that left: its table (whose references it takes
        over) and its small part; no row is copied."""
        frontier = page_io.PagedFrontier(table, small)
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

    def _share(self, table: PageTable, first: int, token_ids: Sequence[int]) -> PageTable:
        """Full pages `first`… of a table just written, each swapped for an identical held
        page closing the same prefix, or indexed for the next one. Only pages whose bytes
        are the same are shared (compared on the device): the frontier reads exactly the
        rows it wrote, whichever prefill made the page it now points at."""
        keys = prefix_keys(token_ids, table.tokens // PAGE_TOKENS)
        if self.pool.shards > 1:  # a page is shared within its data shard only
            shard = self.pool.table_shard(table).to_bytes(2, "little")
            keys = [shard + k for k in keys]
        ours, theirs = [], []
        for k in range(first, len(keys)):
            page, held = table.pages[k], self._by_key.get(keys[k])
            if held is None or self.pool.refs[held] <= 0:
                self._by_key[keys[k]], self._key_of[page] = page, keys[k]
            elif held != page:
                ours.append(k)
                theirs.append(held)
        if not ours:
            return table
        width = 1 << (len(ours) - 1).bit_length()  # a few compiled widths, not one per count
        pad = [0] * (width - len(ours))
        a = np.asarray([table.pages[k] for k in ours] + pad, np.int32)
        same = fetch(page_io.same_pages(self.arrays, a, np.asarray(theirs + pad, np.int32)))
        for k, held, eq in zip(ours, theirs, same, strict=False):
            if eq:
                table = self.pool.substitute(table, k, held)
        self._forget_freed(a)
        return table

    def _forget_freed(self, pages: Any) -> None:
        for p in pages:
            p = int(p)
            if p in self._key_of and self.pool.refs[p] == 0:
                key = self._key_of.pop(p)
                if self._by_key.get(key) == p:
                    del self._by_key[key]

    def _drain(self) -> None:
        while self._released:
            table = self._released.popleft()
            self.pool.release(table)
            self._forget_freed(table.pages)
