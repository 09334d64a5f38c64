"""Quantization-simulation primitives of the official V4 graph (spec §2.1).

They are part of the model as trained and served by DeepSeek: the attention KV is stored
as FP8 E4M3 with power-of-two block scales, and the indexer works on Hadamard-rotated FP4
E2M1 values. `Config.quant_sim` turns them off to compare with transformers, which has
neither. Pure jnp, elementwise; exact round-to-nearest-even on the target grids.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def _pow2_ceil_scale(amax: jnp.ndarray, qmax: float) -> jnp.ndarray:
    return jnp.exp2(jnp.ceil(jnp.log2(amax / qmax)))


def fp8_e4m3_round(x: jnp.ndarray) -> jnp.ndarray:
    """Nearest E4M3fn value (max 448, ties to even), through ml_dtypes' exact cast."""
    return x.astype(jnp.float8_e4m3fn).astype(x.dtype)


def fp8sim(x: jnp.ndarray, block: int = 64) -> jnp.ndarray:
    """Blocks of `block` along the last axis: s = 2^ceil(log2(max(|b|,1e-4)/448)),
    x ← E4M3(clamp(x/s, ±448))·s. A trailing partial block (small test configs only; V4's
    448 channels are 7 blocks) is its own block: zero padding cannot change its amax."""
    return fp8_decode(*fp8_encode(x, block), block).astype(x.dtype)


#: the UE8M0 byte of a scale 2^e is e + 127 (the release's E8M0 exponent bias)
E8M0_BIAS = 127


def fp8_encode(x: jnp.ndarray, block: int = 64) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`fp8sim`'s values as the release stores them: E4M3 codes (`x`'s shape) and one UE8M0
    byte per block of the last axis (`[..., ceil(n / block)]`), the scale's exponent."""
    shape = x.shape
    pad = -shape[-1] % block
    if pad:
        x = jnp.concatenate([x, jnp.zeros((*shape[:-1], pad), x.dtype)], axis=-1)
    xb = x.reshape(*shape[:-1], x.shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 1e-4)
    e = jnp.ceil(jnp.log2(amax / 448.0))
    codes = jnp.clip(xb / jnp.exp2(e), -448.0, 448.0).astype(jnp.float8_e4m3fn)
    exps = (e[..., 0] + E8M0_BIAS).astype(jnp.uint8)
    return codes.reshape(*shape[:-1], -1)[..., : shape[-1]], exps


def fp8_decode(codes: jnp.ndarray, exps: jnp.ndarray, block: int = 64) -> jnp.ndarray:
    """The float32 values of `fp8_encode`'s codes and scale bytes (exact: a code times a
    power of two)."""
    shape = codes.shape
    q = codes.astype(jnp.float32)
    pad = -shape[-1] % block
    if pad:
        q = jnp.concatenate([q, jnp.zeros((*shape[:-1], pad), q.dtype)], axis=-1)
    qb = q.reshape(*shape[:-1], q.shape[-1] // block, block)
    s = jnp.exp2(exps.astype(jnp.float32) - E8M0_BIAS)[..., None]
    return (qb * s).reshape(*shape[:-1], -1)[..., : shape[-1]]


def hadamard(x: jnp.ndarray) -> jnp.ndarray:
    """Walsh–Hadamard transform in natural (Sylvester) order along the last axis, scaled by
    1/sqrt(n): butterflies (a, b) → (a+b, a−b) with strides 1, 2, …, n/2."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        h *= 2
    return x * (1.0 / np.sqrt(n))


def fp4_e2m1_round(x: jnp.ndarray) -> jnp.ndarray:
    """Nearest E2M1 magnitude in {0,.5,1,1.5,2,3,4,6} with ties to even mantissa."""
    a = jnp.abs(x)
    grid = jnp.asarray(_E2M1, dtype=x.dtype)
    # midpoints between consecutive grid values; a tie goes to the value with even code
    # (codes 0,2,4,6 ↔ 0, 1, 2, 4), i.e. down at .25, 1.25, 2.5, 5 and up at .75, 1.75, 3.5.
    mids = (grid[1:] + grid[:-1]) / 2
    idx = jnp.sum(a[..., None] > mids, axis=-1)
    tie = jnp.any(a[..., None] == mids, axis=-1)
    tie_idx = jnp.sum(a[..., None] >= mids, axis=-1)  # the upper neighbour
    up_is_even = (tie_idx % 2) == 0
    idx = jnp.where(tie & up_is_even, tie_idx, idx)
    return jnp.sign(x) * grid[idx]


def idxq(x: jnp.ndarray, block: int = 32) -> jnp.ndarray:
    """Indexer QAT: Hadamard over the last axis, then FP4 in blocks of `block` with
    s = 2^ceil(log2(max(|b|, 7.05e-38)/6))."""
    x = hadamard(x)
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1, keepdims=True), 7.052966104933725e-38)
    s = _pow2_ceil_scale(amax, 6.0)
    q = fp4_e2m1_round(jnp.clip(xb / s, -6.0, 6.0)) * s
    return q.reshape(shape)
