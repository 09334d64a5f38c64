"""The page pool's bookkeeping (issue 26, part 1): which page holds which tokens of which
frontier, as plain host-side data the jitted step will receive as arrays.

Why pages: a retained state today is a fixed-capacity array sized for `--ctx`, so a 2k-token
conversation at `--ctx 1M` costs what a 1M-token one does, and every fork point and batch row
costs it again. In pages, the long part of a frontier (compressed rows, indexer rows) is a
list of 256-token blocks (64 CSA rows, 64 indexer rows, 2 HCA rows each — one logical block
for every layer kind, as vLLM, SGLang and llama.cpp size theirs), and a full block is
shared by every frontier holding those tokens: the live session that moved on, its fork
points, a retry, a sub-agent with the same system prompt, a batch row.

The rules, all enforced here (`tests/kvstore/test_pages.py` holds them over random
interleavings):
- A `PageTable` is immutable, like the frontier it belongs to; holding one holds a
  reference on each of its pages. `release` gives them back; a page is free again when no
  table holds it. Page 0 is the null page that padding points at; it is never handed out.
- Tokens are only ever appended. A page records how far it has been written
  (`written`); a table may append in place into its last page only if nothing was written
  there past its own end. Otherwise — another frontier grew from the same partial page, a
  retry of a fork point whose live session moved on — the partial page is copied into a
  fresh one first (a `Copy` for the step to carry out), so no frontier ever changes rows
  another one reads. A full page is never written again, so sharing it needs no copy.
- Growing asks for every page it needs before changing anything: when the pool is short
  it raises `OutOfPages` and the pool is as it was.
- `written` only rises while a page is held (a table that grew in place and was then
  dropped leaves the mark where it was): a later append from an older table then copies
  the page, which is always correct, at worst one page's copy more than needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ds4jax.model.page_table import PAGE_TOKENS, Copy, PageTable


def pages_for(tokens: int) -> int:
    """Pages a frontier of `tokens` tokens holds."""
    return -(-tokens // PAGE_TOKENS)


def shard_for(base: int | None, free_rows: list[int], free_pages: list[int]) -> int:
    """The data shard a prompt's row and frontier go to (issue 28): `base`'s — the shard
    holding the pages it grows from: its session's live state for a tool turn, a fork
    point's — while that shard has a free row, so a turn continues where its session is;
    else, of the shards with a free row, the one with the most free pages (the first on a
    tie), the base's pages then written again there. At least one shard has a free row
    (admission reserved one)."""
    if base is not None and free_rows[base] > 0:
        return base
    open_ = [s for s, rows in enumerate(free_rows) if rows > 0]
    return max(open_, key=lambda s: (free_pages[s], -s))


class OutOfPages(RuntimeError):
    """The pool cannot give the pages asked for; nothing was changed."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"{wanted} pages wanted, {free} free")
        self.wanted = wanted
        self.free = free


@dataclass
class PagePool:
    """Reference counts, the free lists and each page's written length for `num_pages`
    pages (page 0, the null page, included).

    `shards` > 1 (issue 28, data-parallel attention): the pages split into that many equal
    blocks, shard s owning [s·B, (s+1)·B) — the pages one data shard's devices hold
    (`model.batch.by_shard`). Each block's first page is that shard's null page, never
    handed out; a frontier's pages all lie in one shard, new pages of a table come from its
    own shard's free list, and a shard that is full is full even when another has room
    (moving a frontier is a copy the caller decides on). Page ids stay global, so tables
    pad with page 0 as before."""

    num_pages: int
    shards: int = 1
    refs: list[int] = field(init=False)
    written: list[int] = field(init=False)
    _free_by: list[list[int]] = field(init=False)  # per shard; pop() gives its lowest page

    def __post_init__(self) -> None:
        if self.num_pages < 2 * self.shards or self.num_pages % self.shards:
            raise ValueError(f"{self.num_pages} pages do not give {self.shards} shard(s) a "
                             "null page and at least one page each")  # fmt: skip
        self.refs = [0] * self.num_pages
        self.written = [0] * self.num_pages
        b = self.block
        self._free_by = [list(range((s + 1) * b - 1, s * b, -1)) for s in range(self.shards)]

    @property
    def block(self) -> int:
        """Pages per shard (all of them with one shard)."""
        return self.num_pages // self.shards

    @property
    def _free(self) -> list[int]:
        return [p for free in self._free_by for p in free]

    @property
    def free(self) -> int:
        return sum(len(f) for f in self._free_by)

    def free_in(self, shard: int) -> int:
        return len(self._free_by[shard])

    def shard_of(self, page: int) -> int:
        return page // self.block

    def table_shard(self, table: PageTable, default: int = 0) -> int:
        """The shard holding a table's pages (`default` for a table with none)."""
        return self.shard_of(table.pages[0]) if table.pages else default

    def place(self) -> int:
        """The shard a new frontier should go to (`shard_for` with no base, a row free on
        every shard): the one with the most free pages, the first of them on a tie."""
        return shard_for(None, [1] * self.shards, [self.free_in(s) for s in range(self.shards)])

    def extend(self, pages: int) -> None:
        """`pages` more pages (ids from `num_pages` on): a pool grows with the tokens held,
        up to its budget, instead of taking the budget's memory up front. The pages free
        before are handed out first. A pool split into shards keeps its size: its page ids
        fix each shard's block."""
        if self.shards > 1:
            raise ValueError("a pool split into shards cannot grow: page ids fix its blocks")
        start = self.num_pages
        self.num_pages += pages
        self.refs += [0] * pages
        self.written += [0] * pages
        self._free_by[0] = list(range(self.num_pages - 1, start - 1, -1)) + self._free_by[0]

    @property
    def used(self) -> int:
        return self.num_pages - self.shards - self.free

    def hold(self, table: PageTable) -> PageTable:
        """One more holder of `table` (a frontier retained twice: a fork point and a live
        session at the same tokens)."""
        for p in table.pages:
            assert self.refs[p] > 0, f"page {p} is not held"
            self.refs[p] += 1
        return table

    def substitute(self, table: PageTable, k: int, page: int) -> PageTable:
        """`table` with its `k`-th page, a full one, replaced by `page`: a held page whose
        rows are bit for bit the same (a sub-agent's system prompt another conversation
        prefilled). The reference moves; `table`'s own page is freed if nothing else holds
        it. The caller drops `table` for the returned one."""
        old = table.pages[k]
        if ((k + 1) * PAGE_TOKENS > table.tokens or self.refs[page] <= 0 or page == old
                or self.shard_of(page) != self.shard_of(old)):  # fmt: skip
            raise ValueError(f"page {k} of {table} cannot take page {page}")
        self.refs[page] += 1
        self.release(PageTable((old,), PAGE_TOKENS))
        return PageTable((*table.pages[:k], page, *table.pages[k + 1 :]), table.tokens)

    def release(self, table: PageTable) -> None:
        for p in table.pages:
            assert self.refs[p] > 0, f"page {p} released more often than held"
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.written[p] = 0
                self._free_by[self.shard_of(p)].append(p)

    def grow(self, table: PageTable, tokens: int, shard: int = 0) -> tuple[PageTable, list[Copy]]:
        """A new table holding `table`'s tokens and `tokens` more, and the copies to make
        before the step writes the new rows. `table` stays valid and held as it was; the
        new table holds its own references. Its pages come from `table`'s shard (`shard`
        for a table with none)."""
        return self._append(table, tokens, moved=False, shard=shard)

    def advance(self, table: PageTable, tokens: int) -> tuple[PageTable, list[Copy]]:
        """`grow`, with `table`'s own references moving to the new table (the caller drops
        `table`): a batch row's table before each step, touching only its tail."""
        return self._append(table, tokens, moved=True)

    def trim(self, table: PageTable, tokens: int) -> PageTable:
        """`table` cut back to its first `tokens` tokens (a row's table grown for tokens
        the step did not keep: an EOS, a rejected speculative draft), its references moving
        (the caller drops `table`); pages past the cut are released. A tail page this table
        alone holds has its written mark brought back to the cut — nothing else reads past
        it, and the row's next append then writes in place rather than into a copy; a
        shared one keeps its mark."""
        if tokens > table.tokens:
            raise ValueError(f"{table} cannot be trimmed to {tokens} tokens")
        k = pages_for(tokens)
        self.release(PageTable(table.pages[k:], 0))
        fill = tokens % PAGE_TOKENS
        if k and fill and self.refs[table.pages[k - 1]] == 1:
            self.written[table.pages[k - 1]] = fill
        return PageTable(table.pages[:k], tokens)

    def _append(self, table: PageTable, tokens: int, moved: bool,
                shard: int = 0) -> tuple[PageTable, list[Copy]]:  # fmt: skip
        if tokens < 0:
            raise ValueError("tokens are only appended")
        free = self._free_by[self.table_shard(table, shard)]
        n, end = table.tokens, table.tokens + tokens
        keep = list(table.pages)
        copies: list[Copy] = []
        fill = n % PAGE_TOKENS
        tail_shared = bool(fill and tokens and self.written[keep[-1]] != fill)
        need = pages_for(end) - len(keep) + (1 if tail_shared else 0)
        if need > len(free):
            raise OutOfPages(need, len(free))
        if not moved:
            for p in keep:
                self.refs[p] += 1
        if tail_shared:  # someone appended past our end in that page: write into a copy
            fresh = free.pop()
            copies.append(Copy(keep[-1], fresh, fill))
            self.written[fresh] = fill
            self.refs[fresh] = 1
            self.release(PageTable((keep[-1],), 0))
            keep[-1] = fresh
        while len(keep) < pages_for(end):
            fresh = free.pop()
            self.refs[fresh] = 1
            keep.append(fresh)
        for i in range(n // PAGE_TOKENS, len(keep)):  # how far each page is written after
            last = min(end - i * PAGE_TOKENS, PAGE_TOKENS)
            if last > 0:
                self.written[keep[i]] = max(self.written[keep[i]], last)
        return PageTable(tuple(keep), end), copies

    def new(self, tokens: int, shard: int = 0) -> PageTable:
        """A table for a frontier of `tokens` tokens from nothing (a cold prefill), on
        `shard`."""
        table, copies = self.grow(PageTable(), tokens, shard)
        assert not copies
        return table
