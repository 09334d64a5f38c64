"""CSA sparse attention: each query attends to the raw window (a mask over shared keys) plus
its own top-k compressed rows, gathered inside the kernel from the row table by index, with
per-head sinks and one online softmax over both parts.

This is the long-context path: the selected rows are gathered per query instead of scoring
every compressed row (at 1M tokens a CSA layer has 262k rows and each query reads 512).

Lowering: the indices are scalar-prefetch data on TPU (row DMA per index) and a gather in
Triton on GPU; `interpret=True` on CPU, where the model uses the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG_INF = -jnp.inf


def _kernel(q_ref, k_ref, mask_ref, rows_ref, idx_ref, valid_ref, sink_ref, o_ref, *, scale):
    # inputs: q [1, H, D] · raw keys [Kr, D] · raw mask [1, Kr] · rows [C, D] ·
    #         idx [1, k] · valid [1, k] · sink [H]; output: o [1, H, D]
    q = q_ref[0].astype(jnp.float32)  # [H, D]
    sink = sink_ref[...].astype(jnp.float32)
    keys = k_ref[...].astype(jnp.float32)
    s = jnp.where(mask_ref[0][None, :], jnp.dot(q, keys.T) * scale, NEG_INF)  # [H, Kr]
    m = jnp.maximum(sink, jnp.max(s, axis=-1))
    p = jnp.exp(s - m[:, None])
    mass = jnp.exp(sink - m) + jnp.sum(p, axis=-1)
    acc = jnp.dot(p, keys)

    def gather(j, carry):
        m, mass, acc = carry
        row = rows_ref[pl.ds(idx_ref[0, j], 1), :].astype(jnp.float32)  # [1, D]
        sj = jnp.where(valid_ref[0, j], (q @ row.T)[:, 0] * scale, NEG_INF)  # [H]
        m_new = jnp.maximum(m, sj)
        alpha = jnp.exp(m - m_new)
        pj = jnp.exp(sj - m_new)
        return m_new, mass * alpha + pj, acc * alpha[:, None] + pj[:, None] * row

    _, mass, acc = jax.lax.fori_loop(0, idx_ref.shape[1], gather, (m, mass, acc))
    o_ref[0] = (acc / mass[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def sparse_attention(
    q: jax.Array,
    keys: jax.Array,
    mask: jax.Array,
    rows: jax.Array,
    idx: jax.Array,
    valid: jax.Array,
    sink: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """q [T,H,D]; raw keys [Kr,D] with mask [T,Kr]; compressed rows [C,D] with per-query
    picks idx [T,k] (int32) and valid [T,k]; sink [H] → [T,H,D]."""
    T, H, D = q.shape
    Kr, C = keys.shape[0], rows.shape[0]
    k = idx.shape[1]
    if mask.shape != (T, Kr) or valid.shape != (T, k) or rows.shape[1] != D:
        raise ValueError(f"{q.shape=} {keys.shape=} {mask.shape=} {rows.shape=} {idx.shape=}")
    idx = jnp.clip(idx.astype(jnp.int32), 0, C - 1)
    return pl.pallas_call(
        functools.partial(_kernel, scale=D**-0.5),
        out_shape=jax.ShapeDtypeStruct((T, H, D), q.dtype),
        grid=(T,),
        in_specs=[
            pl.BlockSpec((1, H, D), lambda t: (t, 0, 0)),
            pl.BlockSpec((Kr, D), lambda t: (0, 0)),
            pl.BlockSpec((1, Kr), lambda t: (t, 0)),
            pl.BlockSpec((C, D), lambda t: (0, 0)),
            pl.BlockSpec((1, k), lambda t: (t, 0)),
            pl.BlockSpec((1, k), lambda t: (t, 0)),
            pl.BlockSpec((H,), lambda t: (0,)),
        ],
        out_specs=pl.BlockSpec((1, H, D), lambda t: (t, 0, 0)),
        interpret=interpret,
    )(q, keys, mask, rows, idx, valid, sink)


def sparse_attention_reference(
    q: jax.Array,
    keys: jax.Array,
    mask: jax.Array,
    rows: jax.Array,
    idx: jax.Array,
    valid: jax.Array,
    sink: jax.Array,
) -> jax.Array:
    D = q.shape[-1]
    sel = rows[idx]  # [T, k, D]
    s_raw = jnp.where(mask[:, None, :], jnp.einsum("thd,kd->thk", q, keys) * D**-0.5, NEG_INF)
    s_sel = jnp.where(valid[:, None, :], jnp.einsum("thd,tkd->thk", q, sel) * D**-0.5, NEG_INF)
    m = jnp.maximum(jnp.maximum(s_raw.max(-1), s_sel.max(-1)), sink[None, :])
    e_raw, e_sel = jnp.exp(s_raw - m[..., None]), jnp.exp(s_sel - m[..., None])
    denom = jnp.exp(sink[None, :] - m) + e_raw.sum(-1) + e_sel.sum(-1)
    o = jnp.einsum("thk,kd->thd", e_raw, keys) + jnp.einsum("thk,tkd->thd", e_sel, sel)
    return o / denom[..., None]
