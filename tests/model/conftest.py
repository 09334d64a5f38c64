from __future__ import annotations

import numpy as np
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


def short_tiny(**overrides) -> Config:
    """The embedded `tiny` config (its real vocabulary, for the tokenizer) with one layer of
    each attention kind (sliding, CSA, HCA; hash- and learned-routed): for the 8-device
    scripts, whose SPMD programs no other test shares, so every layer compiles for them
    alone — half of tiny's six took 56 → 35 CPU-s of test_data_shards' script."""
    from ds4jax.config import load_config

    kinds = dict(num_layers=3, compress_ratios=(0, 4, 16), hash_layers=(True, True, False))
    return load_config("tiny").replace(attn_types=(), **kinds, **overrides)


@pytest.fixture(scope="session")
def small_cfg() -> Config:
    return small_config()


#: the tiny model's states the paged-state tests store and read back (`paged_states`)
PAGED_MAX_LEN = 1024
PAGED_CHUNKS = (64, 256)


@pytest.fixture(scope="session")
def paged_states() -> dict[str, object]:
    """A 600-token prompt's state, the live session 300 tokens further, a retry 50 tokens
    past the prompt (other tokens), each a dense state of the same capacity."""
    from ds4jax.config import load_config
    from ds4jax.model.forward import prefill
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    cfg = load_config("tiny")
    params = init_params(cfg, 0)
    rng = np.random.default_rng(1)
    prompt = rng.integers(10, cfg.vocab_size, 600)
    empty = init_state(cfg, PAGED_MAX_LEN)
    at_prompt, _ = prefill(params, empty, prompt, cfg, chunk_sizes=PAGED_CHUNKS)
    live, _ = prefill(params, at_prompt, rng.integers(10, cfg.vocab_size, 300), cfg,
                      chunk_sizes=PAGED_CHUNKS)  # fmt: skip
    retry, _ = prefill(params, at_prompt, rng.integers(10, cfg.vocab_size, 50), cfg,
                       chunk_sizes=PAGED_CHUNKS)  # fmt: skip
    return {"prompt": at_prompt, "live": live, "retry": retry}
