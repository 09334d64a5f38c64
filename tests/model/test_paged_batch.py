"""The batched step on rows whose long part lives in pages (`model.batch.paged_step`):
its tokens and states equal the dense batch's bit for bit — across compression
boundaries, a new page, a tail page shared with a frontier that moved on, a forced EOS —
and the frontiers outside the batch read back unchanged: no row writes a page another
frontier reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.config import load_config
from ds4jax.kvstore.pages import PagePool
from ds4jax.model import batch as mb
from ds4jax.model import page_io, pages
from ds4jax.model.forward import prefill
from ds4jax.model.params import init_params
from tests.model.conftest import PAGED_CHUNKS
from tests.model.conftest import PAGED_MAX_LEN as MAX_LEN

CFG = load_config("tiny")
ROWS, STEPS, EOS = 4, 12, CFG.eos_token_id


def same(a: object, b: object) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def per_row(size: int, seed: int) -> tuple:
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), size)))
    return (keys, np.zeros(size, np.float32), np.zeros(size, np.int32), np.ones(size, np.float32),
            np.zeros(size, np.float32), np.int32(EOS))  # fmt: skip


def test_paged_rows_step_as_dense_rows_and_leave_other_frontiers_unchanged(paged_states) -> None:
    params = init_params(CFG, 0)
    near, _ = prefill(params, paged_states["retry"], list(range(20, 134)), CFG,
                      chunk_sizes=PAGED_CHUNKS)  # fmt: skip  # 764 tokens: a page ends at 768
    pool = PagePool(24)
    arrays = pages.page_arrays(CFG, pool.num_pages, CFG.state_dtype)
    prompt = pool.new(600)
    arrays = page_io.write(arrays, paged_states["prompt"], prompt, CFG, CFG.state_dtype)
    live, _ = pool.grow(prompt, 300)  # moved on in place: the prompt's tail page is shared
    arrays = page_io.write(arrays, paged_states["live"], live, CFG, CFG.state_dtype, first=2)
    far = pool.new(764)
    arrays = page_io.write(arrays, near, far, CFG, CFG.state_dtype)
    outside = {  # frontiers the batch must leave as they are
        name: page_io.PagedFrontier(pool.hold(t), page_io.small_part(paged_states[name]))
        for name, t in (("prompt", prompt), ("live", live))
    }
    states = [paged_states["prompt"], paged_states["live"], near]
    tables = [prompt, live, far]  # the rows' own references (taken by `new` / `grow`)

    dense = mb.empty_batch(CFG, MAX_LEN, ROWS)
    small = mb.empty_batch(CFG, MAX_LEN, ROWS, small=True)
    for row, s in enumerate(states):
        dense = mb.insert(dense, jnp.int32(row), s)
        small = mb.insert(small, jnp.int32(row), page_io.small_part(s))
    copied = 0
    for step in range(STEPS):
        override = np.full(ROWS, -1, np.int32)
        if step == 5:
            override[1] = EOS  # sampled, never evaluated: the row's table is trimmed back
        if step == 7:
            override[2] = 42
        for row in range(len(tables)):
            tables[row], copies = pool.advance(tables[row], 1)
            arrays, copied = page_io.copy(arrays, copies), copied + len(copies)
        width = MAX_LEN // 256
        grid = np.zeros((ROWS, width), np.int32)
        for row, t in enumerate(tables):
            grid[row] = t.padded(width)
        dense, want, _ = mb.step(params, dense, override, *per_row(ROWS, step), cfg=CFG, size=ROWS)
        small, arrays, got, _ = mb.paged_step(params, small, arrays, grid, override,
                                              *per_row(ROWS, step), cfg=CFG, size=ROWS,
                                              span=MAX_LEN)  # fmt: skip
        active = len(tables)  # the padding row's tokens are nobody's
        assert np.array_equal(np.asarray(got)[:active], np.asarray(want)[:active]), step
        for row, t in enumerate(tables):
            n = int(mb.extract(small, jnp.int32(row)).pos)
            if n < t.tokens:
                tables[row] = pool.trim(t, n)
    # the prompt row's shared tail page, and the EOS row's next step: a trimmed table's
    # written mark stays (`PagePool.trim`), so its tail is copied once, never shared wrongly
    assert copied == 2
    assert len(tables[2].pages) == 4  # the 764-token row took a page at 768
    for row, t in enumerate(tables):
        front = page_io.PagedFrontier(t, mb.extract(small, jnp.int32(row)))
        assert same(page_io.materialize(arrays, front, CFG, MAX_LEN),
                    mb.extract(dense, jnp.int32(row))), row  # fmt: skip
    for name, front in outside.items():
        assert same(page_io.materialize(arrays, front, CFG, MAX_LEN), paged_states[name]), name


def test_by_shard_gives_each_shard_its_block_with_local_ids() -> None:
    """`by_shard` (issue 28) on plain arrays: 2 shards of a 4-row batch over an 8-page pool;
    shard 1's pages 5 and 7 are its local 1 and 3, the null page 0 reads each shard's own
    first page (global 0 and 4), and a batch or pool that does not split is refused."""
    tables = jnp.array([[1, 2], [3, 0], [5, 7], [6, 0]], jnp.int32)
    pool = jnp.arange(8, dtype=jnp.int32) * 10
    seen = mb.by_shard(lambda t, p: p[t], 2, 8, tables, pool)  # each shard's own block
    assert np.asarray(seen).tolist() == [[10, 20], [30, 0], [50, 70], [60, 40]]
    with pytest.raises(ValueError, match="split into 3 data shards"):
        mb.by_shard(lambda t, p: p[t], 3, 8, tables[:3], pool)
