"""Next-token selection from logits: greedy at temperature 0, else temperature sampling with
optional top-k / top-p / min-p filtering. Pure functions of (logits, keys), written once for
rows (`sample_rows`, what the batched step runs); one sequence is a batch of one."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ds4jax import native


def argmax(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, axis=-1)` as int32, exactly (the first maximum; the first NaN if
    any), as two plain reductions: XLA:CPU runs `argmax`'s (value, index) reduction as a
    scalar loop — 1.29 ms for 4 rows of a 129,280-token vocabulary against 0.30 ms this
    way, on every decode step (issue 27). On CPU, the native kernel (`native.argmax`): XLA's
    maximum over 8 such rows still took 2.5 ms."""
    if native.active() and native.unpartitioned() and logits.dtype == jnp.float32:
        return native.argmax(logits)
    # a NaN is looked for apart: XLA:CPU's vectorized maximum of a long row can skip one
    nan = jnp.isnan(logits)
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def sample(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> jax.Array:
    """One row's token (int32 scalar): `sample_rows` on a batch of one, so a single sequence
    (`ds4jax generate`, fidelity trajectories) samples exactly as a served row does."""

    top_k = min(top_k, 2**31 - 1)
    return _sample_one(logits, key, jnp.float32(temperature), jnp.int32(top_k),
                       jnp.float32(top_p), jnp.float32(min_p))  # fmt: skip


@jax.jit
def _sample_one(logits, key, temperature, top_k, top_p, min_p) -> jax.Array:
    return sample_rows(logits[None], key[None], temperature[None], top_k[None], top_p[None],
                       min_p[None])[0]  # fmt: skip


#: Candidates a row's kept set is first looked for among: sorting the whole V4 vocabulary
#: (129k) costs ~60 ms per token on CPU, `top_k` of this many ~1 ms.
NUCLEUS_CANDIDATES = 1024


# ------------------------------------------------------------------ per-row, in one jit
#
# A batched decode step samples every row with its own temperature, top-k, top-p, min-p and
# key. `keep_rows` finds each row's kept set among its top `NUCLEUS_CANDIDATES` logits when
# that provably holds the whole set (the common, peaked case) and otherwise falls back, for
# the whole batch, to its twin `keep_rows_reference`, which sorts the vocabulary: the
# definition, and the same filters as `sample` (top-k keeps every logit ≥ the k-th, top-p
# the tokens whose higher-ranked mass is < top_p and the top token whatever top_p is — so
# top_p 0, which every protocol accepts, is greedy rather than an empty set that would draw
# token 0 —, min-p those ≥ min_p × the best, each on the distribution the previous filters
# left).


def _keep_sorted(z: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array):
    """One row, by sorting the whole vocabulary: the definition."""
    V = z.shape[-1]
    order = jnp.argsort(-z, stable=True)
    kth = jnp.where(top_k > 0, z[order][jnp.clip(top_k - 1, 0, V - 1)], -jnp.inf)
    z1 = jnp.where(z >= kth, z, -jnp.inf)
    ps = jax.nn.softmax(z1)[order]
    first = jnp.arange(V) == 0
    before = jnp.zeros(V, bool).at[order].set(((jnp.cumsum(ps) - ps) < top_p) | first)
    keep = (z1 > -jnp.inf) & jnp.where(top_p < 1.0, before, True)
    p2 = jax.nn.softmax(jnp.where(keep, z, -jnp.inf))
    return keep & jnp.where(min_p > 0.0, p2 >= min_p * jnp.max(p2), True)


def _keep_candidates(z: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array):
    """One row among its top candidates: (kept mask over the vocabulary, exact?)."""
    V = z.shape[-1]
    C = min(NUCLEUS_CANDIDATES, V)
    vals, ids = jax.lax.top_k(z, C)
    limited = top_k > 0
    kth = jnp.where(limited, vals[jnp.clip(top_k - 1, 0, C - 1)], -jnp.inf)
    # the k-th logit is a candidate, and no token outside ties with it
    exact = ~limited | ((top_k <= C) & (vals[C - 1] < kth))
    z1 = jnp.where(vals >= kth, vals, -jnp.inf)
    lse = jnp.where(limited, jax.nn.logsumexp(z1), jax.nn.logsumexp(z))
    p1 = jnp.exp(z1 - lse)  # the candidates' probabilities after top-k, exact when `exact`
    nucleus_on = top_p < 1.0
    exact &= ~nucleus_on | limited | (jnp.sum(p1) >= top_p)
    first = jnp.arange(C) == 0
    nucleus = ((jnp.cumsum(p1) - p1) < top_p) | first
    keep = (z1 > -jnp.inf) & jnp.where(nucleus_on, nucleus, True)
    restricted = limited | nucleus_on
    p2 = jax.nn.softmax(jnp.where(keep, z1, -jnp.inf))
    p2 = jnp.where(restricted, p2, p1)
    min_on = min_p > 0.0
    # unrestricted min-p: every outside token is at most the last candidate
    exact &= restricted | ~min_on | (p1[C - 1] < min_p * p1[0])
    keep &= jnp.where(min_on, p2 >= min_p * jnp.max(p2), True)
    everything = ~restricted & ~min_on
    mask = jnp.zeros(V, bool).at[ids].set(keep) | everything
    return mask, exact | everything


def keep_rows_reference(z, top_k, top_p, min_p) -> jax.Array:
    """The kept mask [B, V] of temperature-scaled logits `z` [B, V], by sorting."""
    return jax.vmap(_keep_sorted)(z, top_k, top_p, min_p)


def keep_rows(z, top_k, top_p, min_p) -> jax.Array:
    """`keep_rows_reference`, among the top candidates when every row allows it."""
    mask, exact = jax.vmap(_keep_candidates)(z, top_k, top_p, min_p)
    return jax.lax.cond(
        jnp.all(exact), lambda: mask, lambda: keep_rows_reference(z, top_k, top_p, min_p)
    )


def _kept(z: jax.Array, greedy: jax.Array, top_k: jax.Array, top_p: jax.Array,
          min_p: jax.Array) -> jax.Array:  # fmt: skip
    """The kept mask [B, V] of temperature-scaled logits `z`. The work follows what the
    batch asks for: temperature and min-p alone need no ranking (the default of `ds4jax
    serve`); only top-k or top-p rank candidates (`keep_rows`). Greedy rows filter nothing,
    so they never ask for ranking or the sorted fallback."""
    k = jnp.where(greedy, 0, top_k)
    p = jnp.where(greedy, 1.0, top_p)
    m = jnp.where(greedy, 0.0, min_p)

    def unranked() -> jax.Array:
        # p ≥ min_p · p_max, as exp(z − z_max) ≥ min_p: no softmax over the vocabulary
        # (XLA:CPU ran one over 8 rows inside this conditional in ~3 ms, single-threaded)
        floor = jnp.max(z, axis=-1) + jnp.log(jnp.where(m > 0.0, m, 1.0))
        return jnp.where((m > 0.0)[:, None], z >= floor[:, None], True)

    ranked = jnp.any((k > 0) | (p < 1.0))
    return jax.lax.cond(ranked, lambda: keep_rows(z, k, p, m), unranked)


#: tokens per block of `draw_rows`' two-level search
DRAW_BLOCK = 1024


def uniforms(keys: jax.Array) -> jax.Array:
    """Each row's one uniform draw in [0, 1) [B] (f32), where its token inverts the CDF."""
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)


def draw_rows(keys: jax.Array, z: jax.Array, mask: jax.Array) -> jax.Array:
    """One token per row [B] (int32) from softmax(z) over the `mask`ed tokens, by inverting
    its cumulative distribution at one uniform draw per row: the kept tokens' weights
    exp(z − max) are summed in blocks of `DRAW_BLOCK`, the draw × their total finds its
    block among the blocks' running sums, then its token among that block's. Token i is
    drawn when the target falls in [C(i−1), C(i)) of the running sums — width its weight —
    so a masked token (weight 0) never is. `jax.random.categorical` (Gumbel-max) draws one
    threefry number and two logs per token of the vocabulary: 2.3 ms a row for V4's 129,280
    on this CPU, 15 ms for 8 rows, as much as the decode step itself (issue 27)."""
    B, V = z.shape
    nb = -(-V // DRAW_BLOCK)
    top = jnp.max(jnp.where(mask, z, -jnp.inf), axis=-1, keepdims=True)
    w = jnp.where(mask, jnp.exp(z - top), 0.0)
    w = jnp.pad(w, ((0, 0), (0, nb * DRAW_BLOCK - V))).reshape(B, nb, DRAW_BLOCK)
    sums = jnp.sum(w, axis=-1)  # [B, nb]
    ends = jnp.cumsum(sums, axis=-1)  # each block's running end
    target = uniforms(keys) * ends[:, -1]
    # a target rounded up to a sum's end takes the last block / token with weight
    last_block = jnp.max(jnp.where(sums > 0, jnp.arange(nb), 0), axis=-1)
    b = jnp.minimum(jnp.sum(ends <= target[:, None], axis=-1), last_block)
    start = jnp.where(b > 0, jnp.take_along_axis(ends, jnp.maximum(b - 1, 0)[:, None], 1)[:, 0],
                      0.0)  # fmt: skip
    row = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [B, DRAW_BLOCK]
    ids = jnp.arange(DRAW_BLOCK)
    last = jnp.max(jnp.where(row > 0, ids, 0), axis=-1)
    j = jnp.minimum(jnp.sum(start[:, None] + jnp.cumsum(row, axis=-1) <= target[:, None],
                            axis=-1), last)  # fmt: skip
    return (b * DRAW_BLOCK + j).astype(jnp.int32)


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    return logits / jnp.where(temperature <= 0, 1.0, temperature)[:, None]


def sample_rows(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    ban: jax.Array | None = None,
) -> jax.Array:
    """One token per row [B] (int32); a row with temperature ≤ 0 is greedy. Jittable: every
    parameter is a per-row array. All greedy is an argmax. `ban` [B] (−1: none): a token a
    sampled row may not draw — the distribution renormalized without it, which is what a
    rejected speculative draft leaves (`model.speculative`); a greedy row ignores it (its
    rejected draft is never its argmax). On CPU, a step whose sampled rows ask only
    temperature and min-p (no top-k, top-p or ban: the server's default) draws in the
    native kernel (`native.draw`); any other step, or a mesh, takes the jnp path here."""
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0

    def twin() -> jax.Array:
        best = argmax(logits)

        def drawn() -> jax.Array:
            z = _scaled(logits, temperature)
            mask = _kept(z, greedy, top_k, top_p, min_p)
            if ban is not None:
                ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
                mask &= ids != ban[:, None]
            tokens = draw_rows(keys, z, mask)
            return jnp.where(greedy, best, tokens).astype(jnp.int32)

        return jax.lax.cond(jnp.all(greedy), lambda: best, drawn)

    if ban is None and native.active() and native.unpartitioned():
        # min-p without ranking in the native kernel: exp only near the tokens min-p keeps
        # (the twin took it over the vocabulary: 5 ms a step for 8 rows, 2-core AVX2 EPYC)
        unranked = greedy | ((top_k <= 0) & (top_p >= 1.0) & (min_p > 0.0))
        return jax.lax.cond(
            jnp.all(unranked),
            lambda: native.draw(logits, uniforms(keys), temperature, min_p),
            twin,
        )
    return twin()


def prob_rows(
    logits: jax.Array,
    tokens: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
) -> jax.Array:
    """The probability [B] that `sample_rows` draws each row's `tokens[row]`: under the
    filtered, temperature-scaled distribution, or 1/0 (the argmax or not) for a greedy
    row. A speculative draft is accepted with this probability."""
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    hit = (argmax(logits) == tokens).astype(jnp.float32)

    def drawn() -> jax.Array:
        z = _scaled(logits, temperature)
        probs = jax.nn.softmax(jnp.where(_kept(z, greedy, top_k, top_p, min_p), z, -jnp.inf))
        p = jnp.take_along_axis(probs, tokens[:, None], axis=-1)[:, 0]
        return jnp.where(greedy, hit, p)

    return jax.lax.cond(jnp.all(greedy), lambda: hit, drawn)


# ------------------------------------------------------------------ log-probabilities

#: the most alternatives a request may ask for (OpenAI's `top_logprobs` ≤ 20); a step that
#: reports log-probabilities always computes this many, and the host slices each row's k
MAX_LOGPROBS = 20


def logprob_rows(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the raw distribution (log_softmax of `logits` [B, V], before
    temperature and every filter — vLLM's default): (each row's `tokens[row]` [B], the top
    `MAX_LOGPROBS` [B, K] most likely first, their ids [B, K] int32). Ranked on the logits,
    less the row's logsumexp: the vocabulary's log_softmax is never materialized."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    top, ids = jax.lax.top_k(logits, min(MAX_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return chosen - lse, top - lse[:, None], ids.astype(jnp.int32)
