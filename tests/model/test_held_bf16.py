"""`--weights fp4-experts` holds in bf16 what is exactly bf16 (issue 16's resident formats):
the f32 logits bit for bit on every path. Compiled as served (`optimized`): the suite's
unoptimized programs with XLA:CPU's older emitters give a chunk's logits 7e-7 apart between
the two weight sets once its hyper-connection sums are written as adds
(`model.layers._stream_sum`, `_hc_total`; either alone does it) — code for the adds that
depends on the fusions around them, not traced further — where the programs as served
hold them bit for bit (measured on a 512-token chunk too)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.chat.tokenizer import load_tokenizer
from ds4jax.weights import official
from ds4jax.weights.checkpoint import load_model
from tests.model import test_quantized
from tests.model.test_quantized import CFG, logits_on_every_path

pytestmark = pytest.mark.optimized
release = test_quantized.release  # the fixture: this module's own written release


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
