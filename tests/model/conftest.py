from __future__ import annotations

import pytest

from ds4jax.config import Config, Yarn


def small_config(**overrides) -> Config:
    """Every layer kind with a small window and small ratios, so ~80 tokens cross the
    window and many compression boundaries."""
    base = dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=5,
        num_heads=4,
        head_dim=64,
        rope_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        sliding_window=8,
        compress_ratios=(0, 4, 8, 4, 8),
        hash_layers=(True, True, False, False, False),
        index_heads=16,
        index_head_dim=64,
        index_topk=5,
        yarn=Yarn(factor=16, original_max_position=64),
        max_position_embeddings=4096,
    )
    base.update(overrides)
    return Config(**base)


@pytest.fixture(scope="session")
def small_cfg() -> Config:
    return small_config()
