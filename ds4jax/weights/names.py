"""Checkpoint tensor names for every parameter leaf.

Both layouts we read use DeepSeek's official names (`layers.L.attn.wq_a.weight`, …);
transformers' `save_pretrained` writes them too, under a `model.` prefix for some, with
`embed_tokens` for the embedding, `hc_head.hc_*` for the head mixer and `attn.norm` for the
KV norm. Each leaf lists its accepted spellings, first match wins.
"""

from __future__ import annotations

_SIMPLE = {
    "embed": ["embed.weight", "model.embed_tokens.weight", "embed_tokens.weight"],
    "head": ["head.weight", "lm_head.weight"],
    "norm": ["norm.weight", "model.norm.weight"],
    "hc_head_fn": ["hc_head_fn", "model.hc_head.hc_fn", "hc_head.hc_fn"],
    "hc_head_base": ["hc_head_base", "model.hc_head.hc_base", "hc_head.hc_base"],
    "hc_head_scale": ["hc_head_scale", "model.hc_head.hc_scale", "hc_head.hc_scale"],
}

# path inside a layer → name inside `layers.L.` (a `.weight` suffix where the tensor is one)
_LAYER = {
    "attn_norm": "attn_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "hc_attn_fn": "hc_attn_fn",
    "hc_attn_base": "hc_attn_base",
    "hc_attn_scale": "hc_attn_scale",
    "hc_ffn_fn": "hc_ffn_fn",
    "hc_ffn_base": "hc_ffn_base",
    "hc_ffn_scale": "hc_ffn_scale",
    "attn.wq_a": "attn.wq_a.weight",
    "attn.q_norm": "attn.q_norm.weight",
    "attn.wq_b": "attn.wq_b.weight",
    "attn.wkv": "attn.wkv.weight",
    "attn.kv_norm": "attn.kv_norm.weight|attn.norm.weight",
    "attn.attn_sink": "attn.attn_sink",
    "attn.wo_a": "attn.wo_a.weight",
    "attn.wo_b": "attn.wo_b.weight",
    "attn.compressor.wkv": "attn.compressor.wkv.weight",
    "attn.compressor.wgate": "attn.compressor.wgate.weight",
    "attn.compressor.ape": "attn.compressor.ape",
    "attn.compressor.norm": "attn.compressor.norm.weight",
    "attn.indexer.wq_b": "attn.indexer.wq_b.weight",
    "attn.indexer.weights_proj": "attn.indexer.weights_proj.weight",
    "attn.indexer.compressor.wkv": "attn.indexer.compressor.wkv.weight",
    "attn.indexer.compressor.wgate": "attn.indexer.compressor.wgate.weight",
    "attn.indexer.compressor.ape": "attn.indexer.compressor.ape",
    "attn.indexer.compressor.norm": "attn.indexer.compressor.norm.weight",
    "ffn.gate": "ffn.gate.weight",
    "ffn.gate_bias": "ffn.gate.bias",
    "ffn.tid2eid": "ffn.gate.tid2eid",
    "ffn.shared_w1": "ffn.shared_experts.w1.weight",
    "ffn.shared_w2": "ffn.shared_experts.w2.weight",
    "ffn.shared_w3": "ffn.shared_experts.w3.weight",
}

#: Routed experts are stored one tensor per expert and stacked on load.
EXPERT_LEAVES = {"ffn.w1": "w1", "ffn.w2": "w2", "ffn.w3": "w3"}

#: the MTP block's own leaves (`mtp.D.` then the name; the rest of it is named as a layer)
_MTP = {
    "e_proj": "e_proj.weight",
    "h_proj": "h_proj.weight",
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "norm": "norm.weight",
    "hc_head_fn": "hc_head_fn",
    "hc_head_base": "hc_head_base",
    "hc_head_scale": "hc_head_scale",
}


def split_block(path: str) -> tuple[str, str]:
    """(`layers.L` or `mtp.D`, the path inside it) for a block's leaf; ("", path) else."""
    if path.startswith(("layers.", "mtp.")):
        kind, index, rest = path.split(".", 2)
        return f"{kind}.{index}", rest
    return "", path


def candidates(path: str) -> list[str]:
    """Checkpoint names for a leaf path like `layers.3.attn.wq_a` (not for experts)."""
    if path in _SIMPLE:
        return list(_SIMPLE[path])
    block, rest = split_block(path)
    if block.startswith("mtp.") and rest in _MTP:
        return [f"{block}.{_MTP[rest]}"]
    names = _LAYER[rest].split("|")
    return [f"{pre}{block}.{n}" for n in names for pre in ("", "model.")]


def expert_candidates(path: str, expert: int) -> list[str]:
    block, rest = split_block(path)
    w = EXPERT_LEAVES[rest]
    return [f"{pre}{block}.ffn.experts.{expert}.{w}.weight" for pre in ("", "model.")]


def is_ignored(name: str) -> bool:
    """Tensors a checkpoint may carry that the model does not use (MTP drafts, unless
    asked for: `load_official_checkpoint(mtp=True)`)."""
    return name.startswith(("mtp.", "model.mtp."))
