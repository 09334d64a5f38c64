"""Pallas kernels, each beside its pure-jnp twin, and the one place that picks between them.

`Config.attention_impl`: "xla" (the twins), "pallas" (the kernels; interpreted on CPU, for
tests), "auto" (kernels on TPU/GPU, twins on CPU, where interpreted Pallas lowers to the
same XLA at best).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from ds4jax.pallas_kernels.indexer_scores import indexer_scores, indexer_scores_reference
from ds4jax.pallas_kernels.sink_attention import sink_attention, sink_attention_reference
from ds4jax.pallas_kernels.sparse_attention import sparse_attention, sparse_attention_reference

_OPS = {
    "sink_attention": (sink_attention, sink_attention_reference),
    "sparse_attention": (sparse_attention, sparse_attention_reference),
    "indexer_scores": (indexer_scores, indexer_scores_reference),
}


def select(impl: str, op: str) -> Any:
    kernel, reference = _OPS[op]
    platform = jax.default_backend()
    if impl == "xla" or (impl == "auto" and platform == "cpu"):
        return reference
    if impl in ("pallas", "auto"):
        return partial(kernel, interpret=platform == "cpu")
    raise ValueError(f"attention_impl must be xla, pallas or auto, not {impl!r}")
