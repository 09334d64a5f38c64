"""Each Pallas kernel (interpret mode on CPU) against its jnp twin, and the whole model with
the attention switch flipped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4jax.model.forward import prefill
from ds4jax.model.params import init_params
from ds4jax.model.state import init_state
from ds4jax.pallas_kernels.indexer_scores import indexer_scores, indexer_scores_reference
from ds4jax.pallas_kernels.sink_attention import (
    BlockSizes,
    sink_attention,
    sink_attention_reference,
)
from ds4jax.pallas_kernels.sparse_attention import BlockSizes as SparseBlocks
from ds4jax.pallas_kernels.sparse_attention import sparse_attention, sparse_attention_reference
from tests.model.conftest import small_config

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _arrays(seed: int, *shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)]


def _close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    assert np.array_equal(np.isinf(a), np.isinf(b))
    fin = np.isfinite(b)
    assert np.abs(a[fin] - b[fin]).max(initial=0.0) <= tol


@SETTINGS
@given(
    T=st.sampled_from([1, 3, 8, 17]),
    K=st.sampled_from([1, 7, 31, 129, 200]),  # around block and window boundaries
    H=st.sampled_from([1, 4]),
    density=st.sampled_from([0.0, 0.3, 1.0]),  # 0.0: only the sink (empty key sets)
    blocks=st.sampled_from(
        [
            BlockSizes(8, 128),
            BlockSizes(2, 16),
            BlockSizes(5, 7),
            BlockSizes(2, 16, block_h=2, num_splits=3),  # head blocks, key ranges merged
            BlockSizes(1, 8, block_h=1, num_splits=40),
        ]
    ),
    seed=st.integers(0, 3),
)
def test_sink_attention_matches_its_twin(T, K, H, density, blocks, seed) -> None:
    q, k, s = _arrays(seed, (T, H, 32), (K, 32), (H,))
    mask = jax.random.bernoulli(jax.random.key(seed + 9), density, (T, K))
    out = sink_attention(q, k, mask, s, block_sizes=blocks, interpret=True)
    _close(out, sink_attention_reference(q, k, mask, s))


@SETTINGS
@given(
    T=st.sampled_from([1, 4, 9]),
    C=st.sampled_from([1, 5, 130]),
    IH=st.sampled_from([1, 16]),
    density=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 3),
)
def test_indexer_scores_match_their_twin(T, C, IH, density, seed) -> None:
    q, w, rows = _arrays(seed, (T, IH, 32), (T, IH), (C, 32))
    visible = jax.random.bernoulli(jax.random.key(seed + 5), density, (T, C))
    _close(
        indexer_scores(q, w, rows, visible, interpret=True),
        indexer_scores_reference(q, w, rows, visible),
    )


@SETTINGS
@given(
    T=st.sampled_from([1, 3, 6]),
    Kr=st.sampled_from([1, 9, 40]),
    C=st.sampled_from([1, 6, 50]),
    k=st.sampled_from([1, 4]),
    density=st.sampled_from([0.0, 0.6]),
    blocks=st.sampled_from([None, SparseBlocks(block_h=2, block_k=8, block_sel=3)]),
    seed=st.integers(0, 3),
)
def test_sparse_attention_matches_its_twin(T, Kr, C, k, density, blocks, seed) -> None:
    q, keys, rows, sink = _arrays(seed, (T, 4, 32), (Kr, 32), (C, 32), (4,))
    mask = jax.random.bernoulli(jax.random.key(seed + 1), density, (T, Kr))
    idx = jax.random.randint(jax.random.key(seed + 2), (T, k), 0, C)  # duplicates allowed
    valid = jax.random.bernoulli(jax.random.key(seed + 3), 0.7, (T, k))
    _close(
        sparse_attention(q, keys, mask, rows, idx, valid, sink, block_sizes=blocks, interpret=True),
        sparse_attention_reference(q, keys, mask, rows, idx, valid, sink),
    )


def test_whole_model_logits_with_the_switch_flipped() -> None:
    toks = np.random.default_rng(0).integers(0, 512, 37)
    # max_len 64 attends through the CSA selection mask; 1400 gives enough compressed rows
    # that CSA gathers each query's picks (the sparse kernel)
    for max_len in (64, 1400):
        outs = []
        for impl in ("xla", "pallas"):
            cfg = small_config(quant_sim=False, attention_impl=impl)
            params = init_params(cfg, seed=11)
            _, logits = prefill(
                params, init_state(cfg, max_len), toks, cfg, chunk_sizes=(16,), all_logits=True
            )
            outs.append(np.asarray(logits))
        assert np.abs(outs[0] - outs[1]).max() <= 1e-5, max_len


def test_auto_uses_the_twins_on_cpu() -> None:
    from ds4jax.pallas_kernels import select

    assert select("auto", "sink_attention") is sink_attention_reference
    assert jnp.asarray(0).device.platform == "cpu"


def test_kernels_lower_to_triton_for_gpu(monkeypatch) -> None:
    """Cross-lowering on CPU (no GPU needed): each kernel becomes a Triton custom call on
    V4-sized and on odd small shapes, so Triton's shape rules (power-of-two blocks) and
    its missing primitives are caught here rather than on a borrowed GPU. Compiling the
    Triton IR (shared memory, registers) still needs the device: check_device.py."""
    import sys

    for name in ("sink_attention", "indexer_scores", "sparse_attention"):
        monkeypatch.setattr(sys.modules[f"ds4jax.pallas_kernels.{name}"], "on_gpu", lambda: True)
    S, f32 = jax.ShapeDtypeStruct, jnp.float32

    def lower(fn, *avals) -> str:
        try:
            return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
        except RuntimeError as e:  # jax >= 0.11 wants a GPU (or an abstract one) to lower
            if "GPU" in str(e):
                pytest.skip(f"cannot lower for cuda here: {e}")
            raise

    texts = []
    for T, H, D, K in [(1, 64, 512, 16513), (256, 64, 512, 1152), (3, 4, 64, 21)]:
        avals = S((T, H, D), f32), S((K, D), f32), S((T, K), bool), S((H,), f32)
        texts.append(lower(sink_attention, *avals))
    for T, IH, d, C in [(1, 64, 128, 16384), (3, 16, 32, 21)]:
        avals = S((T, IH, d), f32), S((T, IH), f32), S((C, d), f32), S((T, C), bool)
        texts.append(lower(indexer_scores, *avals))
    for T, H, D, Kr, C, k in [(2, 64, 512, 130, 16384, 512), (3, 4, 64, 19, 400, 5)]:
        avals = (S((T, H, D), f32), S((Kr, D), f32), S((T, Kr), bool), S((C, D), f32),
                 S((T, k), jnp.int32), S((T, k), bool), S((H,), f32))  # fmt: skip
        texts.append(lower(sparse_attention, *avals))
    assert all("triton" in t for t in texts)


def test_the_device_check_needs_nothing_above_the_kernels() -> None:
    """`check_device.py` runs on a borrowed accelerator with only the kernels: the model,
    config and serving stack are never imported (the whole-model timing lives in
    `bench/device_model.py`)."""
    import subprocess
    import sys

    code = (
        "import sys, ds4jax.pallas_kernels.check_device\n"
        "above = sorted(m for m in sys.modules if m.startswith('ds4jax.') and not "
        "m.startswith('ds4jax.pallas_kernels'))\n"
        "print(above)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # nor later, inside a function
    from pathlib import Path

    import ds4jax.pallas_kernels.check_device as check_device

    src = Path(check_device.__file__).read_text()
    assert "from ds4jax.model" not in src and "from ds4jax.config" not in src
