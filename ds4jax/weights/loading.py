"""Loading a safetensors checkpoint into the parameter pytree.

Reads transformers' `save_pretrained` output for `DeepseekV4ForCausalLM` (one file or
sharded with `model.safetensors.index.json`). A missing, unknown or mis-shaped tensor is a
`CheckpointError` naming it: a silently skipped tensor would leave random weights behind.
The official FP8/FP4 release layout is handled by `ds4jax.weights.official` through the same
name table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from ds4jax.config import Config, load_config
from ds4jax.model import quantized
from ds4jax.model.params import Params, param_shapes, path_name
from ds4jax.weights import names


class CheckpointError(ValueError):
    pass


def safetensor_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({directory / f for f in weight_map.values()})
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {directory}")
    return files


class TensorSource:
    """name → numpy array over a set of safetensors files, opened lazily."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="numpy") as h:
                for k in h.keys():
                    self._where[k] = f
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        self.used.add(name)
        with safe_open(str(self._where[name]), framework="numpy") as h:
            return h.get_tensor(name)


def _first(src: TensorSource, cands: list[str], what: str) -> str:
    for c in cands:
        if c in src:
            return c
    raise CheckpointError(f"missing tensor for {what}: expected one of {cands[:2]}")


def assemble(
    cfg: Config,
    src: TensorSource,
    read: Callable[[str], np.ndarray],
    dtype: Any = jnp.float32,
    ignore: Callable[[str], bool] = names.is_ignored,
    mtp_layers: int = 0,
) -> Params:
    """Build the pytree leaf by leaf with `read(name)`; check shapes; reject leftovers.
    `mtp_layers`: the multi-token-prediction blocks read too (`params["mtp"]`)."""
    shapes = param_shapes(cfg, dtype, mtp_layers)

    def load(path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        p = path_name(path)
        if names.split_block(p)[1] in names.EXPERT_LEAVES:
            parts = [
                read(_first(src, names.expert_candidates(p, e), f"{p}[expert {e}]"))
                for e in range(cfg.num_experts)
            ]
            arr = quantized.stack(parts) if quantized.is_quantized(parts[0]) else np.stack(parts)
        else:
            arr = read(_first(src, names.candidates(p), p))
        if tuple(arr.shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"tensor for {p} has shape {tuple(arr.shape)}, config expects {leaf.shape}"
            )
        if quantized.is_quantized(arr):  # kept in its own formats (`--weights fp8`)
            return quantized.to_device(arr)
        return jnp.asarray(arr, dtype=leaf.dtype)

    params = jax.tree_util.tree_map_with_path(load, shapes)
    unknown = sorted(n for n in src.names() - src.used if not ignore(n))
    if unknown:
        more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
        raise CheckpointError(f"unknown tensors in checkpoint: {unknown[:5]}{more}")
    return params


def load_hf_checkpoint(
    directory: str | Path, cfg: Config | None = None, dtype: Any = jnp.float32
) -> tuple[Config, Params]:
    """A transformers `save_pretrained` directory → (config, params)."""
    directory = Path(directory)
    cfg = cfg or load_config(directory)
    src = TensorSource(safetensor_files(directory))

    def read(name: str) -> np.ndarray:
        a = src.get(name)
        return a.astype(np.int32) if name.endswith("tid2eid") else a.astype(np.float32)

    return cfg, assemble(cfg, src, read, dtype)
