"""The model's only jitted entry points: `forward_chunk`, and `prefill` / `decode_step`
built on it.

`forward_chunk` evaluates a chunk of a static size (padded; `n_valid` real tokens) on top
of a state and returns a new state; the input state is untouched, so a retained state can
be continued any number of times. Prefill splits a prompt into chunks from the fixed set
`CHUNK_SIZES`, so a new prompt length never compiles a new program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax import native
from ds4jax.config import Config
from ds4jax.model.layers import attention, hc_head, hc_post, hc_pre, linear, moe, rmsw
from ds4jax.model.params import Params
from ds4jax.model.quantized import dense, dequantize
from ds4jax.model.state import DecodeState

CHUNK_SIZES: tuple[int, ...] = (16, 64, 256, 512)


@partial(jax.jit, static_argnames=("cfg", "all_logits", "streams"))
def forward_chunk(
    params: Params,
    state: DecodeState,
    tokens: jax.Array,
    n_valid: jax.Array,
    *,
    cfg: Config,
    all_logits: bool = False,
    streams: bool = False,
) -> tuple[DecodeState, jax.Array] | tuple[DecodeState, jax.Array, jax.Array]:
    """Evaluate `tokens[:n_valid]` at positions state.pos…; returns (new state, logits):
    logits [T, vocab] for every chunk position when `all_logits`, else the next-token
    logits [vocab] (also stored in the state). `streams`: also the hyper-connection
    streams after the last layer [T, hc, D] (what the MTP block reads, `mtp_chunk`)."""
    T = tokens.shape[0]
    n = state.pos
    n_valid = jnp.asarray(n_valid, jnp.int32)
    positions = n + jnp.arange(T, dtype=jnp.int32)

    def attend(i: int, p: Params, ls: Any, y: jax.Array) -> tuple[jax.Array, Any]:
        return attention(cfg, i, p, ls, y, positions, n, n_valid)

    X, layers = run_layers(params, cfg, tokens, state.layers, attend)

    def head(Xs: jax.Array) -> jax.Array:
        return logits_of(params, cfg, Xs)

    if all_logits:
        logits = head(X)
        last = jnp.take(logits, n_valid - 1, axis=0)
    else:
        last = head(jax.lax.dynamic_slice_in_dim(X, n_valid - 1, 1))[0]
        logits = last
    new = DecodeState(layers=tuple(layers), pos=n + n_valid, logits=last.astype(jnp.float32))
    return (new, logits, X) if streams else (new, logits)


#: the routed experts' keys in a layer's `ffn` params: expanded one expert at a time
EXPERT_KEYS = frozenset({"w1", "w2", "w3"})


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """The tokens' embedding rows in f32; a bf16 table (`--weights fp4-experts`) on CPU
    through `native.rows` (XLA:CPU converts the whole table to gather from it, and inside
    a burst's loop hoists that convert out of it: 265 MB written per burst)."""
    table = params["embed"]
    if native.active() and native.rows_supported(table, tokens):
        return native.rows(table, tokens)
    return table[tokens].astype(jnp.float32)


def run_layers(
    params: Params,
    cfg: Config,
    tokens: jax.Array,
    layer_states: Sequence[Any],
    attend: Callable[[int, Params, Any, jax.Array], tuple[jax.Array, Any]],
    rows: bool = False,
) -> tuple[jax.Array, list[Any]]:
    """Embedding and every layer for tokens [T]: hyper-connections, attention through
    `attend(layer, attn params, layer state, normed input [T, D])` — one sequence's chunk
    here, one token of each of T sessions in `model.batch` (`rows`) — and the MoE, which
    sees the T tokens together either way. Returns (hyper-connection streams [T, hc, D],
    new states)."""
    T = tokens.shape[0]
    x = embed(params, tokens)
    X = jnp.broadcast_to(x[:, None, :], (T, cfg.hc_mult, cfg.hidden_size))
    layers = []
    for i, (lp, ls) in enumerate(zip(params["layers"], layer_states, strict=True)):
        X, ls = block(cfg, i, lp, ls, X, tokens, attend, rows)
        layers.append(ls)
    return X, layers


def block(cfg: Config, i: int, lp: Params, ls: Any, X: jax.Array, tokens: jax.Array,
          attend: Callable[[int, Params, Any, jax.Array], tuple[jax.Array, Any]],
          rows: bool = False) -> tuple[jax.Array, Any]:  # fmt: skip
    """Layer `i` (§2.4–2.7): attention, then the MoE, each between its hyper-connection
    mixes; (streams [T, hc, D] after it, its new state)."""
    y, post, comb = hc_pre(cfg, X, lp["hc_attn_fn"], lp["hc_attn_scale"], lp["hc_attn_base"])
    # resident FP8 weights are expanded here, a layer at a time; FP4 experts one by one
    a, ls = attend(i, dense(lp["attn"]), ls, rmsw(y, lp["attn_norm"], cfg.rms_eps))
    X = hc_post(a, X, post, comb)
    y, post, comb = hc_pre(cfg, X, lp["hc_ffn_fn"], lp["hc_ffn_scale"], lp["hc_ffn_base"])
    f = moe(cfg, dense(lp["ffn"], keep=EXPERT_KEYS), rmsw(y, lp["ffn_norm"], cfg.rms_eps),
            tokens, cfg.hash_layers[i], rows)  # fmt: skip
    return hc_post(f, X, post, comb), ls


@partial(jax.jit, static_argnames=("cfg", "depth"))
def mtp_chunk(
    params: Params,
    H: jax.Array,
    tokens: jax.Array,
    state: Any,
    n: jax.Array,
    n_valid: jax.Array,
    *,
    cfg: Config,
    depth: int = 0,
) -> tuple[jax.Array, jax.Array, Any]:
    """The multi-token-prediction block `mtp.{depth}` (§2.9) over a chunk at positions
    n…: `H` [T, hc, D], the streams after the model's last layer (before its `hc_head`)
    at those positions, and `tokens` [T], the token after each, give the draft logits
    [T, vocab] for the position after that token. Input: `e_proj(enorm(embed(token)))`
    added to every stream of `h_proj(hnorm(H))`; then one block as a sliding-window layer
    (`Config.mtp_block`) over its own window `state` (a `LayerState` of that config, which
    rewinds as the model's does), its own `hc_head` and `norm`, and the model's head.
    Returns (logits, the block's streams — a second draft chains on them — and the new
    window state)."""
    mcfg = cfg.mtp_block()
    T = tokens.shape[0]
    n = jnp.asarray(n, jnp.int32)
    n_valid = jnp.asarray(n_valid, jnp.int32)
    positions = n + jnp.arange(T, dtype=jnp.int32)

    def attend(i: int, p: Params, ls: Any, y: jax.Array) -> tuple[jax.Array, Any]:
        return attention(mcfg, i, p, ls, y, positions, n, n_valid)

    return mtp_forward(params, H, tokens, state, attend, cfg, depth)


def mtp_forward(params: Params, H: jax.Array, tokens: jax.Array, state: Any,
                attend: Callable[[int, Params, Any, jax.Array], tuple[jax.Array, Any]],
                cfg: Config, depth: int = 0, rows: bool = False,
                pick: Callable[[jax.Array], jax.Array] | None = None,
                ) -> tuple[jax.Array, jax.Array, Any]:  # fmt: skip
    """`mtp_chunk` with its attention given: one sequence's chunk there, T tokens of each
    of B rows in a batched speculative step (`model.speculative`, `rows`). `pick`: the
    streams the head runs on, of the block's (the positions a draft is read from: the
    head is the block's largest weight)."""
    mcfg, mp = cfg.mtp_block(), params["mtp"][depth]
    e = rmsw(embed(params, tokens), mp["enorm"], cfg.rms_eps)
    X = linear(e, mp["e_proj"])[:, None, :] + linear(rmsw(H, mp["hnorm"], cfg.rms_eps),
                                                     mp["h_proj"])  # fmt: skip
    X, state = block(mcfg, 0, mp, state, X, tokens, attend, rows)
    head = {"head": params["head"]} | {
        k: mp[k] for k in ("norm", "hc_head_fn", "hc_head_base", "hc_head_scale")
    }
    return logits_of(head, cfg, X if pick is None else pick(X)), X, state


#: the batched decode steps' row counts (`model.batch.BATCH_SIZES` past 1, plus the one
#: row of a prompt chunk riding in a mixed step) whose head is a multiply-and-reduce on CPU:
#: measured side by side (both programs in one process, steps alternated, two runs), a
#: bench-192m step at B=4 took 21.7 / 28.6 ms against 26.1 / 33.5 with the GEMM, B=8
#: 44.3 / 38.1 against 51.5 / 43.8; one row's GEMV already reads the weight once, and
#: longer chunks are compute-bound GEMMs
HEAD_REDUCE_ROWS = 9


def logits_of(params: Params, cfg: Config, X: jax.Array) -> jax.Array:
    """The head: hyper-connection streams [T, hc, D] → logits [T, vocab]."""
    h = rmsw(hc_head(cfg, X, params), params["norm"], cfg.rms_eps)
    gemv = native.active() and native.gemv_supported(h, params["head"])  # `linear` takes it
    if not gemv and jax.default_backend() == "cpu" and 2 <= h.shape[0] <= HEAD_REDUCE_ROWS:
        # one multiply-and-reduce over the weight, read once in place: XLA:CPU runs this
        # product as a GEMM that packs the whole head weight on every step (issue 27). Same
        # products, summed in another order.
        w = dequantize(params["head"], h.dtype)
        return jnp.sum(w[:, None, :] * h[None, :, :], axis=-1).T
    return linear(h, params["head"])


def plan_chunks(n: int, sizes: Sequence[int] = CHUNK_SIZES) -> list[tuple[int, int]]:
    """[(chunk size, valid tokens)]: full chunks of the largest size, then the smallest size
    that holds the rest (padded)."""
    sizes = sorted(sizes)
    out: list[tuple[int, int]] = []
    while n >= sizes[-1]:
        out.append((sizes[-1], sizes[-1]))
        n -= sizes[-1]
    if n:
        out.append((next(s for s in sizes if s >= n), n))
    return out


def prefill(
    params: Params,
    state: DecodeState,
    tokens: Sequence[int] | np.ndarray,
    cfg: Config,
    *,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    all_logits: bool = False,
    progress: Callable[[int, int], None] | None = None,
    streams: bool = False,
) -> tuple[DecodeState, jax.Array] | tuple[DecodeState, jax.Array, jax.Array]:
    """Evaluate `tokens` after `state`; returns (state, logits) with logits [N, vocab] when
    `all_logits`, else the next-token logits. `progress(done, total)` after each chunk.
    `streams`: the last layer's streams [N, hc, D] too (what the MTP block reads)."""
    toks = np.asarray(tokens, dtype=np.int32)
    if toks.size == 0:
        raise ValueError("prefill needs at least one token")
    outs, kept = [], []
    done = 0
    for size, valid in plan_chunks(len(toks), chunk_sizes):
        chunk = np.zeros(size, np.int32)
        chunk[:valid] = toks[done : done + valid]
        out = forward_chunk(params, state, jnp.asarray(chunk), valid, cfg=cfg,
                            all_logits=all_logits, streams=streams)  # fmt: skip
        state = out[0]
        if all_logits:
            outs.append(out[1][:valid])
        if streams:
            kept.append(out[2][:valid])
        done += valid
        if progress is not None:
            progress(done, len(toks))
    result = (state, jnp.concatenate(outs) if all_logits else state.logits)
    return (*result, jnp.concatenate(kept)) if streams else result


def decode_step(
    params: Params, state: DecodeState, token: int | jax.Array, cfg: Config
) -> DecodeState:
    """Evaluate one token; the new state's `logits` are the next distribution."""
    state, _ = forward_chunk(params, state, jnp.asarray([token], jnp.int32).reshape(1), 1, cfg=cfg)
    return state
