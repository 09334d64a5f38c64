"""The page pool's bookkeeping (`ds4jax.kvstore.pages`) without a model: random
interleavings of new frontiers, growth from any retained frontier (the live session moving
on, a retry of a fork point, a sub-agent on a shared prefix), extra holders and releases,
against page contents simulated here the way the step would write them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ds4jax.kvstore.pages import OutOfPages, PagePool, pages_for, shard_for
from ds4jax.model.page_table import NULL_PAGE, PAGE_TOKENS, PageTable


def test_pages_for_counts_partial_pages() -> None:
    assert [pages_for(n) for n in (0, 1, 255, 256, 257, 512, 513)] == [0, 1, 1, 1, 2, 2, 3]


def test_a_fork_shares_full_pages_and_copies_only_its_partial_last_page() -> None:
    pool = PagePool(16)
    prompt = pool.new(600)  # two full pages and 88 tokens of a third
    assert len(prompt.pages) == 3 and pool.used == 3
    live, copies = pool.grow(prompt, 40)  # the session moves on: appends in place
    assert copies == [] and live.pages == prompt.pages and pool.used == 3
    retry, copies = pool.grow(prompt, 10)  # a retry of the prompt end: live wrote past it
    assert retry.pages[:2] == prompt.pages[:2] and retry.pages[2] != prompt.pages[2]
    assert copies and copies[0].src == prompt.pages[2] and copies[0].tokens == 600 - 512
    assert pool.used == 4  # one page more, not a copy of the frontier
    assert [pool.refs[p] for p in prompt.pages] == [3, 3, 2]
    for t in (prompt, live, retry):
        pool.release(t)
    assert pool.used == 0 and pool.free == 15


def test_growing_past_the_pool_changes_nothing() -> None:
    pool = PagePool(4)  # three usable pages
    a = pool.new(2 * PAGE_TOKENS + 1)
    before = (list(pool.refs), list(pool.written), pool.free)
    with pytest.raises(OutOfPages) as info:
        pool.grow(a, PAGE_TOKENS)
    assert info.value.wanted == 1 and info.value.free == 0
    assert (list(pool.refs), list(pool.written), pool.free) == before


def test_the_null_page_pads_tables_and_is_never_handed_out() -> None:
    pool = PagePool(3)
    t = pool.new(300)
    assert NULL_PAGE not in t.pages and t.padded(4) == [*t.pages, NULL_PAGE, NULL_PAGE]
    with pytest.raises(ValueError):
        t.padded(1)
    with pytest.raises(ValueError):
        PagePool(1)


class Frontiers(RuleBasedStateMachine):
    """Each retained frontier is a table plus the token values it holds; the pages' contents
    are simulated as the step writes them: copies first, then the new tokens at their slots.
    Reading a frontier back through its table must give exactly its tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(24)
        self.data: dict[int, list[int | None]] = {}  # page → token value at each slot
        self.frontiers: list[tuple[PageTable, list[int]]] = []
        self.next_value = 0

    def _write(self, table: PageTable, values: list[int], start: int) -> None:
        for pos in range(start, table.tokens):
            page = table.pages[pos // PAGE_TOKENS]
            self.data.setdefault(page, [None] * PAGE_TOKENS)[pos % PAGE_TOKENS] = values[pos]

    def _copy(self, copies: list) -> None:
        """The copies growth asked for, as the step makes them: the source's first tokens."""
        for c in copies:
            src = self.data.get(c.src, [None] * PAGE_TOKENS)
            self.data[c.dst] = [*src[: c.tokens], *([None] * (PAGE_TOKENS - c.tokens))]

    def _values(self, n: int) -> list[int]:
        self.next_value += n
        return list(range(self.next_value - n, self.next_value))

    @rule(tokens=st.integers(0, 700))
    def new(self, tokens: int) -> None:
        try:
            table = self.pool.new(tokens)
        except OutOfPages:
            return
        values = self._values(tokens)
        self._write(table, values, 0)
        self.frontiers.append((table, values))

    @precondition(lambda self: self.frontiers)
    @rule(data=st.data(), tokens=st.integers(0, 300))
    def grow(self, data: st.DataObject, tokens: int) -> None:
        i = data.draw(st.integers(0, len(self.frontiers) - 1))
        table, values = self.frontiers[i]
        try:
            grown, copies = self.pool.grow(table, tokens)
        except OutOfPages:
            return
        # only a partial last page is ever copied, never a full one
        assert len(copies) <= 1 and all(0 < c.tokens < PAGE_TOKENS for c in copies)
        self._copy(copies)
        new_values = [*values, *self._values(tokens)]
        self._write(grown, new_values, table.tokens)
        self.frontiers.append((grown, new_values))

    @precondition(lambda self: self.frontiers)
    @rule(data=st.data(), tokens=st.integers(0, 300))
    def advance(self, data: st.DataObject, tokens: int) -> None:
        """A batch row stepping on: its table replaced by the grown one, no reference
        left behind."""
        i = data.draw(st.integers(0, len(self.frontiers) - 1))
        table, values = self.frontiers[i]
        try:
            grown, copies = self.pool.advance(table, tokens)
        except OutOfPages:
            return
        self._copy(copies)
        new_values = [*values, *self._values(tokens)]
        self._write(grown, new_values, table.tokens)
        self.frontiers[i] = (grown, new_values)

    @precondition(lambda self: self.frontiers)
    @rule(data=st.data(), cut=st.integers(0, 300))
    def trim(self, data: st.DataObject, cut: int) -> None:
        i = data.draw(st.integers(0, len(self.frontiers) - 1))
        table, values = self.frontiers[i]
        keep = max(table.tokens - cut, 0)
        self.frontiers[i] = (self.pool.trim(table, keep), values[:keep])

    @precondition(lambda self: self.frontiers)
    @rule(data=st.data())
    def hold_again(self, data: st.DataObject) -> None:
        table, values = data.draw(st.sampled_from(self.frontiers))
        self.frontiers.append((self.pool.hold(table), values))

    @precondition(lambda self: self.frontiers)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.frontiers) - 1))
        table, _ = self.frontiers.pop(i)
        self.pool.release(table)

    @invariant()
    def every_frontier_reads_its_own_tokens(self) -> None:
        for table, values in self.frontiers:
            assert len(table.pages) == pages_for(table.tokens)
            got = [self.data[table.pages[p // PAGE_TOKENS]][p % PAGE_TOKENS]
                   for p in range(table.tokens)]  # fmt: skip
            assert got == values

    @invariant()
    def a_page_is_free_exactly_when_nothing_holds_it(self) -> None:
        held: dict[int, int] = {}
        for table, _ in self.frontiers:
            for p in table.pages:
                held[p] = held.get(p, 0) + 1
        assert NULL_PAGE not in held and self.pool.refs[NULL_PAGE] == 0
        assert {p: r for p, r in enumerate(self.pool.refs) if r} == held
        assert self.pool.used == len(held)
        assert set(self.pool._free).isdisjoint(held)


Frontiers.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_frontiers = Frontiers.TestCase


class ShardedFrontiers(Frontiers):
    """The same interleavings on a pool split into three data shards (issue 28): new
    frontiers go to a drawn shard or the one `place` picks, and besides every rule above,
    a frontier's pages stay in one shard's block, no shard's null page is handed out, and
    each shard's free pages are exactly its block's unheld ones."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(27, shards=3)  # 9 pages a shard, 8 usable

    @rule(tokens=st.integers(0, 700), shard=st.one_of(st.none(), st.integers(0, 2)))
    def new_on_a_shard(self, tokens: int, shard: int | None) -> None:
        if shard is None:
            shard = self.pool.place()
            assert self.pool.free_in(shard) == max(self.pool.free_in(s) for s in range(3))
        free = self.pool.free_in(shard)
        try:
            table = self.pool.new(tokens, shard)
        except OutOfPages as err:
            assert err.free == free  # full here, whatever the other shards hold
            return
        assert self.pool.table_shard(table, shard) == shard
        values = self._values(tokens)
        self._write(table, values, 0)
        self.frontiers.append((table, values))

    @invariant()
    def a_frontier_lies_in_one_shard_and_shards_keep_their_own_free_pages(self) -> None:
        pool = self.pool
        for table, _ in self.frontiers:
            assert len({pool.shard_of(p) for p in table.pages}) <= 1
            assert all(p % pool.block for p in table.pages)  # no shard's null page
        held = {p for table, _ in self.frontiers for p in table.pages}
        for s in range(pool.shards):
            block = range(s * pool.block + 1, (s + 1) * pool.block)
            assert sorted(pool._free_by[s]) == [p for p in block if p not in held]


ShardedFrontiers.TestCase.settings = settings(max_examples=40, stateful_step_count=40,
                                              deadline=None)  # fmt: skip
test_sharded_frontiers = ShardedFrontiers.TestCase


def test_a_shard_is_full_on_its_own_and_a_sharded_pool_keeps_its_size() -> None:
    pool = PagePool(8, shards=2)  # shard 0: pages 1-3, shard 1: pages 5-7
    a = pool.new(3 * PAGE_TOKENS, shard=1)
    assert a.pages == (5, 6, 7) and pool.place() == 0 and pool.used == 3
    with pytest.raises(OutOfPages):
        pool.grow(a, 1)  # shard 0's three free pages are not a's
    b = pool.new(10)
    with pytest.raises(ValueError):
        pool.substitute(PageTable((b.pages[0],), PAGE_TOKENS), 0, a.pages[0])  # across shards
    with pytest.raises(ValueError):
        pool.extend(4)
    with pytest.raises(ValueError):
        PagePool(9, shards=2)
    assert PageTable((5, 6), 300).padded(3) == [5, 6, NULL_PAGE]  # global ids, null 0


@given(st.lists(st.integers(1, 400), min_size=1, max_size=8))
@settings(max_examples=50, deadline=None)
def test_a_live_session_growing_turn_by_turn_holds_its_tokens_pages(turns: list[int]) -> None:
    """The live session moving on and dropping its previous frontier holds exactly the
    pages its tokens need: memory follows the tokens, not a capacity."""
    pool = PagePool(64)
    table = pool.new(0)
    for n in turns:
        grown, copies = pool.grow(table, n)
        assert copies == []  # nothing else appended past its end
        pool.release(table)
        table = grown
        assert pool.used == pages_for(table.tokens)


def test_a_full_page_is_substituted_by_an_identical_held_one() -> None:
    pool = PagePool(8)
    a = pool.new(600)  # another conversation's prefill: pages 1..3
    b = pool.new(520)  # a second one, same first two pages' tokens: its own copies
    shared = pool.substitute(b, 0, a.pages[0])
    assert shared.pages[0] == a.pages[0] and shared.pages[1:] == b.pages[1:]
    assert pool.refs[a.pages[0]] == 2 and pool.refs[b.pages[0]] == 0 and pool.used == 5
    with pytest.raises(ValueError):
        pool.substitute(shared, 2, a.pages[2])  # a partial page is never shared this way
    for t in (a, shared):
        pool.release(t)
    assert pool.used == 0


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50)), min_size=1, max_size=6),
    st.data(),
)
def test_a_turn_goes_to_its_sessions_shard_while_it_has_a_row(shards, data) -> None:
    """`shard_for` (issue 28): a tool turn (its base on `home`) never lands on a shard
    without a free row; it stays on its session's shard while that has one; otherwise it
    goes to the shard with a free row and the most free pages."""
    rows = [r for r, _ in shards]
    pages = [p for _, p in shards]
    if not any(rows):
        rows[data.draw(st.integers(0, len(rows) - 1))] = 1  # admission reserved a row
    home = data.draw(st.none() | st.integers(0, len(rows) - 1))
    got = shard_for(home, rows, pages)
    assert rows[got] > 0
    if home is not None and rows[home] > 0:
        assert got == home
    else:
        assert pages[got] == max(p for r, p in zip(rows, pages, strict=True) if r > 0)
