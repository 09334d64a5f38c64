"""Logical axes → `NamedSharding` over a device `Mesh`; the only module that knows mesh axis
names.

Every parameter dimension gets a logical name (`experts`, `heads`, `ffn`, `vocab`, …);
`ShardingRules` maps logical names to mesh axes (experts on the expert axis, attention heads
and FFN width on the tensor axis). The model code itself is sharding-agnostic: parameters
are placed with these shardings and `jit` propagates them, so one code path runs on one CPU,
8 fake CPU devices and a TPU slice. A dimension not divisible by its mesh axis stays
replicated rather than failing.

Multi-host TPU: call `jax.distributed.initialize()` first on every host, then build the mesh
from `jax.devices()` (all hosts' devices) exactly as here; every host runs the same program.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ds4jax.config import Config
from ds4jax.model.params import Params, param_shapes, path_name

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
#: the decode batch's rows (`Engine`): params are replicated along it, the batch split
DATA_AXIS = "data"


@dataclass(frozen=True)
class ShardingRules:
    """logical axis name → mesh axis (None = replicated)."""

    rules: dict[str, str | None] = field(
        default_factory=lambda: {
            "experts": EXPERT_AXIS,
            "heads": TENSOR_AXIS,
            "ffn": TENSOR_AXIS,
            "vocab": TENSOR_AXIS,
        }
    )

    def mesh_axis(self, logical: str | None) -> str | None:
        return self.rules.get(logical) if logical else None


def make_mesh(
    expert: int | None = None, tensor: int = 1, devices: list[Any] | None = None, data: int = 1
) -> Mesh:
    """A 2-D (expert, tensor) mesh over `devices` (default: all), or 3-D (data, expert,
    tensor) with `data` > 1; `expert` defaults to whatever the others leave."""
    devices = list(devices if devices is not None else jax.devices())
    if expert is None:
        expert = len(devices) // (tensor * data)
    if data * expert * tensor != len(devices):
        raise ValueError(f"mesh {data}×{expert}×{tensor} does not use all {len(devices)} devices")
    if data == 1:
        grid = np.array(devices, dtype=object).reshape(expert, tensor)
        return Mesh(grid, (EXPERT_AXIS, TENSOR_AXIS))
    grid = np.array(devices, dtype=object).reshape(data, expert, tensor)
    return Mesh(grid, (DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The decode batch (rows first): split over the data axis, when the mesh has one."""
    if DATA_AXIS in mesh.shape:
        return NamedSharding(mesh, PartitionSpec(DATA_AXIS))
    return replicated(mesh)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical names of a parameter's dimensions, from its path."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf in ("w1", "w3"):  # [E, F, D]
        return ("experts", "ffn", None)
    if leaf == "w2":  # [E, D, F]
        return ("experts", None, "ffn")
    if leaf in ("shared_w1", "shared_w3"):
        return ("ffn", None)
    if leaf == "shared_w2":
        return (None, "ffn")
    if path.endswith("attn.wq_b"):  # [H·hd, q_lora]
        return ("heads", None)
    if path.endswith("attn.wo_a"):  # [G·R, H/G·hd]: groups of heads
        return ("heads", None)
    if leaf == "attn_sink":
        return ("heads",)
    if leaf in ("embed", "head"):
        return ("vocab", None)
    return (None,) * ndim


def mesh_axes(
    path: str, shape: tuple[int, ...], sizes: dict[str, int], rules: ShardingRules | None = None
) -> tuple[Any, ...]:
    """The mesh axis each dimension of a parameter is split over (None: replicated), for a
    mesh of these axis `sizes`: its logical axis's, when the dimension divides. On a mesh
    with a data axis the routed experts are split over data × expert together (issue 28:
    expert parallelism over every device, rather than a copy of every expert per data
    shard), when their count divides."""
    rules = rules or ShardingRules()
    axes: list[Any] = []
    for dim, logical in zip(shape, logical_axes(path, len(shape)), strict=True):
        ax = rules.mesh_axis(logical)
        if ax == EXPERT_AXIS and sizes.get(DATA_AXIS, 1) > 1:
            if dim % (sizes[DATA_AXIS] * sizes[EXPERT_AXIS]) == 0:
                axes.append((DATA_AXIS, EXPERT_AXIS))
                continue
        axes.append(ax if ax is not None and dim % sizes[ax] == 0 else None)
    return tuple(axes)


def param_shardings(cfg: Config, mesh: Mesh, rules: ShardingRules | None = None) -> Params:
    def spec(path: tuple, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        axes = mesh_axes(path_name(path), leaf.shape, dict(mesh.shape), rules)
        return NamedSharding(mesh, PartitionSpec(*axes))

    return jax.tree_util.tree_map_with_path(spec, param_shapes(cfg))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def fetch(x: jax.Array) -> np.ndarray:
    """An array on the host of every process: one split over devices of other processes
    (rows over a data axis that spans them) is gathered first, a collective each process
    makes at the same point, as it makes every step."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shard_params(params: Params, cfg: Config, mesh: Mesh, rules: ShardingRules | None = None):
    return jax.device_put(params, param_shardings(cfg, mesh, rules))


def parse_mesh(spec: str, devices: list[Any] | None = None) -> Mesh:
    """`[data=D,]expert=E,tensor=T` (expert or tensor may be left out: it takes what is
    left) → Mesh."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        known = (DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS)
        if name not in known or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh {spec!r}: expected [data=D,]expert=E,tensor=T, got {part!r}")
        sizes[name] = int(value)
    devices = list(devices if devices is not None else jax.devices())
    data = sizes.get(DATA_AXIS, 1)
    tensor = sizes.get(TENSOR_AXIS)
    if tensor is None:
        rest = data * sizes.get(EXPERT_AXIS, 1)
        tensor = len(devices) // rest if len(devices) % rest == 0 else 0
    if not tensor:
        raise ValueError(f"mesh {spec!r} does not divide {len(devices)} devices")
    return make_mesh(sizes.get(EXPERT_AXIS), tensor, devices, data)


def default_mesh(cfg: Config, devices: list[Any] | None = None) -> Mesh | None:
    """Every device (of every process) on the tensor axis when every tensor-sharded
    dimension divides by their count; None (one device, nothing to place) otherwise or with
    one device. Several processes always get the mesh (they must all take part in every
    step): a dimension that does not divide is replicated."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    if n <= 1:
        return None
    if jax.process_count() == 1:
        rules = ShardingRules()
        for path, leaf in jax.tree_util.tree_leaves_with_path(param_shapes(cfg)):
            axes = logical_axes(path_name(path), leaf.ndim)
            for dim, logical in zip(leaf.shape, axes, strict=True):
                if rules.mesh_axis(logical) == TENSOR_AXIS and dim % n:
                    return None
    return make_mesh(1, n, devices)


MESH_HELP = (
    "[data=D,]expert=E,tensor=T: shard the params over a device mesh (data: split the decode "
    "batch's rows, the routed experts over data × expert, the other params replicated along "
    "data); 'none': one device (default: every device on the tensor axis where the shapes "
    "divide)"
)


def mesh_for(spec: str | None, cfg: Config) -> Mesh | None:
    """What a `--mesh` flag asks for: None (the flag left out) → `default_mesh`; "none" →
    one device, no mesh; else `parse_mesh`."""
    if spec is None:
        return default_mesh(cfg)
    if spec.strip().lower() == "none":
        return None
    return parse_mesh(spec)


class MeshError(ValueError):
    """A `--mesh` that does not fit the devices or the model."""


class Placement:
    """A `--mesh` flag, resolved once the config is known: `load_model(shardings=...)` calls
    it with the config and reads the params straight onto the mesh; `mesh` is then the one
    chosen (None: one device)."""

    def __init__(self, spec: str | None) -> None:
        self.spec = spec
        self.mesh: Mesh | None = None

    def __call__(self, cfg: Config) -> Params | None:
        try:
            self.mesh = mesh_for(self.spec, cfg)
        except ValueError as err:
            raise MeshError(f"--mesh: {err}") from err
        return None if self.mesh is None else param_shardings(cfg, self.mesh)
