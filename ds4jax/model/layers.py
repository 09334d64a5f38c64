"""DeepSeek V4 building blocks as pure functions over one chunk of T tokens (spec §2).

Every function takes the chunk's absolute positions and its valid length, so the same code
serves a padded prefill chunk and a one-token decode step: a decode step *is* a chunk of
one. Weights are stored `[out, in]` as in the checkpoints. All math is float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax import native, pallas_kernels
from ds4jax.config import Config
from ds4jax.model import quant_sim
from ds4jax.model.pages import decode_index_rows, decode_rows, encode_index_rows, encode_rows
from ds4jax.model.quantized import QWeight, dequantize, expert, matmul
from ds4jax.model.rope import apply_rope, inv_freqs
from ds4jax.model.sharding import expert_parallel
from ds4jax.model.state import LayerState

Params = dict[str, Any]
NEG_INF = -jnp.inf


def linear(x: jax.Array, w: Any) -> jax.Array:
    """x @ wᵀ; a resident FP8/FP4 weight (`model.quantized`) is expanded here, at its use.
    A decode step's few tokens on CPU take the native GEMV (`native.gemv`)."""
    if native.active() and native.gemv_supported(x, w):
        return native.gemv(x, w)
    return matmul(x, w)


def linears(x: jax.Array, *ws: Any) -> list[jax.Array]:
    """`[linear(x, w) for w in ws]`: a decode step's projections of one input as one native
    call (`native.gemv_many`), the same products."""
    if native.active() and native.gemv_many_supported(x, ws):
        return native.gemv_many(x, ws)
    return [linear(x, w) for w in ws]


def rms(x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def rmsw(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return rms(x, eps) * w


# ---------------------------------------------------------------- hyper-connections §2.4


def hc_pre(
    cfg: Config, X: jax.Array, fn: jax.Array, scale: jax.Array, base: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """X: [T, hc, D] → (sublayer input y [T, D], post [T, hc], comb C [T, hc, hc])."""
    T, hc, D = X.shape
    m = linear(rms(X.reshape(T, hc * D), cfg.rms_eps), fn)
    pre = jax.nn.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2.0 * jax.nn.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(T, hc, hc)
    comb = jax.nn.softmax(comb, axis=-1) + cfg.hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + cfg.hc_eps)

    def sinkhorn_step(_: int, c: jax.Array) -> jax.Array:
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + cfg.hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + cfg.hc_eps)

    # a loop, not an unrolled Python for: 20 unrolled iterations × 2 sites × layers
    # doubled XLA compile time for identical numerics
    comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn_step, comb)
    y = jnp.einsum("th,thd->td", pre, X)
    return y, post, comb


def hc_post(f: jax.Array, X: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'[b] = post_b·f + Σ_a C[a, b]·X[a]."""
    return post[:, :, None] * f[:, None, :] + jnp.einsum("tab,tad->tbd", comb, X)


def hc_head(cfg: Config, X: jax.Array, p: Params) -> jax.Array:
    T, hc, D = X.shape
    m = linear(rms(X.reshape(T, hc * D), cfg.rms_eps), p["hc_head_fn"])
    w = jax.nn.sigmoid(m * p["hc_head_scale"][0] + p["hc_head_base"]) + cfg.hc_eps
    return jnp.einsum("th,thd->td", w, X)


# ---------------------------------------------------------------- compressor §2.5.3


def ring_read(ring: jax.Array, positions: jax.Array, n: jax.Array, empty: float) -> jax.Array:
    """The rows of `positions` from a ring whose slot is position mod its size, `empty`
    where a position is not held (< 0, or ≥ the `n` positions written)."""
    held = ((positions >= 0) & (positions < n))[:, None]
    return jnp.where(held, ring[jnp.mod(positions, ring.shape[0])], empty)


def ring_slots(size: int, count: int, n: jax.Array, n_valid: jax.Array) -> jax.Array:
    """The slots of a ring of `size` that `count` rows for positions n … take: position mod
    size for the first `n_valid` (of a chunk longer than the ring only the last `size` of
    them), `size` (out of the ring: not written) for the rest."""
    j = jnp.arange(count)
    write = (j < n_valid) & (j >= n_valid - size)
    return jnp.where(write, jnp.mod(n + j, size), size)


def ring_write(ring: jax.Array, rows: jax.Array, n: jax.Array, n_valid: jax.Array) -> jax.Array:
    """`ring` after positions n … n + n_valid − 1 (the first `n_valid` of `rows`) were written
    to their slots (`ring_slots`)."""
    slots = ring_slots(ring.shape[0], rows.shape[0], n, n_valid)
    return ring.at[slots].set(rows, mode="drop")


def _pool(kv: jax.Array, score: jax.Array) -> jax.Array:
    """Softmax over axis 1 of `score`, weighted sum of `kv`; an all −∞ column pools to 0."""
    m = jnp.max(score, axis=1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(score - m)
    s = jnp.sum(e, axis=1)
    return jnp.sum(e * kv, axis=1) / jnp.where(s > 0, s, 1.0)


def compress(
    kv_new: jax.Array,
    score_new: jax.Array,
    st_kv: jax.Array,
    st_score: jax.Array,
    rows: jax.Array,
    n: jax.Array,
    n_valid: jax.Array,
    *,
    ratio: int,
    lanes: int,
    dim: int,
    finish: Any,
    emit: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Feed a chunk into a compressor; emit its completed windows into `rows`.

    kv_new, score_new: [T, lanes·dim] (score with ape). st_*: the frontier rings
    [lanes·ratio + REWIND, lanes·dim] (model/state.py). `finish(pooled,
    window_start_positions)` turns pooled rows into stored rows (norm, RoPE, quantization
    simulation). Returns (rows, st_kv, st_score).

    The frontier's pending positions (read from the ring by position) and the chunk are
    laid out in one buffer whose row i is position start + i, start = ratio·⌊n/ratio⌋ −
    (lanes−1)·ratio, so windows are buffer-aligned. With two lanes (CSA, overlapping
    windows) the row of window k pools lane 0 of window k−1 with lane 1 of window k.

    A chunk of at most REWIND + 1 tokens (a decode step, a speculative verification) is
    written to the rings first and the buffer read back from them, so the old rings feed
    only their in-place update (read and written both, XLA copied each ring per layer and
    step). `emit` (a scalar bool, not batched: `row_attention`'s "some row completes a
    window of this ratio"): pool only when true — a decode step of a ratio-128 compressor
    completes a window once in 128 steps, and its pooling was most of its cost.
    """
    T = kv_new.shape[0]
    r, c = ratio, lanes
    n_win = c + (T + r - 2) // r  # the window of position n + T − 1 is the last one
    start = r * (n // r) - (c - 1) * r
    size = st_kv.shape[0]
    new_kv = ring_write(st_kv, kv_new, n, n_valid)
    new_sc = ring_write(st_score, score_new, n, n_valid)
    from_rings = T <= size - c * r + 1  # = REWIND + 1

    def pooled_rows() -> jax.Array:
        if from_rings:  # every position the windows take is still in the rings
            held_to = n + n_valid
            pos = start + jnp.arange(n_win * r)
            buf_kv = ring_read(new_kv, pos, held_to, 0.0)
            buf_sc = ring_read(new_sc, pos, held_to, NEG_INF)
        else:
            fpos = start + jnp.arange(c * r)
            buf_kv = jnp.zeros((n_win * r, c * dim), kv_new.dtype)
            buf_kv = buf_kv.at[: c * r].set(ring_read(st_kv, fpos, n, 0.0))
            buf_sc = jnp.full((n_win * r, c * dim), NEG_INF, kv_new.dtype)
            buf_sc = buf_sc.at[: c * r].set(ring_read(st_score, fpos, n, NEG_INF))
            buf_kv = jax.lax.dynamic_update_slice(buf_kv, kv_new, (n - start, 0))
            buf_sc = jax.lax.dynamic_update_slice(buf_sc, score_new, (n - start, 0))
        win_kv = buf_kv.reshape(n_win, r, c * dim)
        win_sc = buf_sc.reshape(n_win, r, c * dim)
        if c == 1:
            cand_kv, cand_sc = win_kv, win_sc
        else:
            prev_kv = jnp.concatenate([jnp.zeros_like(win_kv[:1, :, :dim]),
                                       win_kv[:-1, :, :dim]])  # fmt: skip
            prev_sc = jnp.concatenate(
                [jnp.full_like(win_sc[:1, :, :dim], NEG_INF), win_sc[:-1, :, :dim]]
            )
            cand_kv = jnp.concatenate([prev_kv, win_kv[:, :, dim:]], axis=1)
            cand_sc = jnp.concatenate([prev_sc, win_sc[:, :, dim:]], axis=1)
        pooled = _pool(cand_kv[c - 1 :], cand_sc[c - 1 :])  # windows not yet emitted
        return finish(pooled, (n // r + jnp.arange(pooled.shape[0])) * r)

    first = n // r
    j = jnp.arange(n_win - c + 1)
    if emit is None:
        new_rows = pooled_rows()
    else:
        none = jnp.zeros((j.shape[0], rows.shape[-1]), kv_new.dtype)
        new_rows = jax.lax.cond(emit, pooled_rows, lambda: none)
    complete = (first + j + 1) * r <= n + n_valid
    cap = rows.shape[0]
    rows = rows.at[jnp.where(complete, first + j, cap)].set(new_rows, mode="drop")
    return rows, new_kv, new_sc


# ---------------------------------------------------------------- attention §2.5


def _finish_rows(cfg: Config, norm: jax.Array, freqs: np.ndarray, quant: Any,
                 store: Any = None):  # fmt: skip
    """Pooled windows → stored rows: norm, RoPE, the official graph's quantization
    simulation (`quant`, with `quant_sim`), then `store` (the state dtype's rounding)."""

    def finish(pooled: jax.Array, positions: jax.Array) -> jax.Array:
        row = apply_rope(rmsw(pooled, norm, cfg.rms_eps), positions, freqs)
        row = quant(row) if cfg.quant_sim else row
        return row if store is None else store(row)

    return finish


def _kv_fp8(cfg: Config, x: jax.Array) -> jax.Array:
    """fp8sim on the non-RoPE channels only."""
    nope = cfg.head_dim - cfg.rope_dim
    if not cfg.quant_sim or nope == 0:
        return x
    return jnp.concatenate([quant_sim.fp8sim(x[..., :nope]), x[..., nope:]], axis=-1)


def _stored(cfg: Config, rows: jax.Array, index: bool = False) -> jax.Array:
    """KV rows (window keys, compressed rows; indexer rows with `index`) as
    `cfg.state_dtype` holds them, rounded when made: what every later read of the state
    sees, whichever path made it (`model.pages`' codec, so pages hold them exactly)."""
    if cfg.state_dtype == "f32":
        return rows
    if index:
        return decode_index_rows(encode_index_rows(rows, cfg.state_dtype))
    return decode_rows(encode_rows(rows, cfg.rope_dim, cfg.state_dtype))


def _gather_selected(cfg: Config, rows: int, k: int) -> bool:
    """Attend to the indexer's picks by gathering them per query ([T, k, hd]) or by masking
    all rows ([T, H, rows] scores). Same math; masking is cheaper while the row count is
    within a few multiples of k·head_dim/heads, gathering wins at long contexts."""
    return rows * cfg.num_heads > 4 * k * cfg.head_dim


def _indexer_pick(cfg: Config, ip: Params, x, qr, idx, visible, positions, freqs,
                  gather: bool = False):  # fmt: skip
    """The indexer's top-k compressed rows for each query: (indices [T, k], chosen [T, k])
    when `gather` or `_gather_selected` prefers gathering them, else a mask [T, rows]."""
    T, ihd = x.shape[0], cfg.index_head_dim
    iq = linear(qr, ip["wq_b"]).reshape(T, cfg.index_heads, ihd)
    iq = apply_rope(iq, positions, freqs)
    if cfg.quant_sim:
        iq = quant_sim.idxq(iq)
    w = linear(x, ip["weights_proj"]) * (cfg.index_heads**-0.5)
    k = min(cfg.index_topk, idx.shape[0])
    if native.active() and native.index_top_supported(iq, idx):
        top_v, top_i = native.index_top(iq, w, idx, visible, k)
    else:
        isc = pallas_kernels.select(cfg.attention_impl, "indexer_scores")(iq, w, idx, visible)
        native_top = native.active() and native.top_k_supported(isc)
        top_v, top_i = native.top_k(isc, k) if native_top else jax.lax.top_k(isc, k)
    chosen = jnp.isfinite(top_v)
    if gather or _gather_selected(cfg, idx.shape[0], k):
        return top_i, chosen
    return jnp.zeros((T, idx.shape[0]), bool).at[jnp.arange(T)[:, None], top_i].set(chosen)


#: the layer kinds whose prefill chunks take the native attention (`attention`'s `chunk`):
#: CSA (each query's picks, not every row masked), HCA and sliding (a query's window keys
#: and visible rows, not all 644 keys of a 512-token chunk): prefill 2,048 tokens 560 → 601
#: tok/s with CSA and HCA (medians of 6, one process, runs alternated; 2-core AVX2 EPYC).
#: With the sliding layers as well the logits after 8,192 tokens on bench-192m moved 1.0e-3
#: from the twins' (CSA and HCA alone: 1.2e-5); the same run with `index_topk` above the
#: CSA rows held (every row picked, no top-k) moved them 8.1e-6: the 1e-3 is the indexer's
#: top-k trading a pick on a near-tie when the first layers' sums round otherwise, not the
#: attention drifting
CHUNK_KINDS: tuple[str, ...] = ("csa", "hca", "sliding")


def _every_visible(visible: jax.Array, k: int, gather: bool) -> Any:
    """`_indexer_pick`'s result while every query sees at most k rows (a context below
    k·ratio tokens: 2,048 for Flash's and bench-192m's 512 picks at ratio 4): its top k are
    then all the rows it sees, a prefix of the rows — the same set without scoring or a
    top-k (at 2k on bench-192m the indexer ran over a capacity of 522 rows to keep all
    ≤ 512 visible). The set is the indexer's; only the order the attention sums it in
    differs (by index here, by score there)."""
    if not gather:
        return visible
    T = visible.shape[0]
    return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (T, k)), visible[:, :k]


def attention(
    cfg: Config,
    layer: int,
    p: Params,
    ls: LayerState,
    x: jax.Array,
    positions: jax.Array,
    n: jax.Array,
    n_valid: jax.Array,
    emits: Any = None,
    seen: Any = None,
) -> tuple[jax.Array, LayerState]:
    """`emits(ratio)`: whether a compressor of that ratio may complete a window in this
    step, a scalar not batched over rows (`compress`'s `emit`; None: pool every step).
    `seen(ratio)`: the most compressed rows of that ratio any query of the step sees, a
    scalar not batched over rows (None: this chunk's own, `(n + n_valid) // ratio`) — under
    `vmap` a condition batched over rows would run both ways and batch every weight."""
    T = x.shape[0]
    H, hd, W, R = cfg.num_heads, cfg.head_dim, cfg.sliding_window, ls.raw.shape[0]
    kind = cfg.layer_kind(layer)
    freqs = inv_freqs(cfg, compressed=kind != "sliding")
    valid = jnp.arange(T) < n_valid

    # every projection of x at once (one native call in a decode step): the query's and
    # key's, and the compressors' of a compressed layer
    ws = [p["wq_a"], p["wkv"]]
    if kind != "sliding":
        ws += [p["compressor"]["wkv"], p["compressor"]["wgate"]]
    if kind == "csa":
        ws += [p["indexer"]["compressor"]["wkv"], p["indexer"]["compressor"]["wgate"]]
    x_q, x_kv, *x_comp = linears(x, *ws)
    qr = rmsw(x_q, p["q_norm"], cfg.rms_eps)
    q = rms(linear(qr, p["wq_b"]).reshape(T, H, hd), cfg.rms_eps)
    q = apply_rope(q, positions, freqs)
    kv = apply_rope(rmsw(x_kv, p["kv_norm"], cfg.rms_eps), positions, freqs)
    kv = _stored(cfg, _kv_fp8(cfg, kv))

    # raw window: ring keys (positions < n) then the chunk's own keys; a ring slot holds
    # the last position < n of its residue, one a rewound state wrote past n is masked
    # (it is older than the window by the ring's REWIND room)
    slots = jnp.arange(R)
    ring_pos = (n - 1) - jnp.mod(n - 1 - slots, R)
    qp = positions[:, None]

    def in_window(key_pos: jax.Array, key_ok: jax.Array) -> jax.Array:
        return key_ok[None, :] & (key_pos[None, :] <= qp) & (key_pos[None, :] > qp - W)

    ring_mask, own_mask = in_window(ring_pos, ring_pos >= 0), in_window(positions, valid)
    keys = jnp.concatenate([ls.raw, kv])
    raw_mask = jnp.concatenate([ring_mask, own_mask], 1)
    sink = p["attn_sink"]
    attend = pallas_kernels.select(cfg.attention_impl, "sink_attention")
    # a decode step on CPU: the native kernel reads the ring, the step's keys and the picked
    # compressed rows where they are (the twins above take them concatenated)
    direct = native.active() and native.attend_supported(
        q, ls.raw, kv, *([] if ls.comp is None else [ls.comp])
    )

    # a prefill chunk's CSA layer on CPU: the native kernel reads each query's picked rows
    # only, where the twin attends over every compressed row, masked (at 8k, 2,703 keys a
    # query for 640 used; 8k prefill 1.13x on bench-192m); an HCA or sliding layer's its
    # window's keys and visible rows (`CHUNK_KINDS`)
    chunk = (not direct and kind in CHUNK_KINDS and native.active()
             and native.attend_supported(q, ls.raw, kv, *([] if ls.comp is None else [ls.comp]),
                                       chunk=True))  # fmt: skip

    # the direct kernel also writes the step's keys into the ring, in place
    new = LayerState(ls.raw if direct else ring_write(ls.raw, kv, n, n_valid))

    def attend_direct(**comp: jax.Array) -> jax.Array:
        if chunk:
            return native.attend(q, ls.raw, ring_mask, kv, own_mask, sink, **comp)
        o, new.raw = native.attend(q, ls.raw, ring_mask, kv, own_mask, sink,
                                   slot=ring_slots(R, T, n, n_valid), **comp)  # fmt: skip
        return o

    if kind == "sliding":
        o = attend_direct() if direct or chunk else attend(q, keys, raw_mask, sink)
    else:
        r, c = cfg.compress_ratios[layer], (2 if kind == "csa" else 1)
        cp = p["compressor"]
        emit = None if emits is None else emits(r)
        ckv = x_comp[0]
        csc = x_comp[1] + cp["ape"][jnp.mod(positions, r)]
        comp, st_kv, st_sc = compress(
            ckv, csc, ls.comp_kv, ls.comp_score, ls.comp, n, n_valid,
            ratio=r, lanes=c, dim=hd, emit=emit,
            finish=_finish_rows(cfg, cp["norm"], freqs, lambda v: _kv_fp8(cfg, v),
                                lambda v: _stored(cfg, v)),
        )  # fmt: skip
        new.comp, new.comp_kv, new.comp_score = comp, st_kv, st_sc
        visible = jnp.arange(comp.shape[0])[None, :] < (qp + 1) // r  # [T, cap]
        every_row = jnp.broadcast_to(jnp.arange(comp.shape[0]), visible.shape)
        if kind == "hca" and (direct or chunk):
            o = attend_direct(comp=comp, pick=every_row, pick_ok=visible)
        elif kind == "hca":
            o = attend(
                q, jnp.concatenate([keys, comp]), jnp.concatenate([raw_mask, visible], 1), sink
            )
        else:
            ip = p["indexer"]
            icp = ip["compressor"]
            ihd = cfg.index_head_dim
            idx, ist_kv, ist_sc = compress(
                x_comp[2],
                x_comp[3] + icp["ape"][jnp.mod(positions, r)],
                ls.idx_kv, ls.idx_score, ls.idx, n, n_valid,
                ratio=r, lanes=2, dim=ihd, emit=emit,
                finish=_finish_rows(cfg, icp["norm"], freqs, quant_sim.idxq,
                                    lambda v: _stored(cfg, v, index=True)),
            )  # fmt: skip
            new.idx, new.idx_kv, new.idx_score = idx, ist_kv, ist_sc
            k = min(cfg.index_topk, idx.shape[0])
            if idx.shape[0] == k:
                # the indexer would pick every visible row (its scores are finite exactly
                # there): the same set without scoring or a top-k
                picked = visible
            else:
                gather = direct or chunk or _gather_selected(cfg, idx.shape[0], k)
                most = (n + n_valid) // r if seen is None else seen(r)
                picked = jax.lax.cond(
                    most <= k,  # no query of the step sees more than k rows
                    lambda: _every_visible(visible, k, gather),
                    lambda: _indexer_pick(cfg, ip, x, qr, idx, visible, positions, freqs,
                                          gather=gather),
                )  # fmt: skip
            if direct or chunk:
                pick, ok = picked if isinstance(picked, tuple) else (every_row, picked)
                o = attend_direct(comp=comp, pick=pick, pick_ok=ok)
            elif isinstance(picked, tuple):  # (indices, chosen): gather them
                sparse = pallas_kernels.select(cfg.attention_impl, "sparse_attention")
                o = sparse(q, keys, raw_mask, comp, *picked, sink)
            else:  # a mask over all rows
                o = attend(
                    q, jnp.concatenate([keys, comp]), jnp.concatenate([raw_mask, picked], 1), sink
                )
    o = apply_rope(o, positions, freqs, inverse=True)

    G = cfg.o_groups
    grouped = o.reshape(T, G, (H // G) * hd)
    wo_a = p["wo_a"].reshape(G, cfg.o_lora_rank, (H // G) * hd)
    if native.active() and native.gemv_grouped_supported(grouped, wo_a):
        low = native.gemv_grouped(grouped, wo_a)
    else:
        low = jnp.einsum("tgi,goi->tgo", grouped, wo_a)
    low = low.reshape(T, G * cfg.o_lora_rank)
    return linear(low, p["wo_b"]), new


# ---------------------------------------------------------------- MoE §2.6


def _swiglu(cfg: Config, g: jax.Array, u: jax.Array) -> jax.Array:
    lim = cfg.swiglu_limit
    return jax.nn.silu(jnp.minimum(g, lim)) * jnp.clip(u, -lim, lim)


#: up to this many (token, expert) pairs, a step of several sessions (one token each) reads
#: each selected expert once (`_moe_selected_once`)
BATCHED_DECODE_PAIRS = 64


def _moe_selected_once(cfg: Config, p: Params, x: jax.Array, sel: jax.Array, w: jax.Array):
    """The routed experts of a batched decode step (T tokens of T sessions): the selected
    (token, expert) pairs sorted by expert, and each distinct expert's weights read once —
    a repeated one is skipped by `lax.cond` — and applied to every token, weighted by that
    token's routing weight (0 when it did not pick it)."""
    T, k = sel.shape
    E = cfg.num_experts
    dense_w = jnp.zeros((T, E), x.dtype).at[jnp.arange(T)[:, None], sel].add(w)
    experts = jnp.sort(sel.reshape(-1))
    first = jnp.concatenate([jnp.array([True]), experts[1:] != experts[:-1]])

    def add(e: jax.Array, acc: jax.Array) -> jax.Array:
        w1, w3, w2 = (expert(p[n], e) for n in ("w1", "w3", "w2"))
        h = _swiglu(cfg, linear(x, w1), linear(x, w3)) * dense_w[:, e][:, None]
        return acc + linear(h, w2)

    def pair(j: jax.Array, acc: jax.Array) -> jax.Array:
        return jax.lax.cond(first[j], add, lambda _e, a: a, experts[j], acc)

    return jax.lax.fori_loop(0, T * k, pair, jnp.zeros_like(x))  # in a loop: see `moe`


#: from this many tokens a chunk's routed experts are computed grouped (`_moe_grouped`)
GROUPED_MIN_TOKENS = 256


def _moe_grouped(cfg: Config, p: Params, x: jax.Array, sel: jax.Array, w: jax.Array):
    """The routed experts of a long chunk, on the routed pairs only: the T·k (token,
    expert) pairs sorted by expert, each expert's run padded to whole blocks of `Bk` rows,
    and one expert at a time (a `fori_loop`) its weights taken once and three GEMMs a block
    over its own blocks (an inner loop of as many as it has). Computing every expert over
    every token instead costs E/k times the FLOPs (4x at top-4 of 16, 43x for Flash's
    top-6 of 256). A loop over the blocks with each block taking its expert's weights
    copied every block's weights out of the stacked array (XLA:CPU copies a dynamic slice
    before a dot) and ran the blocks left over past the last expert's: one expert at a time
    took bench-192m's 512-token MoE layer 39.5 → 31.5 ms (medians of 40, alternated; 2-core
    AVX2 EPYC). Pairs add into their token in expert order, so the sum differs from the
    dense form's by float rounding only."""
    T, k = sel.shape
    E, D = cfg.num_experts, x.shape[-1]
    P = T * k
    # blocks about the size of an expert's average share, 16 to 64 rows
    Bk = int(min(64, max(16, 2 ** int(np.ceil(np.log2(max(1, P // E)))))))
    NB = -(-P // Bk) + E  # enough for every expert's run padded to whole blocks
    e = sel.reshape(-1)
    order = jnp.argsort(e, stable=True)
    e_sorted = e[order]
    count = jnp.bincount(e, length=E)
    blocks = -(-count // Bk)  # each expert's
    run_start = jnp.cumsum(count) - count  # of each expert's run among the sorted pairs
    first = jnp.cumsum(blocks) - blocks  # … and its first block
    dest = first[e_sorted] * Bk + jnp.arange(P) - run_start[e_sorted]
    token = jnp.full(NB * Bk, T, jnp.int32).at[dest].set((order // k).astype(jnp.int32))
    weight = jnp.zeros(NB * Bk, x.dtype).at[dest].set(w.reshape(-1)[order])
    xs = jnp.concatenate([x, jnp.zeros((1, D), x.dtype)])[token].reshape(NB, Bk, D)
    weight = weight.reshape(NB, Bk, 1)

    def one_expert(i: jax.Array, out: jax.Array) -> jax.Array:
        w1, w3, w2 = (expert(p[n], i) for n in ("w1", "w3", "w2"))

        def block(j: jax.Array, out: jax.Array) -> jax.Array:
            b = first[i] + j
            h = _swiglu(cfg, linear(xs[b], w1), linear(xs[b], w3)) * weight[b]
            return out.at[b].set(linear(h, w2))

        return jax.lax.fori_loop(0, blocks[i], block, out)

    out = jax.lax.fori_loop(0, E, one_expert, jnp.zeros((NB, Bk, D), x.dtype))
    return jnp.zeros((T + 1, D), x.dtype).at[token].add(out.reshape(-1, D))[:T]


def _native_expert(w: Any) -> Any:
    """Stacked expert weights as `native.routed` takes them: FP4 as its (codes, exponents)."""
    return (w.q, w.exp) if isinstance(w, QWeight) and w.packed and w.block == (1, 32) else w


def _routed(cfg: Config, p: Params, x: jax.Array, sel: jax.Array, w: jax.Array,
            rows: bool) -> jax.Array:  # fmt: skip
    """The routed experts' weighted sum for tokens `x` (`sel`: each token's experts among
    `p`'s `cfg.num_experts`, `w` their weights); the way is chosen by the counts."""
    T, k = sel.shape
    E = cfg.num_experts
    decode = T * k <= E or (rows and T * k <= BATCHED_DECODE_PAIRS)
    if decode and native.active():
        experts = [_native_expert(p[n]) for n in ("w1", "w3", "w2")]
        if native.routed_supported(x, experts):
            return native.routed(x, sel, w, experts, cfg.swiglu_limit)
    if rows and 1 < T and T * k <= BATCHED_DECODE_PAIRS:
        routed = _moe_selected_once(cfg, p, x, sel, w)
    elif T * k <= E:  # few tokens (decode): read only the selected experts' weights
        routed = jnp.zeros_like(x)
        for t in range(T):

            def add(j: jax.Array, acc: jax.Array, t: int = t) -> jax.Array:
                e = sel[t, j]
                w1, w3, w2 = (expert(p[n], e) for n in ("w1", "w3", "w2"))
                h = _swiglu(cfg, linear(x[t], w1), linear(x[t], w3))
                return acc + w[t, j] * linear(h, w2)

            # a loop, not k unrolled bodies: XLA:CPU then reads the selected expert in place;
            # unrolled, each dynamic slice was copied out first (6x the time, bench notes)
            routed = routed.at[t].set(jax.lax.fori_loop(0, k, add, jnp.zeros_like(x[t])))
    elif T >= GROUPED_MIN_TOKENS:
        routed = _moe_grouped(cfg, p, x, sel, w)
    else:
        # A short chunk: every expert over every token as three plain GEMMs, with weight 0
        # where a token is not routed — at these sizes cheaper on XLA:CPU than grouping.
        dense_w = jnp.zeros((T, E), x.dtype).at[jnp.arange(T)[:, None], sel].add(w)
        w1, w3, w2 = (dequantize(p[n], x.dtype) for n in ("w1", "w3", "w2"))
        F = w1.shape[1]  # this device's share of the width, under `expert_parallel`
        g = linear(x, w1.reshape(E * F, -1)).reshape(T, E, F)
        u = linear(x, w3.reshape(E * F, -1)).reshape(T, E, F)
        h = (_swiglu(cfg, g, u) * dense_w[..., None]).reshape(T, E * F)
        routed = h @ jnp.transpose(w2, (0, 2, 1)).reshape(E * F, -1)
    return routed


def moe(
    cfg: Config, p: Params, x: jax.Array, tokens: jax.Array, hashed: bool, rows: bool = False
) -> jax.Array:
    """`rows`: the T tokens are one each of T sessions (a batched decode step), not a
    chunk of one sequence."""
    k = cfg.num_experts_per_tok
    shared = ("shared_w1", "shared_w3") if cfg.num_shared_experts else ()
    scores, *up = linears(x, p["gate"], *(p[n] for n in shared))  # one native call
    prob = jnp.sqrt(jax.nn.softplus(scores))  # [T, E]
    if hashed:
        sel = p["tid2eid"][tokens]
    else:
        _, sel = jax.lax.top_k(prob + p["gate_bias"], k)
    w = jnp.take_along_axis(prob, sel, axis=-1)
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    experts = {n: p[n] for n in ("w1", "w3", "w2")}
    routed = expert_parallel(lambda e, q, *a: _routed(cfg.replace(num_experts=e), q, *a, rows),
                             experts, x, sel, w)  # fmt: skip
    out = routed
    if cfg.num_shared_experts:
        out = out + linear(_swiglu(cfg, *up), p["shared_w2"])
    return out
