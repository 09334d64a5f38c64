"""Attention with per-head sink logits over one shared key=value set (V4's MQA), masked.

Serves every dense V4 attention: the decode step (T = 1) and a prefill chunk, over the raw
sliding window plus the visible compressed rows (HCA, or CSA through a selection mask);
the caller builds the per-query visibility mask (spec §3.3: raw positions [t−W+1, t],
compressed rows c < ⌊(t+1)/r⌋). Online softmax over key blocks; the sink enters as the
initial running maximum with mass 1, so `o = Σ e^{s−m} v / (e^{sink−m} + Σ e^{s−m})` exactly.

Lowering: written for the Mosaic TPU / Triton GPU backends with (8, 128)-aligned blocks
(queries×heads on sublanes, head_dim on lanes); on CPU it runs with `interpret=True` only,
and the model uses `sink_attention_reference` there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

NEG_INF = -jnp.inf


@dataclass(frozen=True)
class BlockSizes:
    block_t: int = 8  # queries per program (× heads rows of work)
    block_k: int = 128  # keys per inner step

    def __post_init__(self) -> None:
        if self.block_t < 1 or self.block_k < 1:
            raise ValueError(f"{self=}: block sizes must be positive")

    @classmethod
    def get_default(cls) -> BlockSizes:
        return cls()


def _kernel(q_ref, k_ref, mask_ref, sink_ref, o_ref, *, block_k: int, n_k: int, scale: float):
    # inputs: q [bt, H, D] · k [Kp, D] · mask [bt, Kp] · sink [H]; output: o [bt, H, D]
    q = q_ref[...].astype(jnp.float32)
    bt, H, D = q.shape
    qf = q.reshape(bt * H, D)
    sink = sink_ref[...].astype(jnp.float32)
    m0 = jnp.tile(sink, bt)  # the sink is the first "key": running max = sink, mass 1
    l0 = jnp.ones_like(m0)
    acc0 = jnp.zeros((bt * H, D), jnp.float32)

    def step(i, carry):
        m, mass, acc = carry
        k = k_ref[pl.ds(i * block_k, block_k), :].astype(jnp.float32)
        visible = mask_ref[:, pl.ds(i * block_k, block_k)]
        s = jnp.dot(qf, k.T) * scale
        s = jnp.where(jnp.repeat(visible, H, axis=0), s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        return m_new, mass * alpha + jnp.sum(p, axis=-1), acc * alpha[:, None] + jnp.dot(p, k)

    _, mass, acc = jax.lax.fori_loop(0, n_k, step, (m0, l0, acc0))
    o_ref[...] = (acc / mass[:, None]).reshape(bt, H, D).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def sink_attention(
    q: jax.Array,
    keys: jax.Array,
    mask: jax.Array,
    sink: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q [T, H, D], keys [K, D] (K = V), mask [T, K] bool, sink [H] → [T, H, D]."""
    bs = block_sizes or BlockSizes.get_default()
    T, H, D = q.shape
    K = keys.shape[0]
    if keys.shape[1] != D or mask.shape != (T, K) or sink.shape != (H,):
        raise ValueError(f"{q.shape=} {keys.shape=} {mask.shape=} {sink.shape=} disagree")
    bt = min(bs.block_t, T)
    bk = min(bs.block_k, max(K, 1))
    Tp, Kp = pl.cdiv(T, bt) * bt, pl.cdiv(max(K, 1), bk) * bk
    q = jnp.pad(q, ((0, Tp - T), (0, 0), (0, 0)))
    keys = jnp.pad(keys, ((0, Kp - K), (0, 0)))
    mask = jnp.pad(mask, ((0, Tp - T), (0, Kp - K)))  # padding is never visible
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, n_k=Kp // bk, scale=D**-0.5),
        out_shape=jax.ShapeDtypeStruct((Tp, H, D), q.dtype),
        grid=(Tp // bt,),
        in_specs=[
            pl.BlockSpec((bt, H, D), lambda i: (i, 0, 0)),
            pl.BlockSpec((Kp, D), lambda i: (0, 0)),
            pl.BlockSpec((bt, Kp), lambda i: (i, 0)),
            pl.BlockSpec((H,), lambda i: (0,)),
        ],
        out_specs=pl.BlockSpec((bt, H, D), lambda i: (i, 0, 0)),
        interpret=interpret,
    )(q, keys, mask, sink)
    return out[:T]


def sink_attention_reference(
    q: jax.Array, keys: jax.Array, mask: jax.Array, sink: jax.Array
) -> jax.Array:
    """The jnp twin (and the CPU path): same signature, dense scores."""
    D = q.shape[-1]
    s = jnp.einsum("thd,kd->thk", q, keys) * D**-0.5
    s = jnp.where(mask[:, None, :], s, NEG_INF)
    m = jnp.maximum(jnp.max(s, axis=-1), sink[None, :])
    e = jnp.exp(s - m[..., None])
    denom = jnp.exp(sink[None, :] - m) + jnp.sum(e, axis=-1)
    return jnp.einsum("thk,kd->thd", e, keys) / denom[..., None]
