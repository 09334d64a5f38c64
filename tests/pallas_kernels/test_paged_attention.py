"""Attention over pages: the twin gathers through the table (checked against dense rows
scattered into shuffled pages by hand), the kernel (interpret mode) computes the twin's
function, and neither reads a page its table does not name or a row past `visible`.

Every pool here puts sequences on a random permutation of the pages 1.. (page 0, the null
page, and the low ids hold junk), so an implementation that indexed pages by the logical
block j instead of table[j] reads the null page for block 0 and fails each test."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4jax.pallas_kernels.paged_attention import (
    BlockSizes,
    paged_attention,
    paged_attention_reference,
)
from ds4jax.pallas_kernels.sink_attention import sink_attention_reference

SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
D = 32
_twin = jax.jit(paged_attention_reference)  # one compile per shape, not one per op


def _close(a, b, tol=1e-5) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    assert np.abs(a - b).max(initial=0.0) <= tol


def _pool(rng: np.random.Generator, R: int, held: tuple[int, int], shared: int, width: int):
    """Two sequences holding `held` pages each, the first `shared` of them the same
    physical pages (a fork point and the session that moved on), at shuffled page ids of a
    junk-filled pool. Returns the pages, each sequence's table (padded with the null page
    to `width`) and its rows written densely in logical order."""
    a, b = held
    shared = min(shared, a, b)
    own = a + b - shared
    P = 1 + own + 2  # the null page, the sequences' pages, two pages nobody holds
    ids = 1 + rng.permutation(P - 1)[:own]
    tables = [list(ids[:a]), [*ids[:shared], *ids[a:own]]]
    dense_a = rng.standard_normal((a * R, D), np.float32)
    own_b = rng.standard_normal(((b - shared) * R, D), np.float32)
    dense_b = np.concatenate([dense_a[: shared * R], own_b])
    pages = rng.standard_normal((P, R, D), np.float32) * 3  # junk where nobody wrote
    for table, dense in zip(tables, (dense_a, dense_b), strict=True):
        for j, page in enumerate(table):  # scatter: logical block j → physical page
            pages[page] = dense[j * R : (j + 1) * R]
    padded = [np.array(t + [0] * (width - len(t)), np.int32) for t in tables]
    return jnp.asarray(pages), padded, [dense_a, dense_b]


def _case(seed: int, T: int, H: int, Kr: int, density: float):
    k = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k[0], (T, H, D))
    keys = jax.random.normal(k[1], (Kr, D))
    mask = jax.random.bernoulli(k[2], density, (T, Kr))
    return q, keys, mask, jax.random.normal(k[3], (H,))


def _visible(rng: np.random.Generator, T: int, rows: int, kind: str) -> jnp.ndarray:
    """Per-query visible counts: none, a random mix of 0 / partial pages / all, or all."""
    if kind == "none":
        return jnp.zeros((T,), jnp.int32)
    if kind == "all":
        return jnp.full((T,), rows, jnp.int32)
    v = rng.integers(0, rows + 1, T)
    v[rng.random(T) < 0.3] = 0
    return jnp.asarray(v, jnp.int32)


@jax.jit
def _dense(q, keys, mask, dense_rows, visible, sink):
    """The function both must compute, from the rows in logical order (no table)."""
    row_mask = jnp.arange(dense_rows.shape[0])[None, :] < visible[:, None]
    allkeys = jnp.concatenate([keys, dense_rows])
    return sink_attention_reference(q, allkeys, jnp.concatenate([mask, row_mask], 1), sink)


held_pages = st.tuples(st.integers(0, 3), st.integers(0, 3))


@settings(max_examples=12, deadline=None)
@given(
    T=st.sampled_from([1, 4]),
    R=st.sampled_from([2, 64]),
    held=held_pages,
    shared=st.integers(0, 3),
    pad=st.sampled_from([0, 2]),
    vis=st.sampled_from(["none", "mixed", "all"]),
    density=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_twin_gathers_through_the_table(T, R, held, shared, pad, vis, density, seed) -> None:
    rng = np.random.default_rng(seed)
    width = max(held) + pad
    pages, tables, dense = _pool(rng, R, held, shared, width)
    q, keys, mask, sink = _case(seed, T, 2, 5, density)
    for table, rows in zip(tables, dense, strict=True):
        visible = _visible(rng, T, rows.shape[0], vis)
        out = _twin(q, keys, mask, pages, jnp.asarray(table), visible, sink)
        _close(out, _dense(q, keys, mask, rows, visible, sink))


@SETTINGS
@given(
    T=st.sampled_from([1, 3, 9]),
    H=st.sampled_from([1, 4]),
    R=st.sampled_from([2, 64]),
    held=held_pages,
    shared=st.integers(0, 3),
    pad=st.sampled_from([0, 3]),
    vis=st.sampled_from(["none", "mixed", "mixed", "all"]),
    Kr=st.sampled_from([1, 9]),
    density=st.sampled_from([0.0, 0.5, 1.0]),  # 0.0 with no rows: only the sink
    blocks=st.sampled_from(
        [
            None,
            BlockSizes(block_t=2, block_h=2, block_k=4, block_pages=1),
            BlockSizes(block_t=4, block_pages=2),
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_its_twin(T, H, R, held, shared, pad, vis, Kr, density, blocks, seed):
    rng = np.random.default_rng(seed)
    pages, tables, dense = _pool(rng, R, held, shared, max(held) + pad)
    q, keys, mask, sink = _case(seed, T, H, Kr, density)
    for table, rows in zip(tables, dense, strict=True):  # same shapes: one compile
        visible = _visible(rng, T, rows.shape[0], vis)
        args = (q, keys, mask, pages, jnp.asarray(table), visible, sink)
        want = _twin(*args)
        _close(paged_attention(*args, block_sizes=blocks, interpret=True), want)
        _close(want, _dense(q, keys, mask, rows, visible, sink))


@pytest.mark.parametrize("R", [2, 64])
def test_unheld_pages_and_rows_past_visible_are_not_read(R) -> None:
    """Rewriting every page the table does not name (the null page, the low ids a
    logical-j indexing would read, another sequence's own pages) and every row past the
    largest visible count leaves both outputs unchanged, bit for bit (masked rows enter
    as p = 0 times their finite values)."""
    rng = np.random.default_rng(R)
    pages, (table_a, table_b), dense = _pool(rng, R, (3, 3), 1, 5)
    T = 6
    q, keys, mask, sink = _case(R, T, 4, 9, 0.5)
    visible = jnp.asarray([0, 1, R, 2 * R + 1, 3 * R - 1, R + 1], jnp.int32)
    args = (q, keys, mask, pages, jnp.asarray(table_a), visible, sink)
    blocks = BlockSizes(block_t=2, block_pages=1)
    kern = paged_attention(*args, block_sizes=blocks, interpret=True)
    twin = paged_attention_reference(*args)
    _close(twin, _dense(q, keys, mask, dense[0], visible, sink))
    _close(kern, twin)

    junk = np.asarray(pages).copy()
    held = set(table_a[table_a > 0].tolist())
    assert set(table_b.tolist()) - held - {0}, "b has pages of its own"
    for p in range(junk.shape[0]):
        if p not in held:
            junk[p] = rng.standard_normal((R, D)) * 1e3
    last = int(visible.max())  # logical rows [last, 3R) of a's pages are never seen
    flat = [(table_a[r // R], r % R) for r in range(last, 3 * R)]
    assert flat, "some held rows lie past visible"
    for page, row in flat:
        junk[page, row] = rng.standard_normal(D) * 1e3
    args = (q, keys, mask, jnp.asarray(junk), jnp.asarray(table_a), visible, sink)
    np.testing.assert_array_equal(paged_attention(*args, block_sizes=blocks, interpret=True), kern)
    np.testing.assert_array_equal(paged_attention_reference(*args), twin)


def test_an_empty_table_leaves_the_raw_window() -> None:
    q, keys, mask, sink = _case(0, 3, 2, 7, 0.6)
    pages = jax.random.normal(jax.random.key(1), (4, 2, D))
    table, visible = jnp.zeros((0,), jnp.int32), jnp.zeros((3,), jnp.int32)
    want = sink_attention_reference(q, keys, mask, sink)
    _close(paged_attention_reference(q, keys, mask, pages, table, visible, sink), want)
    _close(paged_attention(q, keys, mask, pages, table, visible, sink, interpret=True), want)


def test_auto_takes_the_twin_where_the_kernel_cannot_lower(monkeypatch) -> None:
    """No GPU backend implements scalar prefetch: "auto" takes the twin on GPU (and CPU),
    and the kernel itself says why rather than failing deep in the lowering."""
    from ds4jax.pallas_kernels import AUTO_KERNELS, select

    assert select("auto", "paged_attention") is paged_attention_reference  # CPU here
    assert "paged_attention" not in AUTO_KERNELS["gpu"]
    monkeypatch.setattr(
        sys.modules["ds4jax.pallas_kernels.paged_attention"], "on_gpu", lambda: True
    )
    q, keys, mask, sink = _case(0, 1, 2, 3, 0.5)
    pages, table = jnp.zeros((2, 2, D)), jnp.ones((1,), jnp.int32)
    with pytest.raises(NotImplementedError, match="scalar prefetch"):
        paged_attention(q, keys, mask, pages, table, jnp.ones((1,), jnp.int32), sink)


def test_kernel_lowers_to_mosaic_for_tpu() -> None:
    """Cross-lowering on CPU against an abstract TPU (no TPU needed): the scalar-prefetch
    grid, squeezed page blocks and scratch become a Mosaic custom call on V4 shapes (CSA
    and HCA pages) and odd small ones. Mosaic's own compile still needs the device."""
    S, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    try:
        dev = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    except (AttributeError, TypeError) as e:
        pytest.skip(f"no abstract TPU device in this jax: {e}")
    shapes = [(8, 64, 512, 136, 300, 64, 16), (1, 64, 512, 129, 300, 2, 64), (3, 4, 64, 9, 7, 2, 5)]
    with jax.sharding.use_abstract_mesh(mesh):
        for T, H, Dh, Kr, P, R, N in shapes:
            avals = (S((T, H, Dh), f32), S((Kr, Dh), f32), S((T, Kr), bool),
                     S((P, R, Dh), f32), S((N,), i32), S((T,), i32), S((H,), f32))  # fmt: skip
            low = jax.jit(paged_attention).trace(*avals).lower(lowering_platforms=("tpu",))
            assert "tpu_custom_call" in low.as_text()
