"""Model configuration: one frozen, hashable dataclass, usable as a static `jit` argument.

Readers for transformers' `deepseek_v4` `config.json` and for the official release's
`config.json`, and named configs under `configs/` (`tiny` is the embedded default).
Spec: shared/reference/deepseek-v4-model.md §1.1, §7.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

_LAYER_TYPE_TO_KIND = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True)
class Yarn:
    """YaRN on the compressed layers' RoPE, with no magnitude scaling (HF forces
    `attention_factor = 1`)."""

    factor: float = 16.0
    original_max_position: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_layers: int = 43
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    num_experts: int = 256
    num_experts_per_tok: int = 6
    num_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_eps: float = 1e-6
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    sliding_window: int = 128
    #: Per layer: compression ratio (0 for sliding-window-only layers).
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)
    #: Per layer: "sliding", "csa" (compressed sparse, with indexer) or "hca" (heavily
    #: compressed). Empty = derived from the ratios (0 sliding, csa_ratio csa, else hca).
    attn_types: tuple[str, ...] = ()
    #: Per layer: True = hash-routed MoE (tid2eid), False = learned top-k with bias.
    hash_layers: tuple[bool, ...] = (True,) * 3 + (False,) * 40
    csa_ratio: int = 4
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: Yarn | None = field(default_factory=Yarn)
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    #: FP8 KV simulation and Hadamard+FP4 indexer simulation: part of the official graph;
    #: off to compare with transformers, which implements neither.
    quant_sim: bool = True
    #: "xla" (jnp twins), "pallas" (kernels; interpreted on CPU), "auto" (per op, the
    #: faster measured choice per platform: twins on CPU). See ds4jax.pallas_kernels.
    attention_impl: str = "auto"
    #: how a stored row of the state is held (`model.pages`: f32, bf16, or fp8, the
    #: release's 584-byte record): every row is rounded to it as it is written, on every
    #: path, so a state is the same whether continued, prefilled cold or restored
    state_dtype: str = "f32"

    def __post_init__(self) -> None:
        n = self.num_layers
        if not self.attn_types:
            kinds = tuple(
                "sliding" if r == 0 else "csa" if r == self.csa_ratio else "hca"
                for r in self.compress_ratios
            )
            object.__setattr__(self, "attn_types", kinds)
        for i, (k, r) in enumerate(zip(self.attn_types, self.compress_ratios, strict=False)):
            if k not in ("sliding", "csa", "hca") or (k == "sliding") != (r == 0):
                raise ValueError(f"layer {i}: attention type {k!r} with compress ratio {r}")
        if (
            len(self.compress_ratios) != n
            or len(self.hash_layers) != n
            or len(self.attn_types) != n
        ):
            raise ValueError(
                f"compress_ratios ({len(self.compress_ratios)}) and hash_layers "
                f"({len(self.hash_layers)}) must have num_layers={n} entries"
            )
        if self.num_heads % self.o_groups:
            raise ValueError(f"num_heads={self.num_heads} not divisible by o_groups")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim={self.rope_dim} must be even and <= head_dim")
        if self.rope_dim > self.index_head_dim:
            raise ValueError("rope_dim must be <= index_head_dim")
        if self.index_head_dim & (self.index_head_dim - 1) and self.quant_sim:
            raise ValueError("the Hadamard indexer simulation needs a power-of-two index_head_dim")
        if self.state_dtype not in ("f32", "bf16", "fp8"):
            raise ValueError(f"state_dtype must be f32, bf16 or fp8, not {self.state_dtype!r}")
        if self.num_shared_experts not in (0, 1):
            raise ValueError("num_shared_experts must be 0 or 1")

    def layer_kind(self, layer: int) -> str:
        return self.attn_types[layer]

    def mtp_block(self) -> Config:
        """The multi-token-prediction block (spec §2.9, `mtp.0.*`) seen as a one-layer
        model: its compress ratio is 0 (sliding-window attention only: no compressor, no
        indexer, plain RoPE) and it routes by learned scores (no tid2eid)."""
        return dataclasses.replace(self, num_layers=1, compress_ratios=(0,),
                                   attn_types=("sliding",), hash_layers=(False,))  # fmt: skip

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["hash_layers"] = list(self.hash_layers)
        d["attn_types"] = list(self.attn_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        d = dict(d)
        d.pop("name", None)
        d.pop("description", None)
        if "yarn" in d and d["yarn"] is not None and not isinstance(d["yarn"], Yarn):
            d["yarn"] = Yarn(**d["yarn"])
        for k in ("compress_ratios", "hash_layers", "attn_types"):
            if k in d:
                d[k] = tuple(d[k])
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        return cls(**d)


jax.tree_util.register_static(Config)


def _yarn_from(rope: dict[str, Any] | None) -> Yarn | None:
    if not rope or rope.get("rope_type", rope.get("type")) != "yarn":
        return None
    return Yarn(
        factor=float(rope.get("factor", 16)),
        original_max_position=int(rope.get("original_max_position_embeddings", 65536)),
        beta_fast=float(rope.get("beta_fast", 32)),
        beta_slow=float(rope.get("beta_slow", 1)),
    )


def from_hf_config(d: dict[str, Any], *, quant_sim: bool = False) -> Config:
    """transformers' `deepseek_v4` config.json (`layer_types` or legacy `compress_ratios`,
    `compress_rates`, `mlp_layer_types`, nested or flat `rope_parameters`).

    quant_sim defaults to off here because a transformers checkpoint is usually compared
    against transformers, which has no quantization simulation."""
    n = int(d["num_hidden_layers"])
    rates = d.get("compress_rates") or {}
    csa = int(rates.get("compressed_sparse_attention", d.get("compress_rate_csa", 4)))
    hca = int(rates.get("heavily_compressed_attention", d.get("compress_rate_hca", 128)))
    if d.get("layer_types") is not None:
        kinds = [_LAYER_TYPE_TO_KIND[t] for t in d["layer_types"]][:n]
    elif d.get("compress_ratios") is not None:  # releases list MTP layers too: cut at n
        by_ratio = {0: "sliding", csa: "csa"}
        kinds = [by_ratio.get(int(r), "hca") for r in d["compress_ratios"]][:n]
    else:  # transformers' own default pattern (V4-Pro's)
        kinds = ["hca"] * min(n, 2) + ["csa" if i % 2 else "hca" for i in range(max(n - 2, 0))]
    ratios = [0 if k == "sliding" else csa if k == "csa" else hca for k in kinds]
    if d.get("mlp_layer_types") is not None:
        hashed = [t == "hash_moe" for t in d["mlp_layer_types"]]
    else:
        k = int(d.get("num_hash_layers", 3))
        hashed = [i < k for i in range(n)]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    compress_rope = rope.get("compress", rope) if isinstance(rope, dict) else {}
    head_dim = int(d.get("head_dim", 512))
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = int(d["qk_rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * float(d["partial_rotary_factor"]))
    else:
        rope_dim = 64
    if d.get("num_key_value_heads", 1) != 1:
        raise ValueError("DeepSeek V4 attention has exactly one shared KV head")
    return Config(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        num_layers=n,
        num_heads=int(d["num_attention_heads"]),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(d["q_lora_rank"]),
        o_groups=int(d["o_groups"]),
        o_lora_rank=int(d["o_lora_rank"]),
        num_experts=int(d["n_routed_experts"]),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        num_shared_experts=int(d.get("n_shared_experts", 1)),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)),
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        sliding_window=int(d.get("sliding_window", 128)),
        compress_ratios=tuple(ratios),
        attn_types=tuple(kinds),
        hash_layers=tuple(hashed),
        csa_ratio=csa,
        index_heads=int(d.get("index_n_heads", 64)),
        index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 512)),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        compress_rope_theta=float(d.get("compress_rope_theta", 160000.0)),
        yarn=_yarn_from(compress_rope if isinstance(compress_rope, dict) else None),
        max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
        bos_token_id=int(d.get("bos_token_id", 0) or 0),
        eos_token_id=int(d.get("eos_token_id", 1) or 1),
        quant_sim=quant_sim,
    )


def from_official_config(d: dict[str, Any], *, quant_sim: bool = True) -> Config:
    """The official release's `config.json` (DeepSeek's `inference/` ModelArgs names)."""
    n = int(d["n_layers"])
    ratios = [int(r) for r in d["compress_ratios"]][:n]
    k = int(d.get("n_hash_layers", 3))
    yarn = None
    if float(d.get("rope_factor", 1)) > 1:
        yarn = Yarn(
            factor=float(d["rope_factor"]),
            original_max_position=int(d["original_seq_len"]),
            beta_fast=float(d.get("beta_fast", 32)),
            beta_slow=float(d.get("beta_slow", 1)),
        )
    nonzero = sorted({r for r in ratios if r})
    return Config(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["dim"]),
        num_layers=n,
        num_heads=int(d["n_heads"]),
        head_dim=int(d["head_dim"]),
        rope_dim=int(d["rope_head_dim"]),
        q_lora_rank=int(d["q_lora_rank"]),
        o_groups=int(d["o_groups"]),
        o_lora_rank=int(d["o_lora_rank"]),
        num_experts=int(d["n_routed_experts"]),
        num_experts_per_tok=int(d["n_activated_experts"]),
        num_shared_experts=int(d.get("n_shared_experts", 1)),
        moe_intermediate_size=int(d["moe_inter_dim"]),
        routed_scaling_factor=float(d.get("route_scale", 1.5)),
        swiglu_limit=float(d.get("swiglu_limit", 10.0)),
        rms_eps=float(d.get("norm_eps", 1e-6)),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        sliding_window=int(d.get("window_size", 128)),
        compress_ratios=tuple(ratios),
        hash_layers=tuple(i < k for i in range(n)),
        csa_ratio=nonzero[0] if nonzero else 4,
        index_heads=int(d.get("index_n_heads", 64)),
        index_head_dim=int(d.get("index_head_dim", 128)),
        index_topk=int(d.get("index_topk", 512)),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        compress_rope_theta=float(d.get("compress_rope_theta", 160000.0)),
        yarn=yarn,
        max_position_embeddings=int(d.get("max_seq_len", 1048576)),
        quant_sim=quant_sim,
    )


def load_config(name_or_path: str | Path) -> Config:
    """A named config (`tiny`, `deepseek-v4-flash`, … from `configs/`), a JSON file in our
    format, or a checkpoint's `config.json` (transformers or official format)."""
    p = Path(name_or_path)
    if not p.exists():
        p = CONFIG_DIR / f"{name_or_path}.json"
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        names = sorted(q.stem for q in CONFIG_DIR.glob("*.json"))
        raise FileNotFoundError(f"no config {name_or_path!r} (named configs: {names})")
    d = json.loads(p.read_text(encoding="utf-8"))
    if d.get("model_type") == "deepseek_v4":
        # an FP8 release is DeepSeek's own graph: simulate its quantization by default
        return from_hf_config(d, quant_sim="quantization_config" in d)
    if "n_layers" in d and "dim" in d:
        return from_official_config(d)
    return Config.from_dict(d)


def to_hf_config(cfg: Config) -> dict[str, Any]:
    """The transformers `deepseek_v4` config.json for `cfg` (inverse of `from_hf_config`):
    used to build the transformers reference and to write checkpoints it can read."""
    kind_to_type = {v: k for k, v in _LAYER_TYPE_TO_KIND.items()}
    hca = sorted(
        {r for r, k in zip(cfg.compress_ratios, cfg.attn_types, strict=True) if k == "hca"}
    )
    rope: dict[str, Any] = {"rope_type": "default"}
    if cfg.yarn is not None:
        rope = {
            "rope_type": "yarn",
            "factor": cfg.yarn.factor,
            "original_max_position_embeddings": cfg.yarn.original_max_position,
            "beta_fast": cfg.yarn.beta_fast,
            "beta_slow": cfg.yarn.beta_slow,
        }
    if len(hca) > 1:
        raise ValueError("transformers supports one HCA ratio per model")
    return {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "rms_norm_eps": cfg.rms_eps,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "sliding_window": cfg.sliding_window,
        "layer_types": [kind_to_type[k] for k in cfg.attn_types],
        "compress_rates": {
            "compressed_sparse_attention": cfg.csa_ratio,
            "heavily_compressed_attention": hca[0] if hca else 128,
        },
        "mlp_layer_types": ["hash_moe" if h else "moe" for h in cfg.hash_layers],
        "index_n_heads": cfg.index_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": False,
    }
