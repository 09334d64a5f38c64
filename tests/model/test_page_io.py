"""A frontier's rows through the page arrays and back (`ds4jax.model.page_io`), on states a
tiny model's prefill and decode really produced: stored whole, shared with a session that
moved on, copied for a retry — each materializes to its own dense state, unchanged by
what the others wrote."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ds4jax.config import load_config
from ds4jax.kvstore.pages import PagePool
from ds4jax.model import page_io, pages
from ds4jax.model.page_table import PageTable
from tests.model.conftest import PAGED_MAX_LEN as MAX_LEN

CFG = load_config("tiny")


def same(a: object, b: object) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_shared_pages_give_each_frontier_its_own_state(paged_states) -> None:
    states = paged_states
    pool = PagePool(16)
    arrays = pages.page_arrays(CFG, pool.num_pages, "f32")
    prompt = pool.new(600)
    arrays = page_io.write(arrays, states["prompt"], prompt, CFG, "f32")
    p_front = page_io.PagedFrontier(prompt, page_io.small_part(states["prompt"]))
    assert same(page_io.materialize(arrays, p_front, CFG, MAX_LEN), states["prompt"])

    # the live session moves on in place (its prompt's pages shared, the tail appended)
    live, copies = pool.grow(prompt, 300)
    assert copies == [] and live.pages[:3] == prompt.pages
    arrays = page_io.write(arrays, states["live"], live, CFG, "f32", first=600 // 256)
    l_front = page_io.PagedFrontier(live, page_io.small_part(states["live"]))
    # a retry of the prompt end: the tail page was written past 600, so it is copied
    retry, copies = pool.grow(prompt, 50)
    assert len(copies) == 1 and retry.pages[:2] == prompt.pages[:2]
    arrays = page_io.copy(arrays, copies)
    # the copy alone holds the prompt's rows of that page: the retry's table at the prompt's
    # length is the prompt
    copied = page_io.PagedFrontier(PageTable(retry.pages, 600), p_front.small)
    assert same(page_io.materialize(arrays, copied, CFG, MAX_LEN), states["prompt"])
    arrays = page_io.write(arrays, states["retry"], retry, CFG, "f32", first=600 // 256)
    r_front = page_io.PagedFrontier(retry, page_io.small_part(states["retry"]))
    assert pool.used == 5  # 3 + 1 for the live session + 1 copy: not three frontiers' worth
    for front, name in ((p_front, "prompt"), (l_front, "live"), (r_front, "retry")):
        assert same(page_io.materialize(arrays, front, CFG, MAX_LEN), states[name]), name
    # materialized into another capacity that holds the tokens, the rows are the same
    wide = page_io.materialize(arrays, p_front, CFG, 2048)
    for i, ls in enumerate(wide.layers):
        if ls.comp is not None:
            n = 600 // CFG.compress_ratios[i]
            assert np.array_equal(
                np.asarray(ls.comp[:n]), np.asarray(states["prompt"].layers[i].comp[:n])
            )
    with pytest.raises(ValueError):
        page_io.materialize(arrays, l_front, CFG, 512)


def test_fp8_pages_keep_the_models_rows_but_their_rope_dims(paged_states) -> None:
    """In fp8 pages a frontier comes back with its non-RoPE row values exact (the model
    simulated FP8 on them already), its RoPE dims as BF16 and its indexer rows within E4M3
    rounding; the small part is untouched."""
    pool = PagePool(8)
    arrays = pages.page_arrays(CFG, pool.num_pages, "fp8")
    table = pool.new(600)
    prompt = paged_states["prompt"]
    arrays = page_io.write(arrays, prompt, table, CFG, "fp8")
    got = page_io.materialize(
        arrays, page_io.PagedFrontier(table, page_io.small_part(prompt)), CFG, MAX_LEN
    )
    nope = CFG.head_dim - CFG.rope_dim
    for i, (g, w) in enumerate(zip(got.layers, prompt.layers, strict=True)):
        assert np.array_equal(np.asarray(g.raw), np.asarray(w.raw))
        if w.comp is None:
            continue
        gc, wc = np.asarray(g.comp), np.asarray(w.comp)
        assert np.array_equal(gc[:, :nope], wc[:, :nope]), i
        assert np.allclose(gc[:, nope:], wc[:, nope:], rtol=2**-8, atol=0)
        if w.idx is not None:
            gi, wi = np.asarray(g.idx), np.asarray(w.idx)
            assert np.allclose(gi, wi, rtol=2**-4, atol=np.abs(wi).max() * 2**-10)


def test_a_page_store_grows_with_the_tokens_held_up_to_its_limit(paged_states) -> None:
    """It starts with two pages (the null page and one), grows by its size or what a
    frontier wants when short, keeps what it held through the growth, and refuses past its
    limit unchanged."""
    from ds4jax.kvstore.page_store import PageStore
    from ds4jax.kvstore.pages import OutOfPages
    from ds4jax.model.state import resize, spans

    store = PageStore(CFG, spans(CFG, MAX_LEN, 256), num_pages=8, start_pages=2)
    assert store.pool.num_pages == 2
    first = store.keep(paged_states["retry"], 650)  # three pages: the pool grows
    assert store.pool.num_pages == 2 + 3 and len(first.table.pages) == 3
    live = store.keep(paged_states["live"], 900, store.keep(paged_states["prompt"], 600))
    assert store.pool.num_pages == 8  # grown again, to its limit; the first is intact
    want = resize(paged_states["retry"], cfg=CFG, span=1024)
    assert same(store.dense(first), want)
    assert same(store.dense(live), resize(paged_states["live"], cfg=CFG, span=1024))
    used = store.pool.used
    with pytest.raises(OutOfPages):
        store.keep(paged_states["live"], 900)  # four more pages: past the limit
    assert store.pool.used == used and store.pool.num_pages == 8


def test_a_full_store_collects_a_dropped_frontier_caught_in_a_reference_cycle(paged_states):
    """A frontier gives its pages back by finalizer. Dropped inside a reference cycle it is
    only finalized by the garbage collector, so a store at its limit collects once before
    refusing, instead of refusing while nothing live holds the pages."""
    import gc

    from ds4jax.kvstore.page_store import PageStore
    from ds4jax.model.state import spans

    store = PageStore(CFG, spans(CFG, MAX_LEN, 256), num_pages=5)  # the null page and 4
    cycle: list = [store.keep(paged_states["live"], 900)]  # all four pages
    cycle.append(cycle)
    gc.disable()  # the collector must not run on its own between the drop and the ask
    try:
        del cycle
        assert store.pool.used == 4  # nothing live holds them, the cycle still does
        store.keep(paged_states["retry"], 650)  # three pages
    finally:
        gc.enable()
    assert store.pool.used == 3


def test_pages_closing_the_same_prefix_with_the_same_bytes_are_stored_once(paged_states):
    """Two frontiers kept with no lineage between them (as two conversations' cold
    prefills): the later one's full pages that close the same token prefix and hold the
    same bytes point at the earlier one's; a page whose bytes differ is never shared, and
    each frontier still reads back exactly its own rows."""
    from dataclasses import replace

    from ds4jax.kvstore.page_store import PageStore
    from ds4jax.model.state import resize, spans

    store = PageStore(CFG, spans(CFG, MAX_LEN, 256), num_pages=32)
    ids = list(range(600))
    prompt = store.keep(paged_states["prompt"], 600, None, ids)
    used = store.pool.used
    live = store.keep(paged_states["live"], 900, None, [*ids, *range(1000, 1300)])
    assert live.table.pages[:2] == prompt.table.pages[:2]  # the two full shared pages
    assert store.pool.used == used + 4 - 2
    assert same(store.dense(live), resize(paged_states["live"], cfg=CFG, span=1024))
    # the same tokens claimed for other bytes: nothing is shared
    other = replace(paged_states["prompt"], layers=tuple(
        replace(ls, comp=None if ls.comp is None else ls.comp * 2.0)  # rows past the live stay 0
        for ls in paged_states["prompt"].layers))  # fmt: skip
    odd = store.keep(other, 600, None, ids)
    assert not set(odd.table.pages) & set(prompt.table.pages)
    assert same(store.dense(odd), resize(other, cfg=CFG, span=1024))


def test_a_store_split_into_data_shards_keeps_each_frontier_and_its_sharing_on_its_shard(
    paged_states,
) -> None:
    """`PageStore(shards=2)` (issue 28): the budget up front in two blocks, a frontier kept
    on the shard asked for (or its base's), reading back its own state; the same prefix
    kept on the other shard is stored there again — pages are shared within a shard only."""
    from ds4jax.kvstore.page_store import PageStore
    from ds4jax.model.state import resize, spans

    store = PageStore(CFG, spans(CFG, MAX_LEN, 256), num_pages=21, start_pages=2, shards=2)
    assert store.pool.num_pages == 20 and store.pool.block == 10
    ids = list(range(600))
    prompt = store.keep(paged_states["prompt"], 600, None, ids, shard=1)
    assert {store.pool.shard_of(p) for p in prompt.table.pages} == {1}
    live = store.keep(paged_states["live"], 900, prompt)  # grows on its base's shard
    assert {store.pool.shard_of(p) for p in live.table.pages} == {1}
    again = store.keep(paged_states["prompt"], 600, None, ids, shard=0)
    assert {store.pool.shard_of(p) for p in again.table.pages} == {0}  # not shared across
    used = store.pool.used
    twin = store.keep(paged_states["prompt"], 600, None, ids, shard=0)
    assert twin.table.pages[:2] == again.table.pages[:2] and store.pool.used == used + 1
    for f, name in ((prompt, "prompt"), (live, "live"), (again, "prompt"), (twin, "prompt")):
        assert same(store.dense(f), resize(paged_states[name], cfg=CFG, span=1024))
