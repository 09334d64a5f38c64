"""The MoE's routed experts computed three ways give one answer (issue 17): the grouped
form of long chunks (pairs sorted by expert, one padded block at a time) against every
expert over every token, on ordinary and on skewed routing — every token sent to the same
experts, so a run spans many blocks — with plain float32 experts and with FP4 experts kept
resident (`--weights fp8`). And the indexer's shortcut (no scores, no top-k while it would
pick every visible row) leaves a layer's output as it was."""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model import layers
from ds4jax.model.params import init_params
from ds4jax.model.quantized import dense
from ds4jax.model.state import init_state
from ds4jax.weights import official
from tests.model.conftest import small_config

CFG = small_config(num_layers=2, compress_ratios=(4, 8), hash_layers=(True, False), quant_sim=False)


def routed(cfg, p, x, tokens, hashed: bool, grouped: bool, monkeypatch) -> np.ndarray:
    monkeypatch.setattr(layers, "GROUPED_MIN_TOKENS", 1 if grouped else 10**9)
    return np.asarray(layers.moe(cfg, p, x, tokens, hashed))


@pytest.mark.parametrize("T", [256, 512])
@pytest.mark.parametrize("skewed", [False, True])
def test_grouped_experts_equal_every_expert_over_every_token(T, skewed, monkeypatch) -> None:
    params = init_params(CFG, 0)
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.standard_normal((T, CFG.hidden_size), np.float32))
    tokens = jnp.asarray(np.full(T, 7) if skewed else rng.integers(0, CFG.vocab_size, T))
    # layer 0 routes by token hash, layer 1 by learned top-k (random inputs: not skewed)
    for layer in (0,) if skewed else (0, 1):
        ffn, hashed = params["layers"][layer]["ffn"], CFG.hash_layers[layer]
        want = routed(CFG, ffn, x, tokens, hashed, False, monkeypatch)
        got = routed(CFG, ffn, x, tokens, hashed, True, monkeypatch)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_grouped_experts_read_resident_fp4_experts(tmp_path: Path, monkeypatch) -> None:
    official.write_official_checkpoint(init_params(CFG, 0), CFG, tmp_path)
    _, resident = official.load_official_checkpoint(tmp_path, CFG, resident={"fp8", "fp4"})
    ffn = resident["layers"][1]["ffn"]
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((256, CFG.hidden_size), np.float32))
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, 256))
    want = routed(CFG, dense(ffn), x, tokens, False, False, monkeypatch)
    got = routed(CFG, dense(ffn, keep=frozenset({"w1", "w2", "w3"})), x, tokens, False, True,
                 monkeypatch)  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("native_kernels", [True, False])
def test_indexer_shortcut_picks_what_the_top_k_picks(native_kernels, monkeypatch) -> None:
    """A CSA layer over 48 positions (at most 12 visible compressed rows) with topk 16: in a
    state of 48 positions (12 rows ≤ 16) the static shortcut runs; in a state of 96 (24
    rows > 16) the step's own check (no query sees more than 16 rows) takes every visible
    row without scoring; with that check forced off the indexer scores and takes its top
    16, which are every visible row — the same output each way. With the native kernels the
    rows are gathered by index; without, masked."""
    from ds4jax import native

    cfg = small_config(num_layers=1, compress_ratios=(4,), hash_layers=(True,), index_topk=16,
                       quant_sim=False)  # fmt: skip
    p = init_params(cfg, 0)["layers"][0]["attn"]
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((48, cfg.hidden_size), np.float32))
    pos = jnp.arange(48, dtype=jnp.int32)
    calls: list[int] = []
    real = layers._indexer_pick
    monkeypatch.setattr(layers, "_indexer_pick", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(max_len: int) -> np.ndarray:
        st = init_state(cfg, max_len).layers[0]
        with contextlib.nullcontext() if native_kernels else native.disabled():
            out = layers.attention(cfg, 0, p, st, x, pos, jnp.int32(0), jnp.int32(48))[0]
        return np.asarray(out)

    shortcut = run(48)
    assert not calls
    skipped = run(96)
    real_cond = jax.lax.cond
    with monkeypatch.context() as m:
        m.setattr(jax.lax, "cond", lambda pred, yes, no: no())  # the indexer, always
        scored = run(96)
    assert jax.lax.cond is real_cond and calls
    np.testing.assert_allclose(shortcut, scored, rtol=0, atol=1e-5 * np.abs(scored).max())
    np.testing.assert_allclose(skipped, scored, rtol=0, atol=1e-5 * np.abs(scored).max())
