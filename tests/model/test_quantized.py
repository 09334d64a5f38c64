"""`--weights fp8`: the official release's FP8 linears and FP4 experts stay in their own
formats on device and are expanded inside the step (issue 16). A random small model written
in the release layout is read both ways; every path that touches the weights — the prefill
(all experts at once), one decode step (the selected experts one by one), the batched step
(each selected expert once) and the head — gives the dequantize-at-load logits, and the
quantized leaves take half the bytes of bf16."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ds4jax.chat.tokenizer import load_tokenizer
from ds4jax.model import batch as batch_ops
from ds4jax.model.forward import decode_step, prefill
from ds4jax.model.params import init_params, path_name
from ds4jax.model.quantized import QWeight, dequantize, device_bytes, e2m1, is_quantized, matmul
from ds4jax.model.state import init_state
from ds4jax.weights import official
from ds4jax.weights.checkpoint import load_model
from ds4jax.weights.loading import CheckpointError
from tests.model.conftest import small_config

CFG = small_config(num_layers=2, compress_ratios=(4, 8), hash_layers=(True, False), quant_sim=False)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("release")
    official.write_official_checkpoint(init_params(CFG, 0), CFG, d, fp8_head=True)
    return d


@pytest.fixture(scope="module")
def both(release: Path) -> tuple:
    _, at_load = official.load_official_checkpoint(release, CFG, dtype=jnp.bfloat16)
    _, resident = official.load_official_checkpoint(release, CFG, dtype=jnp.bfloat16,
                                                    resident={"fp8", "fp4"})  # fmt: skip
    return at_load, resident


def test_fp8_and_fp4_tensors_stay_in_their_formats(both: tuple) -> None:
    at_load, resident = both
    layer = resident["layers"][0]
    assert layer["attn"]["wq_a"].q.dtype == jnp.float8_e4m3fn
    assert layer["attn"]["wq_a"].block == official.FP8_BLOCK
    w1 = layer["ffn"]["w1"]
    assert w1.packed and w1.q.dtype == jnp.uint8  # two codes per byte, on every backend
    assert w1.shape == at_load["layers"][0]["ffn"]["w1"].shape
    assert w1.block == (1, official.FP4_BLOCK)
    assert is_quantized(resident["head"]) and not is_quantized(resident["embed"])
    leaves = jax.tree_util.tree_leaves_with_path(resident, is_leaf=is_quantized)
    quantized = [(path_name(k), w) for k, w in leaves if is_quantized(w)]
    # exactly the release's own bytes: FP8 one per value, FP4 one per two, E8M0 scales
    for name, w in quantized:
        assert w.nbytes == official.stored_bytes(official.leaf_kind(name, True), w.shape), name
    q_bytes = sum(w.nbytes for _, w in quantized)
    bf16_bytes = sum(int(np.prod(w.shape)) * 2 for _, w in quantized)
    total, dense_total = (sum(device_bytes(p).values()) for p in (resident, at_load))
    assert total == dense_total - bf16_bytes + q_bytes


rows_step = jax.jit(lambda p, b, t: batch_ops.forward_rows(p, b, t, CFG)[0])


def logits_on_every_path(params) -> list[np.ndarray]:
    """Logits from every path that reads the weights: a prefill chunk (all experts at
    once), one decode step (the selected experts one by one), the batched step (each
    selected expert once) and the head."""
    state, _ = prefill(params, init_state(CFG, 128), list(range(7, 7 + 70)), CFG,
                       chunk_sizes=(64,))  # fmt: skip
    stepped = decode_step(params, state, jnp.int32(11), CFG)
    batch = batch_ops.insert(batch_ops.empty_batch(CFG, 128, 2), np.int32(0), state)
    batch = batch_ops.insert(batch, np.int32(1), stepped)
    rows = rows_step(params, batch, jnp.array([5, 9], jnp.int32))
    return [np.asarray(x.logits) for x in (state, stepped, rows)]


def test_logits_equal_the_dequantize_at_load_path(both: tuple) -> None:
    for a, b in zip(*map(logits_on_every_path, both), strict=True):
        assert np.abs(a - b).max() <= 1e-5, np.abs(a - b).max()


def test_dequantize_matches_the_numpy_reader_on_partial_blocks() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(200, 300)).astype(np.float32)
    q, s = official.quantize_fp8(w)
    got = dequantize(QWeight(jnp.asarray(q), jnp.asarray(s.view(np.uint8)), official.FP8_BLOCK))
    np.testing.assert_array_equal(np.asarray(got), official.dequantize_fp8(q, s))
    packed, s4 = official.quantize_fp4(w[:, :256])
    q4 = QWeight(jnp.asarray(packed.view(np.uint8)), jnp.asarray(s4.view(np.uint8)), (1, 32))
    want = official.dequantize_fp4(packed, s4)
    np.testing.assert_array_equal(np.asarray(dequantize(q4)), want)
    # the product never interleaves the codes back: even and odd columns apart
    x = rng.normal(size=(3, 256)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), q4)), x @ want.T,
                               rtol=1e-5, atol=1e-4)  # fmt: skip


def test_e2m1_decodes_every_code_as_ml_dtypes() -> None:
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(e2m1(jnp.asarray(codes))), want)


def test_fp4_experts_keep_only_the_experts_and_give_the_f32_logits(release: Path) -> None:
    """`--weights fp4-experts` (issue 27: as many expert bits as llama.cpp's MXFP4 GGUF):
    the routed experts packed, every other weight f32, and the f32 model's logits on every
    path that reads experts (the prefill's chunk, one decode step, the batched step)."""
    _, at_load = official.load_official_checkpoint(release, CFG, dtype=jnp.float32)
    _, fp4 = official.load_official_checkpoint(release, CFG, dtype=jnp.float32,
                                               resident={"fp4"})  # fmt: skip
    kept = [path_name(k) for k, w in jax.tree_util.tree_leaves_with_path(fp4, is_leaf=is_quantized)
            if is_quantized(w)]  # fmt: skip
    assert kept and all(official.leaf_kind(n) == "fp4" for n in kept)
    assert fp4["head"].dtype == jnp.float32
    for a, b in zip(*map(logits_on_every_path, (at_load, fp4)), strict=True):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), np.abs(a - b).max()


def test_fp8_needs_the_official_layout(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="official layout"):
        load_model(None, "tiny", weights="fp8", load_tokenizer=load_tokenizer)
    from ds4jax.weights.checkpoint import save_params

    save_params(init_params(CFG, 0), CFG, tmp_path / "orbax")
    with pytest.raises(CheckpointError, match="official layout, not orbax"):
        load_model(tmp_path / "orbax", weights="fp8", load_tokenizer=load_tokenizer)


def test_fp4_experts_hold_in_bf16_what_is_exactly_bf16(release: Path) -> None:
    """`load_model(weights="fp4-experts")` holds the release's BF16 (and power-of-two-scaled
    FP8) matrices in bf16: the f32 logits bit for bit on every path, in fewer bytes."""
    from ds4jax.model.quantized import hold_bf16_where_exact
    from ds4jax.plan import weight_bytes_per_device

    _, f32 = official.load_official_checkpoint(release, CFG, dtype=jnp.float32,
                                               resident={"fp4"})  # fmt: skip
    _, held, _, _ = load_model(release, weights="fp4-experts", load_tokenizer=load_tokenizer)
    assert held["head"].dtype == jnp.bfloat16 and held["norm"].dtype == jnp.float32
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
    assert nbytes(held) < 0.7 * nbytes(f32)
    assert nbytes(held) == weight_bytes_per_device(CFG, 1, 1, "fp4-experts")  # `ds4jax plan`
    for a, b in zip(*map(logits_on_every_path, (f32, held)), strict=True):
        np.testing.assert_array_equal(a, b)
    exact, inexact = jnp.ones((4, 8)), jnp.full((4, 8), 1 + 2.0**-12)
    got = hold_bf16_where_exact({"a": exact, "b": inexact, "v": jnp.ones(8)})
    assert [got[k].dtype for k in "abv"] == [jnp.bfloat16, jnp.float32, jnp.float32]
