"""Attention with per-head sink logits over one shared key=value set (V4's MQA), masked.

Serves every dense V4 attention: the decode step (T = 1) and a prefill chunk, over the raw
sliding window plus the visible compressed rows (HCA, or CSA through a selection mask);
the caller builds the per-query visibility mask (spec §3.3: raw positions [t−W+1, t],
compressed rows c < ⌊(t+1)/r⌋). Online softmax over key blocks; the sink enters as the
initial running maximum with mass 1, so `o = Σ e^{s−m} v / (e^{sink−m} + Σ e^{s−m})` exactly.

One program owns `block_t` queries × `block_h` heads (all heads share the keys, so they
share every key load) and walks its key range in `block_k` steps. A decode step has too few
(query, head) blocks to fill a GPU, so the keys can also be cut into `num_splits` ranges run
by separate programs (flash-decoding); each writes its unnormalised (acc, max, mass) and XLA
merges them with the sink after the kernel.

Lowering: Triton on GPU (blocks rounded to powers of two, see `_common`), Mosaic TPU with
(8, 128)-aligned blocks (queries×heads on sublanes, head_dim on lanes), `interpret=True` on
CPU, where the model uses `sink_attention_reference`.
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
    gpu_programs_wanted,
    is_pow2,
    on_gpu,
    online_softmax_step,
    pow2,
    round_up,
)

NEG_INF = -jnp.inf


@dataclass(frozen=True)
class BlockSizes:
    block_t: int = 8  # queries per program (× block_h rows of work)
    block_k: int = 128  # keys per inner step
    block_h: int | None = None  # heads per program; None: all
    num_splits: int = 1  # key ranges reduced by separate programs, merged after the kernel
    num_warps: int | None = None  # Triton only
    num_stages: int | None = None  # Triton only

    def __post_init__(self) -> None:
        if min(self.block_t, self.block_k, self.block_h or 1, self.num_splits) < 1:
            raise ValueError(f"{self=}: block sizes must be positive")

    @classmethod
    def get_default(cls, T: int = 1, H: int = 1, K: int = 1) -> BlockSizes:
        if not on_gpu():
            return cls()
        # Triton, measured on an H200 (bench/results/kernels-h200-*.json): 32 heads × 32
        # fp32 keys × head_dim 512 with 8 warps beat 16 or 64 heads and 16 or 64 keys
        # (64 keys × 512 × 4 B per stage overflows shared memory once pipelined); a
        # decode step needs the key splits (T = 1, 16k keys: 3-17 ms in one range, 0.1 split)
        bh = min(pow2(H), 32)
        bt = max(1, 16 // bh)
        bk = 32
        programs = -(-T // bt) * -(-pow2(H) // bh)
        splits = max(1, min(-(-gpu_programs_wanted() // programs), -(-K // (4 * bk))))
        return cls(bt, bk, bh, splits, num_warps=8 if bt * bh >= 32 else 4, num_stages=2)


def _kernel(q_ref, k_ref, mask_ref, sink_ref, *out_refs, block_k: int, n_k: int,
            scale: float, finalize: bool):  # fmt: skip
    # q [bt, bh, D] · k [Ks, D] · mask [bt, Ks] · sink [bh]; out: o [bt, bh, D] when one
    # key range (finalize), else acc [1, bt, bh, D] · max [1, bt, bh] · mass [1, bt, bh]
    q = q_ref[...].astype(jnp.float32)
    bt, bh, D = q.shape
    rows = bt * bh
    qf = q.reshape(rows, D)
    sink = jnp.broadcast_to(sink_ref[...].astype(jnp.float32)[None, :], (bt, bh)).reshape(rows)

    def step(i, carry):
        k = k_ref[pl.ds(i * block_k, block_k), :].astype(jnp.float32)
        visible = mask_ref[:, pl.ds(i * block_k, block_k)]
        s = (dot_nt(qf, k) * scale).reshape(bt, bh, block_k)
        s = jnp.where(visible[:, None, :], s, NEG_INF).reshape(rows, block_k)
        return online_softmax_step(*carry, s, k)

    # the sink is the first "key": running max = sink; its mass is added once, at the end
    init = (sink, jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, D), jnp.float32))
    m, mass, acc = jax.lax.fori_loop(0, n_k, step, init)
    if finalize:
        (o_ref,) = out_refs
        o = acc / (mass + jnp.exp(sink - m))[:, None]
        o_ref[...] = o.reshape(bt, bh, D).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, mass_ref = out_refs
        acc_ref[...] = acc.reshape(1, bt, bh, D)
        m_ref[...] = m.reshape(1, bt, bh)
        mass_ref[...] = mass.reshape(1, bt, bh)


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
    T, H, D = q.shape
    K = keys.shape[0]
    if keys.shape[1] != D or mask.shape != (T, K) or sink.shape != (H,):
        raise ValueError(f"{q.shape=} {keys.shape=} {mask.shape=} {sink.shape=} disagree")
    bs = block_sizes or BlockSizes.get_default(T, H, K)
    triton = on_gpu() and not interpret
    if triton:
        Hp, Dp = pow2(H), pow2(D, 16)
        bh = min(bs.block_h or Hp, Hp)
        bt = max(bs.block_t, 16 // bh)
        bk = min(bs.block_k, pow2(K, 16))
        if not (is_pow2(bh) and is_pow2(bt) and is_pow2(bk)):
            raise ValueError(f"{bs}: Triton needs power-of-two blocks")
    else:
        bh = min(bs.block_h or H, H)
        Hp, Dp = round_up(H, bh), D
        bt, bk = min(bs.block_t, T), min(bs.block_k, max(K, 1))
    n_blocks = -(-max(K, 1) // bk)
    splits = min(bs.num_splits, n_blocks)
    n_k = -(-n_blocks // splits)
    splits = -(-n_blocks // n_k)
    Ks = n_k * bk  # keys per split
    Tp, Kp = round_up(T, bt), splits * Ks
    q = jnp.pad(q, ((0, Tp - T), (0, Hp - H), (0, Dp - D)))
    keys = jnp.pad(keys, ((0, Kp - K), (0, Dp - D)))
    mask = jnp.pad(mask, ((0, Tp - T), (0, Kp - K)))  # padding is never visible
    sink_p = jnp.pad(sink, (0, Hp - H))
    finalize = splits == 1
    grid = (Tp // bt, Hp // bh, splits)
    if finalize:
        out_shape = jax.ShapeDtypeStruct((Tp, Hp, Dp), q.dtype)
        out_specs = pl.BlockSpec((bt, bh, Dp), lambda i, h, s: (i, h, 0))
    else:
        f32 = jnp.float32
        out_shape = (
            jax.ShapeDtypeStruct((splits, Tp, Hp, Dp), f32),
            jax.ShapeDtypeStruct((splits, Tp, Hp), f32),
            jax.ShapeDtypeStruct((splits, Tp, Hp), f32),
        )
        out_specs = (
            pl.BlockSpec((1, bt, bh, Dp), lambda i, h, s: (s, i, h, 0)),
            pl.BlockSpec((1, bt, bh), lambda i, h, s: (s, i, h)),
            pl.BlockSpec((1, bt, bh), lambda i, h, s: (s, i, h)),
        )
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, n_k=n_k, scale=D**-0.5, finalize=finalize),
        out_shape=out_shape,
        grid=grid,
        in_specs=[
            pl.BlockSpec((bt, bh, Dp), lambda i, h, s: (i, h, 0)),
            pl.BlockSpec((Ks, Dp), lambda i, h, s: (s, 0)),
            pl.BlockSpec((bt, Ks), lambda i, h, s: (i, s)),
            pl.BlockSpec((bh,), lambda i, h, s: (h,)),
        ],
        out_specs=out_specs,
        compiler_params=compiler_params(triton, bs.num_warps, bs.num_stages),
        interpret=interpret,
    )(q, keys, mask, sink_p)
    if not finalize:  # merge the key ranges: each max is >= the sink, so all are finite
        acc, m, mass = out
        m_all = jnp.max(m, axis=0)
        w = jnp.exp(m - m_all)
        denom = jnp.exp(sink_p[None, :] - m_all) + jnp.sum(w * mass, axis=0)
        out = (jnp.sum(w[..., None] * acc, axis=0) / denom[..., None]).astype(q.dtype)
    return out[:T, :H, :D]


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
