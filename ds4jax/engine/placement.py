"""Where the engine's arrays live: every state one placement (replicated over the mesh, or
committed to the first device), the decode batch's rows and the page pool split along the
mesh's data axis.

Functions of the mesh alone, apart from the engine so the rules for a placement — and why a
state must have exactly one (`place_state`) — are read in one place.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np

from ds4jax.model.sharding import DATA_AXIS, batch_sharding, replicated


def on_host(tree: Any) -> Any:
    """Leaves this process holds whole as numpy, to be placed afresh; an array spread over
    processes stays as it is (it is resharded where it stands)."""
    return jax.tree.map(
        lambda x: np.asarray(x) if getattr(x, "is_fully_addressable", True) else x, tree
    )


def place_state(mesh: Any, tree: Any) -> Any:
    """On the mesh, replicated (states are small next to the params); without one,
    committed to the first device. Either way every state the engine holds has one
    placement: states extracted from the batch are committed, and jit compiles a
    committed argument apart from an uncommitted one, so an uncommitted empty state
    would leave warm-up compiling programs the first live continuation of each chunk
    size then compiled again (seconds of TTFT, once per size)."""
    if mesh is None:
        return jax.device_put(tree, jax.local_devices()[0])
    if jax.process_count() > 1:  # a new state is host data, the same on every process
        tree = on_host(tree)
    return jax.device_put(tree, replicated(mesh))


def split(mesh: Any, tree: Any) -> Any:
    """Split along the mesh's data axis (first dimension: rows, or pages)."""
    if jax.process_count() > 1:
        tree = on_host(tree)
    return jax.device_put(tree, batch_sharding(mesh))


def place_pages(mesh: Any, shards: int, tree: Any) -> Any:
    """The page arrays: placed as a state is, or split into the data shards' blocks."""
    return place_state(mesh, tree) if shards == 1 else split(mesh, tree)


def place_batch(mesh: Any, rows: int, batch: Any) -> Any:
    """The decode batch (of `rows` rows): placed as a state is, or its rows split over the
    mesh's data axis when it has one."""
    if mesh is None or DATA_AXIS not in mesh.shape:
        return place_state(mesh, batch)
    data = mesh.shape[DATA_AXIS]
    if rows % data:
        raise ValueError(f"a batch of {rows} rows does not split over data={data}")
    return split(mesh, batch)


def on_mesh(mesh: Any) -> Any:
    """The context the model's programs run in: the engine's mesh set, so the routed
    experts run expert-parallel over it (`sharding.expert_parallel`)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
