"""The lightning indexer's scores: `score[t, c] = Σ_h w[t, h] · relu(q[t, h] · k[c])`,
−∞ where row c is not visible to query t (spec §2.5.4). Top-k over these scores stays in
XLA (`lax.top_k`), which has native TPU/GPU implementations.

Lowering: Mosaic TPU / Triton GPU with (queries, rows) tiles; `interpret=True` on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclass(frozen=True)
class BlockSizes:
    block_t: int = 8
    block_c: int = 128

    @classmethod
    def get_default(cls) -> BlockSizes:
        return cls()


def _kernel(q_ref, w_ref, k_ref, vis_ref, o_ref, *, scale: float):
    # inputs: q [bt, IH, d] · w [bt, IH] · k [bc, d] · visible [bt, bc]; output [bt, bc]
    q = q_ref[...].astype(jnp.float32)
    bt, IH, d = q.shape
    k = k_ref[...].astype(jnp.float32)
    s = jnp.maximum(jnp.dot(q.reshape(bt * IH, d), k.T), 0.0).reshape(bt, IH, -1) * scale
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
    bs = block_sizes or BlockSizes.get_default()
    T, IH, d = q.shape
    C = rows.shape[0]
    if w.shape != (T, IH) or rows.shape[1] != d or visible.shape != (T, C):
        raise ValueError(f"{q.shape=} {w.shape=} {rows.shape=} {visible.shape=} disagree")
    bt, bc = min(bs.block_t, T), min(bs.block_c, C)
    Tp, Cp = pl.cdiv(T, bt) * bt, pl.cdiv(C, bc) * bc
    q = jnp.pad(q, ((0, Tp - T), (0, 0), (0, 0)))
    w = jnp.pad(w, ((0, Tp - T), (0, 0)))
    rows = jnp.pad(rows, ((0, Cp - C), (0, 0)))
    visible = jnp.pad(visible, ((0, Tp - T), (0, Cp - C)))
    out = pl.pallas_call(
        functools.partial(_kernel, scale=d**-0.5),
        out_shape=jax.ShapeDtypeStruct((Tp, Cp), jnp.float32),
        grid=(Tp // bt, Cp // bc),
        in_specs=[
            pl.BlockSpec((bt, IH, d), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((bt, IH), lambda i, j: (i, 0)),
            pl.BlockSpec((bc, d), lambda i, j: (j, 0)),
            pl.BlockSpec((bt, bc), lambda i, j: (i, j)),
        ],
        out_specs=pl.BlockSpec((bt, bc), lambda i, j: (i, j)),
        interpret=interpret,
    )(q, w, rows, visible)
    return out[:T, :C]


def indexer_scores_reference(
    q: jax.Array, w: jax.Array, rows: jax.Array, visible: jax.Array
) -> jax.Array:
    d = q.shape[-1]
    s = jax.nn.relu(jnp.einsum("thd,cd->thc", q, rows)) * d**-0.5
    return jnp.where(visible, jnp.einsum("th,thc->tc", w, s), -jnp.inf)
