"""A tiny random model for checkpoint tests, made without compiling anything, and the exact
comparison of two param trees they use.

Params come from numpy, not `init_params`: its first call compiles one random kernel per leaf
shape (~15 s here), which would dominate a checkpoint test's run time.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ds4jax.config import Config
from ds4jax.model.params import Params, param_shapes, path_name


def tiny_config(**overrides: Any) -> Config:
    """Dims that are multiples of 128 where FP8 blocks tile exactly; the vocab (300) and
    the indexer's weights_proj (4 rows) leave partial blocks."""
    base: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=256,
        num_layers=3,
        num_heads=4,
        head_dim=128,
        rope_dim=32,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        compress_ratios=(0, 4, 8),
        hash_layers=(True, False, False),
        index_heads=4,
        index_head_dim=64,
        index_topk=8,
        sliding_window=8,
        quant_sim=False,
    )
    base.update(overrides)
    return Config(**base)


def random_params(cfg: Config, seed: int = 0) -> Params:
    """Float32 numpy params with the same statistics as `init_params` (fast: no compiles)."""
    rng = np.random.default_rng(seed)

    def make(path: tuple, leaf: jax.ShapeDtypeStruct) -> np.ndarray:
        name = path_name(path).rsplit(".", 1)[-1]
        shape = leaf.shape
        if name == "tid2eid":
            rows = [rng.permutation(cfg.num_experts)[: shape[1]] for _ in range(shape[0])]
            return np.stack(rows).astype(np.int32)
        if name in ("attn_norm", "ffn_norm", "q_norm", "kv_norm", "norm"):
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith("_scale"):
            return (0.5 + 0.5 * rng.random(shape)).astype(np.float32)
        if name.endswith("_base") or name in ("attn_sink", "gate_bias", "ape"):
            return (0.5 * rng.standard_normal(shape)).astype(np.float32)
        if name == "embed":
            return rng.standard_normal(shape).astype(np.float32)
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    return jax.tree_util.tree_map_with_path(make, param_shapes(cfg))


def assert_same(a: Params, b: Params) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        assert x.dtype == y.dtype and x.shape == y.shape, path_name(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path_name(path))
