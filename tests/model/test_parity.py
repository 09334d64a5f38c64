"""Logits parity with an independent implementation: transformers' DeepseekV4ForCausalLM.

Tiny random models saved with `save_pretrained` and read by our loader; float32,
quantization simulation off (transformers has none). Every position of a sequence that
crosses the sliding window and many compression boundaries must agree within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from ds4jax.model.forward import prefill
from ds4jax.model.state import init_state
from ds4jax.weights.loading import load_hf_checkpoint
from tests.model import hf_reference

#: the independent reference checks the programs as served (`tests/conftest.py`)
pytestmark = pytest.mark.optimized


@pytest.mark.parametrize("name", sorted(hf_reference.CONFIGS))
def test_logits_match_transformers_at_every_position(name: str, tmp_path: Path) -> None:
    model = hf_reference.build(name, tmp_path)
    cfg, params = load_hf_checkpoint(tmp_path)
    assert not cfg.quant_sim
    kinds = set(cfg.attn_types)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 70)
    ref = hf_reference.reference_logits(model, tokens)
    _, ours = prefill(params, init_state(cfg, 96), tokens, cfg, all_logits=True)
    err = np.abs(np.asarray(ours) - ref)
    assert err.max() <= 1e-4, f"{name} ({kinds}): max |Δlogit| {err.max():.2e}"


def test_the_reference_checks_the_programs_as_served() -> None:
    """The suite compiles unoptimized (`tests/conftest.py`); this module must not."""
    assert jax.config.read("jax_disable_most_optimizations") is False
