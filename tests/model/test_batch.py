"""The batched decode step: every row equals its session decoded alone, EOS is never
evaluated, rows enter and leave intact, and a fixed batch size never recompiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model import batch as mb
from ds4jax.model.forward import decode_step, prefill
from ds4jax.model.params import init_params
from ds4jax.model.state import init_state
from ds4jax.sampling import keep_rows, keep_rows_reference
from tests.model.conftest import small_config

MAX_LEN = 96
EOS = 3


@pytest.fixture(scope="module")
def model():
    cfg = small_config(quant_sim=False)
    return cfg, init_params(cfg, seed=3)


def prompt_state(model, n: int, seed: int):
    cfg, params = model
    toks = np.random.default_rng(seed).integers(4, cfg.vocab_size, n)
    return prefill(params, init_state(cfg, MAX_LEN), toks, cfg, chunk_sizes=(16,))[0]


def run_step(model, batch, size, override, temperature=0.0, seed=0, chunk=None):
    cfg, params = model
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), size)))
    return mb.step(
        params, batch, np.asarray(override, np.int32), keys,
        np.full(size, temperature, np.float32), np.zeros(size, np.int32),
        np.ones(size, np.float32), np.zeros(size, np.float32), np.int32(EOS), chunk,
        cfg=cfg, size=size,
    )  # fmt: skip


def test_rows_equal_their_sessions_decoded_alone(model) -> None:
    cfg, params = model
    solos = [prompt_state(model, n, i) for i, n in enumerate((5, 23, 40))]
    batch = mb.empty_batch(cfg, MAX_LEN, 4)
    for row, s in enumerate(solos):
        batch = mb.insert(batch, jnp.int32(row), s)
    for _ in range(12):  # greedy: crosses windows and compression boundaries
        batch, tokens, _ = run_step(model, batch, 4, [-1] * 4)
        for row in range(3):
            want = int(jnp.argmax(solos[row].logits))
            assert int(tokens[row]) == want
            solos[row] = decode_step(params, solos[row], want, cfg)
            got = mb.extract(batch, jnp.int32(row))
            assert int(got.pos) == int(solos[row].pos)
            assert float(jnp.abs(got.logits - solos[row].logits).max()) <= 1e-5


def test_a_prompt_chunk_riding_in_the_step_equals_its_own_prefill(model) -> None:
    """A mixed step (issue 27): the rows step as without the chunk, and the prompt's state
    after it equals prefilling those tokens alone — across compression boundaries and the
    window, for full and padded chunks, with an EOS row kept as it was."""
    cfg, params = model
    solos = [prompt_state(model, n, i) for i, n in enumerate((5, 23))]
    prompt = np.random.default_rng(9).integers(4, cfg.vocab_size, 60)
    state, done = init_state(cfg, MAX_LEN), 0
    batch = mb.empty_batch(cfg, MAX_LEN, 2)
    for row, s in enumerate(solos):
        batch = mb.insert(batch, jnp.int32(row), s)
    plain = jax.tree.map(jnp.copy, batch)
    for step, n in enumerate((16, 3, 16, 9, 16)):
        override = [EOS if step == 2 else -1, -1]
        plain, want, _ = run_step(model, plain, 2, override)
        chunk = np.zeros(16, np.int32)
        chunk[:n] = prompt[done : done + n]
        batch, got, _, state_after = run_step(model, batch, 2, override,
                                              chunk=(state, chunk, np.int32(n)))  # fmt: skip
        alone, _ = prefill(params, state, prompt[done : done + n], cfg, chunk_sizes=(16,))
        state, done = state_after, done + n
        assert np.array_equal(np.asarray(got), np.asarray(want))
        assert int(state.pos) == int(alone.pos) == done
        for got_tree, want_tree in ((batch, plain), (state, alone)):  # empty slots: ±inf
            for a, b in zip(jax.tree.leaves(got_tree), jax.tree.leaves(want_tree), strict=True):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                           rtol=0, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("n", [17, 19, 31])  # 19, 31: the next token would close a window
def test_forced_tokens_and_eos(model, n) -> None:
    """A sampled EOS is not evaluated: the row writes nothing (no select over the states
    afterwards), bit for bit, even where the next position completes a compressed window."""
    cfg, params = model
    a, b = prompt_state(model, 9, 7), prompt_state(model, n, 8)
    batch = mb.insert(mb.insert(mb.empty_batch(cfg, MAX_LEN, 2), jnp.int32(0), a), jnp.int32(1), b)
    batch, tokens, _ = run_step(model, batch, 2, [42, EOS])
    assert tokens.tolist() == [42, EOS]
    forced = mb.extract(batch, jnp.int32(0))
    want = decode_step(params, a, 42, cfg)
    assert float(jnp.abs(forced.logits - want.logits).max()) <= 1e-5
    kept = mb.extract(batch, jnp.int32(1))  # EOS: sampled, never evaluated
    assert int(kept.pos) == int(b.pos)
    assert all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(b), strict=True)
    )


def test_a_fixed_size_never_recompiles(model) -> None:
    cfg, _ = model
    state = prompt_state(model, 6, 1)
    batch = mb.insert(mb.empty_batch(cfg, MAX_LEN, 4), jnp.int32(2), state)
    batch, *_ = run_step(model, batch, 4, [-1] * 4, temperature=0.8)
    compiled = mb.step._cache_size()
    for seed in range(3):  # other tokens, keys, temperatures, rows: the same program
        batch, *_ = run_step(model, batch, 4, [-1, 5, -1, -1], temperature=0.5 + seed, seed=seed)
        batch = mb.insert(batch, jnp.int32(seed), state)
    assert mb.step._cache_size() == compiled


def test_bucket_sizes() -> None:
    assert [mb.bucket(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError):
        mb.bucket(9)


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.3])  # peaked … flat (the sorted fallback)
def test_per_row_filters_match_their_sorted_twin(scale: float) -> None:
    V = 129280
    z = jnp.asarray(np.random.default_rng(int(scale)).standard_normal((5, V)) * scale, jnp.float32)
    top_k = jnp.array([0, 5, 0, 50, 0])
    top_p = jnp.array([0.9, 1.0, 1.0, 0.95, 1.0])
    min_p = jnp.array([0.0, 0.0, 0.05, 0.1, 0.0])
    got = np.asarray(jax.jit(keep_rows)(z, top_k, top_p, min_p))
    want = np.asarray(jax.jit(keep_rows_reference)(z, top_k, top_p, min_p))
    assert (got == want).all()
    assert got[4].all()  # no filter: the whole vocabulary
    assert got[1].sum() == 5
