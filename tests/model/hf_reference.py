"""Tiny random transformers `DeepseekV4ForCausalLM` models: the independent reference.

Built in float32 with every parameter and buffer randomized (transformers' default tid2eid
is all zeros and its default init leaves many tensors trivial), saved with
`save_pretrained`, so the JAX side goes through the real loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

BASE: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=24,
    num_experts_per_tok=2,
    n_routed_experts=6,
    o_groups=2,
    o_lora_rank=16,
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=3,
    partial_rotary_factor=0.5,
    max_position_embeddings=1024,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

#: Three configs: together they cover sliding / CSA / HCA layers, hash and learned MoE,
#: YaRN on and off, indexer top-k smaller than the row count.
CONFIGS: dict[str, dict[str, Any]] = {
    "mixed": dict(
        BASE,
        num_hidden_layers=4,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    ),
    "flash_pattern": dict(
        BASE,
        num_hidden_layers=6,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3,
        index_topk=5,
    ),
    "hca_no_yarn": dict(
        {k: v for k, v in BASE.items() if k != "rope_parameters"},
        num_hidden_layers=3,
        layer_types=[
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",
        ],
        mlp_layer_types=["moe", "hash_moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
        sliding_window=5,
        index_topk=64,
    ),
}


def build(name: str | dict[str, Any], directory: Path, seed: int = 0):
    """`name`: one of `CONFIGS`, or a config of its own."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**(CONFIGS[name] if isinstance(name, str) else name))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            fan = p.shape[-1] if p.ndim > 1 else 1
            if p.ndim == 1 and ("norm" in pname or pname.endswith("weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / fan**0.5)
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                rows = [
                    torch.randperm(cfg.n_routed_experts, generator=g)[: b.shape[1]]
                    for _ in range(b.shape[0])
                ]
                b.copy_(torch.stack(rows))
            elif bname.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    model.save_pretrained(directory)
    return model


def reference_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor(tokens[None], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()
