"""The parameter pytree: its shapes, a deterministic random init, and the checkpoint name of
every leaf.

Leaves are stored `[out, in]` like the checkpoints; routed experts are stacked
(`w1`/`w3` [E, F, D], `w2` [E, D, F]). Names follow the official release
(`layers.L.attn.wq_a.weight`, …) so both loaders map onto one table.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config

Params = dict[str, Any]


def _attn_shapes(cfg: Config, layer: int) -> dict[str, Any]:
    D, H, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    G, R = cfg.o_groups, cfg.o_lora_rank
    a: dict[str, Any] = {
        "wq_a": (cfg.q_lora_rank, D),
        "q_norm": (cfg.q_lora_rank,),
        "wq_b": (H * hd, cfg.q_lora_rank),
        "wkv": (hd, D),
        "kv_norm": (hd,),
        "attn_sink": (H,),
        "wo_a": (G * R, (H // G) * hd),
        "wo_b": (D, G * R),
    }
    kind = cfg.layer_kind(layer)
    if kind != "sliding":
        r = cfg.compress_ratios[layer]
        c = 2 if kind == "csa" else 1
        a["compressor"] = {
            "wkv": (c * hd, D),
            "wgate": (c * hd, D),
            "ape": (r, c * hd),
            "norm": (hd,),
        }
    if kind == "csa":
        ihd = cfg.index_head_dim
        a["indexer"] = {
            "wq_b": (cfg.index_heads * ihd, cfg.q_lora_rank),
            "weights_proj": (cfg.index_heads, D),
            "compressor": {
                "wkv": (2 * ihd, D),
                "wgate": (2 * ihd, D),
                "ape": (cfg.compress_ratios[layer], 2 * ihd),
                "norm": (ihd,),
            },
        }
    return a


def _ffn_shapes(cfg: Config, layer: int) -> dict[str, Any]:
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    f: dict[str, Any] = {"gate": (E, D), "w1": (E, F, D), "w2": (E, D, F), "w3": (E, F, D)}
    if cfg.hash_layers[layer]:
        f["tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), jnp.int32)
    else:
        f["gate_bias"] = (E,)
    if cfg.num_shared_experts:
        f |= {"shared_w1": (F, D), "shared_w2": (D, F), "shared_w3": (F, D)}
    return f


def param_shapes(cfg: Config, dtype: Any = jnp.float32, mtp_layers: int = 0) -> Params:
    """The pytree of `jax.ShapeDtypeStruct`s. tid2eid is int32 whatever `dtype` is. With
    `mtp_layers`, the release's multi-token-prediction blocks under `mtp` (a checkpoint
    that ships them; the model's own forward never reads them)."""
    D, hc = cfg.hidden_size, cfg.hc_mult
    mix = (2 + hc) * hc

    def leafify(tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: leafify(v) for k, v in tree.items()}
        if isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[0], tuple):
            return jax.ShapeDtypeStruct(tree[0], tree[1])
        return jax.ShapeDtypeStruct(tree, dtype)

    def layer(cfg: Config, i: int) -> dict[str, Any]:
        return {
            "attn_norm": (D,),
            "ffn_norm": (D,),
            "hc_attn_fn": (mix, hc * D),
            "hc_attn_base": (mix,),
            "hc_attn_scale": (3,),
            "hc_ffn_fn": (mix, hc * D),
            "hc_ffn_base": (mix,),
            "hc_ffn_scale": (3,),
            "attn": _attn_shapes(cfg, i),
            "ffn": _ffn_shapes(cfg, i),
        }

    head = {"norm": (D,), "hc_head_fn": (hc, hc * D), "hc_head_base": (hc,), "hc_head_scale": (1,)}
    tree = {"embed": (cfg.vocab_size, D), "head": (cfg.vocab_size, D), **head}
    out = leafify(tree)
    out["layers"] = tuple(leafify(layer(cfg, i)) for i in range(cfg.num_layers))
    if mtp_layers:
        # §2.9: the next token's embedding and the last layer's streams in, one block, its
        # own hyper-connection head and norm; the embedding and head are the model's
        mtp = {**layer(cfg.mtp_block(), 0), **head,
               "e_proj": (D, D), "h_proj": (D, D), "enorm": (D,), "hnorm": (D,)}  # fmt: skip
        out["mtp"] = tuple(leafify(mtp) for _ in range(mtp_layers))
    return out


def _init_leaf(
    name: str, shape: tuple[int, ...], dtype: Any, rng: np.random.Generator, cfg: Config
):
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # distinct experts per token, as a trained table has
        keys = rng.random((shape[0], cfg.num_experts))
        return np.argsort(keys, axis=1)[:, : shape[1]].astype(np.int32)
    if leaf in ("attn_norm", "ffn_norm", "q_norm", "kv_norm", "norm", "enorm", "hnorm"):
        out = 1.0 + 0.1 * rng.standard_normal(shape)
    elif leaf.endswith("_scale"):
        out = 0.5 + 0.5 * rng.random(shape)
    elif leaf.endswith("_base") or leaf in ("attn_sink", "gate_bias", "ape"):
        out = 0.5 * rng.standard_normal(shape)
    elif leaf == "embed":
        out = rng.standard_normal(shape, dtype=np.float32)
    else:
        out = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
    return np.asarray(out, dtype=np.float32)


def init_params(cfg: Config, seed: int = 0, dtype: Any = jnp.float32,
                mtp_layers: int = 0) -> Params:  # fmt: skip
    """Deterministic random weights: the same (cfg, seed) gives the same params on any
    machine and device count. Each leaf has its own generator seeded from (seed, leaf path),
    so adding a layer does not change the others. NumPy, not jax.random: no compile per
    leaf shape, which made startup of the embedded model slow."""
    shapes = param_shapes(cfg, dtype, mtp_layers)

    def make(path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = path_name(path)
        rng = np.random.default_rng([seed, _stable_hash(name)])
        return jnp.asarray(_init_leaf(name, leaf.shape, leaf.dtype, rng, cfg), dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(make, shapes)


def _stable_hash(s: str) -> int:
    h = 2166136261
    for b in s.encode():
        h = ((h ^ b) * 16777619) & 0x7FFFFFFF
    return h


def path_name(path: tuple) -> str:
    """`layers.3.attn.compressor.wkv` for a tree path."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return ".".join(parts)
