"""The model identity a checkpoint is valid for: a state computed by one model must never be
served to another. Cheap to compute at startup, even for the full model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ds4jax.config import Config

#: leaves whose leading bytes are hashed (evenly spread over the flattened tree)
SAMPLED_LEAVES = 8
#: elements read from each sampled leaf: the start of its first row, a tiny device read
SAMPLED_ELEMENTS = 256


def params_identity(params: Any) -> str:
    """sha1 over every leaf's path, shape and dtype, plus the first few values of a handful of
    leaves. Distinguishes seeds, checkpoints and quantizations without reading gigabytes."""
    h = hashlib.sha1()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in flat:
        shape = getattr(leaf, "shape", ())
        dtype = getattr(leaf, "dtype", type(leaf).__name__)
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(shape)}:{dtype};".encode())
    if flat:
        step = max(1, len(flat) // SAMPLED_LEAVES)
        picks = sorted({*range(0, len(flat), step), len(flat) - 1})
        leaves = [flat[i][1] for i in picks]
        arrays = [x for x in leaves if hasattr(x, "shape")]
        samples = iter(_samples(arrays))
        for x in leaves:
            if not hasattr(x, "shape"):
                h.update(repr(x).encode())
                continue
            h.update(np.asarray(next(samples)).tobytes())
    return h.hexdigest()


def _sample(x: Any) -> Any:
    """The start of a leaf's first row."""
    while getattr(x, "ndim", 0) > 1:
        x = x[0]
    return x[:SAMPLED_ELEMENTS] if getattr(x, "ndim", 0) == 1 else x


def _samples(arrays: list[Any]) -> list[Any]:
    """`_sample` of each; over params split across processes, in one program whose result
    every process holds whole (a collective: every process of the group computes the
    identity alike)."""
    split = [x for x in arrays if not getattr(x, "is_fully_addressable", True)]
    if not split:
        return [_sample(x) for x in arrays]
    from jax.sharding import NamedSharding, PartitionSpec

    whole = NamedSharding(split[0].sharding.mesh, PartitionSpec())
    return jax.jit(lambda xs: [_sample(x) for x in xs], out_shardings=whole)(arrays)


def tokenizer_identity(tokenizer: Any) -> str:
    """sha1 of the tokenizer's file (`tokenizer.json` or the SentencePiece model), else of
    its class and vocabulary size."""
    path = getattr(tokenizer, "path", None)
    if path is not None and Path(path).is_file():
        return hashlib.sha1(Path(path).read_bytes()).hexdigest()
    size = getattr(tokenizer, "vocab_size", None)
    return hashlib.sha1(f"{type(tokenizer).__name__}:{size}".encode()).hexdigest()


def model_fingerprint(cfg: Config, params: Any, tokenizer: Any) -> str:
    """One sha1 over the config (`cfg.to_dict()`, which includes `quant_sim`), the params
    identity and the tokenizer hash."""
    doc = {
        "config": cfg.to_dict(),
        "quant_sim": cfg.quant_sim,
        "params": params_identity(params),
        "tokenizer": tokenizer_identity(tokenizer),
    }
    return hashlib.sha1(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()
