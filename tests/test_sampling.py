"""`ds4jax.sampling`: the top-p nucleus is the same set whether it is found among the top
candidates or by sorting the whole vocabulary, and the filters keep what they promise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4jax.sampling import (
    NUCLEUS_CANDIDATES,
    argmax,
    keep_rows,
    prob_rows,
    sample,
    sample_rows,
)

#: its programs are small and run over many rows (40,000-row draws, vocabulary-sized rows):
#: compiled as served they repay their compile (this file 104 → 75 s alone, 2-core AVX2 EPYC)
pytestmark = pytest.mark.optimized

V = 129280


def mass_before(z: np.ndarray) -> np.ndarray:
    """Per token, the probability (float64) of the tokens ranked before it (descending,
    ties by lower id)."""
    order = np.argsort(-z, kind="stable")
    p = np.exp(z.astype(np.float64) - z.max())
    p /= p.sum()
    out = np.empty(z.shape)
    out[order] = np.cumsum(p[order]) - p[order]
    return out


def nucleus(z: jax.Array, top_p: float) -> jax.Array:
    """The top-p keep mask of one row, as the batched step finds it (`keep_rows`)."""
    none = jnp.zeros(1, jnp.int32)
    return keep_rows(z[None], none, jnp.full(1, top_p), jnp.zeros(1))[0]


def nucleus_by_sorting(z: np.ndarray, top_p: float) -> np.ndarray:
    """The definition: keep while the mass ranked before a token is < top_p, and the top
    token (the first by id among tied maxima) whatever top_p is."""
    top = np.zeros(z.shape, bool)
    top[np.argmax(z)] = True
    return (mass_before(z) < top_p) | top


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.3])  # peaked … flat (whole-vocab fallback)
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_nucleus_matches_the_definition(scale: float, top_p: float) -> None:
    z = (np.random.default_rng(int(scale * 10)).standard_normal(V) * scale).astype(np.float32)
    got = np.asarray(nucleus(jnp.asarray(z), top_p))
    before = mass_before(z)
    # float32 sums over ~1e5 terms round: only tokens at the boundary may go either way
    differ = got != (before < top_p)
    assert got.sum() >= 1 and (np.abs(before[differ] - top_p) < 1e-5).all()
    assert differ.sum() <= 4


def test_both_paths_are_taken() -> None:
    peaked = np.zeros(V, np.float32)
    peaked[:10] = 20.0
    assert np.asarray(nucleus(jnp.asarray(peaked), 0.9)).sum() == 10  # among candidates
    flat = np.zeros(V, np.float32)  # every token ties: kept by id order, beyond the candidates
    kept = np.asarray(nucleus(jnp.asarray(flat), 0.5))
    assert kept.sum() > NUCLEUS_CANDIDATES and kept[: kept.sum()].all()


@pytest.mark.parametrize("top_p", [0.0, 1e-30])
def test_top_p_zero_keeps_the_top_token(top_p: float) -> None:
    """Every protocol accepts top_p 0; it keeps the top token alone (greedy), among the
    candidates and by sorting, and never an empty set (which drew token 0, BOS, each step)."""
    z = np.random.default_rng(1).standard_normal(V).astype(np.float32)
    z[777] = 9.0
    kept = np.asarray(nucleus(jnp.asarray(z), top_p))
    assert np.flatnonzero(kept).tolist() == [777]
    flat = np.zeros(V, np.float32)  # every token ties
    assert np.flatnonzero(np.asarray(nucleus(jnp.asarray(flat), top_p))).tolist() == [0]
    zs = jnp.asarray(np.stack([z, np.roll(z, 5)]))
    keys = jax.random.split(jax.random.key(0), 2)
    ones, zeros = jnp.ones(2, jnp.float32), jnp.zeros(2, jnp.int32)
    for top_k in (zeros, jnp.ones(2, jnp.int32)):
        got = sample_rows(zs, keys, ones, top_k, jnp.full(2, top_p), jnp.zeros(2))
        assert np.asarray(got).tolist() == [777, 782]
    assert int(sample(jnp.asarray(z), jax.random.key(3), temperature=1.0, top_p=top_p)) == 777


def test_sample_respects_top_k_top_p_and_min_p() -> None:
    z = jnp.asarray(np.linspace(0.0, 8.0, 64, dtype=np.float32))
    keys = jax.random.split(jax.random.key(0), 200)
    assert int(sample(z, keys[0])) == 63  # greedy
    top_k = {int(sample(z, k, temperature=1.0, top_k=3)) for k in keys}
    assert top_k <= {61, 62, 63} and len(top_k) > 1
    allowed = set(np.flatnonzero(nucleus_by_sorting(np.asarray(z), 0.8)))
    assert {int(sample(z, k, temperature=1.0, top_p=0.8)) for k in keys} <= allowed
    p = np.exp(np.asarray(z) - 8.0)
    allowed = set(np.flatnonzero(p >= 0.2))
    assert {int(sample(z, k, temperature=1.0, min_p=0.2)) for k in keys} <= allowed


_argmax = jax.jit(argmax)
# jitted once: called eagerly, each call traced and compiled sample_rows' `cond` anew
_sample_rows, _prob_rows = jax.jit(sample_rows), jax.jit(prob_rows)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from([0.0, -1.5, 2.0, 2.0, 7.25, -np.inf, np.inf, np.nan, -0.0, 1e-30]),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 3),
)
def test_argmax_is_numpys_first_maximum_with_ties_nans_and_infinities(values, rows) -> None:
    """The two-reduction argmax the decode step samples greedily with picks what
    `np.argmax` picks: the first maximum, the first NaN when there is one."""
    x = np.array([values[i:] + values[:i] for i in range(rows)], np.float32)
    assert np.array_equal(np.asarray(_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_argmax_on_a_vocabulary_row_and_a_batch() -> None:
    z = np.random.default_rng(5).standard_normal((4, V)).astype(np.float32)
    z[2, [17, 90000]] = 9.0  # a tie: the first wins
    assert np.array_equal(np.asarray(_argmax(jnp.asarray(z))), np.argmax(z, axis=-1))
    assert int(_argmax(jnp.asarray(z[2]))) == 17


@pytest.mark.parametrize("filters", [dict(), dict(top_k=5), dict(top_p=0.8, min_p=0.05)])
def test_a_kept_or_rejected_draft_leaves_the_rows_distribution(filters) -> None:
    """Speculative decoding's rejection step (`model.speculative.verify_rows`) with a
    point-mass draft d: keep d with `prob_rows`' probability, else draw with d banned. The
    token that comes out is distributed as `sample_rows` draws it, for a likely draft, an
    unlikely one and one the filters drop (40,000 draws; 4σ ≤ 0.01)."""
    logits = jnp.asarray([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, 1.2])
    B = 40_000
    rows = jnp.broadcast_to(logits, (B, logits.shape[0]))
    args = (
        jnp.full(B, 0.9, jnp.float32),
        jnp.full(B, filters.get("top_k", 0), jnp.int32),
        jnp.full(B, filters.get("top_p", 1.0), jnp.float32),
        jnp.full(B, filters.get("min_p", 0.0), jnp.float32),
    )
    keys = jax.random.split(jax.random.key(3), 2 * B)
    want = np.bincount(np.asarray(_sample_rows(rows, keys[:B], *args)), minlength=8) / B
    for d in (0, 2, 5):
        draft = jnp.full(B, d, jnp.int32)
        p = _prob_rows(rows, draft, *args)
        u = jax.vmap(jax.random.uniform)(jax.random.split(jax.random.key(d), B))
        kept = u < p
        y = _sample_rows(rows, keys[B:], *args, ban=jnp.where(kept, -1, draft))
        out = np.asarray(jnp.where(kept, draft, y))
        got = np.bincount(out, minlength=8) / B
        assert np.abs(got - want).max() < 0.01, (d, got, want)
        if float(p[0]) == 0.0:
            assert not np.any(out == d)  # a filtered-out draft is never kept


def _softmax64(z: np.ndarray) -> np.ndarray:
    p = np.exp(z.astype(np.float64) - z.max())
    return p / p.sum()


@pytest.mark.parametrize("min_p", [0.0, 0.3])
def test_sampled_rows_follow_the_softmax(min_p: float) -> None:
    """`sample_rows` at temperature 0.9 draws each token with its softmax probability
    (float64), min-p dropping the tokens below its share of the best (40,000 draws, 4σ ≤
    0.01)."""
    z = np.asarray([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, 1.2], np.float32)
    B = 40_000
    rows = jnp.broadcast_to(jnp.asarray(z), (B, z.size))
    args = (jnp.full(B, 0.9), jnp.zeros(B, jnp.int32), jnp.ones(B), jnp.full(B, min_p))
    got = np.bincount(np.asarray(_sample_rows(rows, jax.random.split(jax.random.key(7), B),
                                              *args)), minlength=z.size) / B  # fmt: skip
    p = _softmax64(z / 0.9)
    p = np.where(p >= min_p * p.max(), p, 0.0)
    assert np.abs(got - p / p.sum()).max() < 0.01, (got, p / p.sum())
    assert np.all(got[p == 0] == 0)


def test_a_vocabulary_row_draws_across_its_blocks() -> None:
    """A V4-sized row (129,280 tokens: `draw_rows`' blocks, the last one padded): likely
    tokens in different blocks and the long tail together come out in their proportions
    (3,200 draws: σ ≤ 0.009 a share; the largest error of these keys 0.005)."""
    z = np.zeros(V, np.float32)
    hot = [0, 1023, 1024, 64_000, V - 1]
    z[hot] = [10.0, 10.5, 9.0, 11.0, 10.2]
    p = _softmax64(z)
    B, draws = 400, []
    rows = jnp.broadcast_to(jnp.asarray(z), (B, V))
    args = (jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B), jnp.zeros(B))
    for i in range(8):
        draws.append(np.asarray(_sample_rows(rows, jax.random.split(jax.random.key(i), B),
                                             *args)))  # fmt: skip
    out = np.concatenate(draws)
    got = np.array([np.mean(out == h) for h in hot] + [np.mean(~np.isin(out, hot))])
    want = np.array([*p[hot], 1 - p[hot].sum()])
    assert np.abs(got - want).max() < 0.025, (got, want)


@pytest.mark.parametrize("only", [0, 1023, 1024, V - 1])
def test_a_single_kept_token_is_always_drawn(only: int) -> None:
    """Whatever the uniform draw, a row with one kept token draws it: the first or last of
    a block, the vocabulary's last (in the padded block)."""
    from ds4jax.sampling import draw_rows

    B = 64
    z = jnp.asarray(np.random.default_rng(only).standard_normal((B, V)).astype(np.float32))
    mask = jnp.zeros((B, V), bool).at[:, only].set(True)
    got = jax.jit(draw_rows)(jax.random.split(jax.random.key(only), B), z, mask)
    assert np.all(np.asarray(got) == only)
