"""The lightning indexer's scores: `score[t, c] = Σ_h w[t, h] · relu(q[t, h] · k[c])`,
−∞ where row c is not visible to query t (spec §2.5.4). Top-k over these scores stays in
XLA (`lax.top_k`), which has native TPU/GPU implementations.

One program scores `block_t` queries (all index heads) against `block_c` rows: one
[block_t·IH, d] × [d, block_c] dot, then the weighted sum over heads.

Lowering: Triton on GPU (index heads, head dim and blocks rounded to powers of two, see
`_common`), Mosaic TPU with (queries, rows) tiles, `interpret=True` on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ds4jax.pallas_kernels._common import (
    compiler_params,
    dot_nt,
    is_pow2,
    on_gpu,
    pow2,
    round_up,
)


@dataclass(frozen=True)
class BlockSizes:
    block_t: int = 8
    block_c: int = 128
    num_warps: int | None = None  # Triton only
    num_stages: int | None = None  # Triton only

    @classmethod
    def get_default(cls, T: int = 1) -> BlockSizes:
        if not on_gpu():
            return cls()
        # Triton, measured on an H200: a decode step wants wide row blocks (fewer programs
        # per query), a prefill chunk two queries × 64 rows ([128, 64] fp32 score tiles)
        if T < 8:
            return cls(block_t=1, block_c=128, num_warps=8, num_stages=2)
        return cls(block_t=2, block_c=64, num_warps=8, num_stages=2)


def _kernel(q_ref, w_ref, k_ref, vis_ref, o_ref, *, scale: float):
    # inputs: q [bt, IH, d] · w [bt, IH] · k [bc, d] · visible [bt, bc]; output [bt, bc]
    q = q_ref[...].astype(jnp.float32)
    bt, IH, d = q.shape
    k = k_ref[...].astype(jnp.float32)
    s = jnp.maximum(dot_nt(q.reshape(bt * IH, d), k), 0.0).reshape(bt, IH, -1) * scale
    score = jnp.sum(s * w_ref[...].astype(jnp.float32)[:, :, None], axis=1)
    o_ref[...] = jnp.where(vis_ref[...], score, -jnp.inf).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def indexer_scores(
    q: jax.Array,
    w: jax.Array,
    rows: jax.Array,
    visible: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q [T, IH, d], w [T, IH], rows [C, d], visible [T, C] bool → scores [T, C]."""
    T, IH, d = q.shape
    bs = block_sizes or BlockSizes.get_default(T)
    C = rows.shape[0]
    if w.shape != (T, IH) or rows.shape[1] != d or visible.shape != (T, C):
        raise ValueError(f"{q.shape=} {w.shape=} {rows.shape=} {visible.shape=} disagree")
    if on_gpu() and not interpret:
        IHp, dp = pow2(IH), pow2(d, 16)  # zero heads and dims add nothing
        bt = max(bs.block_t, pow2(-(-16 // IHp)))
        bc = min(bs.block_c, pow2(C, 16))
        if not (is_pow2(bt) and is_pow2(bc)):
            raise ValueError(f"{bs}: Triton needs power-of-two blocks")
        triton = True
    else:
        IHp, dp, triton = IH, d, False
        bt, bc = min(bs.block_t, T), min(bs.block_c, C)
    Tp, Cp = round_up(T, bt), round_up(C, bc)
    q = jnp.pad(q, ((0, Tp - T), (0, IHp - IH), (0, dp - d)))
    w = jnp.pad(w, ((0, Tp - T), (0, IHp - IH)))
    rows = jnp.pad(rows, ((0, Cp - C), (0, dp - d)))
    visible = jnp.pad(visible, ((0, Tp - T), (0, Cp - C)))
    out = pl.pallas_call(
        functools.partial(_kernel, scale=d**-0.5),
        out_shape=jax.ShapeDtypeStruct((Tp, Cp), jnp.float32),
        grid=(Tp // bt, Cp // bc),
        in_specs=[
            pl.BlockSpec((bt, IHp, dp), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((bt, IHp), lambda i, j: (i, 0)),
            pl.BlockSpec((bc, dp), lambda i, j: (j, 0)),
            pl.BlockSpec((bt, bc), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((bt, bc), lambda i, j: (i, j)),
        compiler_params=compiler_params(triton, bs.num_warps, bs.num_stages),
        interpret=interpret,
    )(q, w, rows, visible)
    return out[:T, :C]


def indexer_scores_reference(
    q: jax.Array, w: jax.Array, rows: jax.Array, visible: jax.Array
) -> jax.Array:
    d = q.shape[-1]
    s = jax.nn.relu(jnp.einsum("thd,cd->thc", q, rows)) * d**-0.5
    return jnp.where(visible, jnp.einsum("th,thc->tc", w, s), -jnp.inf)
