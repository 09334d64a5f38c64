"""The compressor (`model.layers.compress`): a decode step's short chunk reads its windows
back from the rings it just wrote, and a batched step pools only when some row completes a
window (`emit`); both emit exactly the rows a long chunk does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model.layers import compress
from ds4jax.model.state import REWIND

DIM, LEN = 8, 40


def feed(kv, sc, r: int, c: int, chunk: int, emit=None, finish=lambda p, _: p):
    """Feed positions 0 … LEN − 1 in chunks of `chunk` (the last one padded, its tail
    invalid); `emit(n, n_valid)` → the step's emit flag (None: always pool)."""
    size = c * r + REWIND
    st_kv = jnp.zeros((size, c * DIM))
    st_sc = jnp.full((size, c * DIM), -jnp.inf)
    rows = jnp.zeros((LEN // r + 1, DIM))
    step = jax.jit(lambda *a, e: compress(*a, ratio=r, lanes=c, dim=DIM, finish=finish, emit=e))
    for n in range(0, LEN, chunk):
        valid = min(chunk, LEN - n)
        part_kv, part_sc = (jnp.zeros((chunk, x.shape[1])).at[:valid].set(x[n : n + valid])
                            for x in (kv, sc))  # fmt: skip
        e = None if emit is None else jnp.bool_(emit(n, valid))
        rows, st_kv, st_sc = step(part_kv, part_sc, st_kv, st_sc, rows, jnp.int32(n),
                                  jnp.int32(valid), e=e)  # fmt: skip
    return np.asarray(rows)


@pytest.mark.parametrize("r,c", [(4, 2), (8, 1)])
def test_short_chunks_and_skipped_pooling_emit_what_one_long_chunk_does(r, c) -> None:
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((LEN, c * DIM), np.float32))
    sc = jnp.asarray(rng.standard_normal((LEN, c * DIM), np.float32))
    want = feed(kv, sc, r, c, chunk=16)  # longer than REWIND + 1: the buffer path
    assert np.abs(want[: LEN // r]).min() > 0  # every complete window was emitted
    completes = lambda n, v: (n + v) // r > n // r  # noqa: E731  (row_attention's emits)
    for chunk in (1, 3, REWIND + 1):
        np.testing.assert_allclose(feed(kv, sc, r, c, chunk), want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(feed(kv, sc, r, c, chunk, completes), want, rtol=1e-6,
                                   atol=1e-6)  # fmt: skip
    # emit is honoured: a step told no window completes stores nothing
    never = feed(kv, sc, r, c, 1, lambda n, v: False)
    assert not never.any()
