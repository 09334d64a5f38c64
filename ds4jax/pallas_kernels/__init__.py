"""Pallas kernels, each beside its pure-jnp twin, and the one place that picks between them.

`Config.attention_impl`: "xla" (the twins), "pallas" (the kernels; interpreted on CPU, for
tests), "auto" (per op, whichever is the better choice on the platform). On an H200
(bench/results/kernels-h200-*.json) only the indexer kernel beats XLA (1.2–1.7×); the two
attention kernels lose to XLA's fused einsums on prefill chunks (TF32 dots with 16–32 rows
per program and float32 keys in shared memory) and tie on decode, so "auto" takes the
twins for them there. On TPU "auto" takes the dense kernels (not measured yet) and the
twin for the sparse gather, which has no Mosaic TPU lowering. On CPU interpreted Pallas
lowers to the same XLA at best, so "auto" takes the twins.

Attention over pages (`paged_attention`) reads the page table through scalar prefetch,
which only Mosaic TPU implements: on TPU "auto" takes the kernel (its twin copies every
page the table names, visible or not, into a dense array on each call; the kernel DMAs only
the visible pages; it lowers to Mosaic in `tests/pallas_kernels`, not yet compiled or
timed on a TPU); on GPU the twin, since neither Triton nor Mosaic GPU lowers scalar
prefetch (jax 0.10), and "pallas" there raises `NotImplementedError` for it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from ds4jax.pallas_kernels.indexer_scores import indexer_scores, indexer_scores_reference
from ds4jax.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from ds4jax.pallas_kernels.sink_attention import sink_attention, sink_attention_reference
from ds4jax.pallas_kernels.sparse_attention import sparse_attention, sparse_attention_reference

_OPS = {
    "sink_attention": (sink_attention, sink_attention_reference),
    "sparse_attention": (sparse_attention, sparse_attention_reference),
    "indexer_scores": (indexer_scores, indexer_scores_reference),
    "paged_attention": (paged_attention, paged_attention_reference),
}

#: the ops "auto" runs as kernels, per platform (others get their twins)
AUTO_KERNELS = {
    "gpu": frozenset({"indexer_scores"}),
    "tpu": frozenset({"sink_attention", "indexer_scores", "paged_attention"}),
}


def select(impl: str, op: str) -> Any:
    kernel, reference = _OPS[op]
    platform = jax.default_backend()
    if impl == "xla" or (impl == "auto" and op not in AUTO_KERNELS.get(platform, ())):
        return reference
    if impl in ("pallas", "auto"):
        return partial(kernel, interpret=platform == "cpu")
    raise ValueError(f"attention_impl must be xla, pallas or auto, not {impl!r}")
