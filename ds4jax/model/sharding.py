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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ds4jax.config import Config
from ds4jax.model.params import Params, param_shapes, path_name
from ds4jax.model.quantized import QWeight, split_size

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


def _expert_spec(name: str, w: Any, sizes: dict[str, int], ffn: bool = True) -> Any:
    """How the routed experts' weight `name` is split (`mesh_axes`, as `shard_params`
    places it; without `ffn`, not along the FFN width); for a `QWeight`, a dimension is
    split only where its values and its exponents both divide (a shard then holds whole
    blocks)."""
    keep = [ffn or logical != "ffn" for logical in logical_axes(name, 3)]
    if not isinstance(w, QWeight):
        axes = mesh_axes(name, w.shape, sizes)
        return PartitionSpec(*(ax if k else None for ax, k in zip(axes, keep, strict=True)))
    q, exp = mesh_axes(name, w.q.shape, sizes), w.exp.shape
    axes = [ax if k and e % split_size(sizes, ax) == 0 else None
            for ax, e, k in zip(q, exp, keep, strict=True)]  # fmt: skip
    return QWeight(PartitionSpec(*axes), PartitionSpec(*axes), w.block)


def expert_parallel(routed: Callable[..., jax.Array], experts: dict[str, Any], x: jax.Array,
                    sel: jax.Array, w: jax.Array) -> jax.Array:  # fmt: skip
    """`routed(num_experts, experts, x, sel, w)` — the routed experts' weighted sum for
    the tokens `x` — run expert-parallel when a mesh is set (`jax.set_mesh`, as the
    engine does around its programs) and the experts are split on it: each device takes
    every token (the step's tokens are gathered, small next to the weights), computes the
    pairs routed to its own experts (the others weigh 0) with its own shard of the FFN
    width, and the partial sums are added over the devices. Left to itself XLA would
    gather every expert's weights onto every device for the dynamic expert reads: the
    whole experts through each device every step. Without a mesh, the plain call."""
    E = (experts["w1"].q if isinstance(experts["w1"], QWeight) else experts["w1"]).shape[0]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return routed(E, experts, x, sel, w)
    sizes = dict(mesh.shape)
    is_spec = lambda a: isinstance(a, PartitionSpec)  # noqa: E731
    specs = {n: _expert_spec(n, v, sizes) for n, v in experts.items()}
    width = {n: jax.tree.leaves(sp, is_leaf=is_spec)[0][2 if n == "w2" else 1]
             for n, sp in specs.items()}  # fmt: skip
    if len(set(width.values())) > 1:  # a width split the three do not all take: none
        specs = {n: _expert_spec(n, v, sizes, ffn=False) for n, v in experts.items()}
    leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    split = tuple(dict.fromkeys(
        a for spec in leaves for ax in spec if ax is not None
        for a in (ax if isinstance(ax, tuple) else (ax,))
    ))  # fmt: skip
    if not split:
        return routed(E, experts, x, sel, w)
    by = jax.tree.leaves(specs["w1"], is_leaf=is_spec)[0][0]
    local = E // split_size(sizes, by)

    def shard(ex: dict[str, Any], x: jax.Array, sel: jax.Array, w: jax.Array) -> jax.Array:
        if by is not None:
            lo = jax.lax.axis_index(by) * local
            mine = (sel >= lo) & (sel < lo + local)
            sel, w = jnp.where(mine, sel - lo, 0), jnp.where(mine, w, 0)
        return jax.lax.psum(routed(local, ex, x, sel, w), split)

    rep = PartitionSpec()
    # (no varying-axis types: the routed ways' loop carries start as replicated zeros)
    return jax.shard_map(shard, in_specs=(specs, rep, rep, rep), out_specs=rep,
                         check_vma=False)(experts, x, sel, w)  # fmt: skip


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
