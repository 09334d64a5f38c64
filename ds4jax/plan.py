"""`ds4jax plan`: whether a model, a context and a session pool fit a set of devices, on
paper — bytes per device for the weights, the retained session states and the batch, for
each (expert, tensor) mesh the device count allows, and the mesh it would use.

Nothing is allocated: parameter shapes come from `param_shapes`, per-device shards from the
same sharding rules `shard_params` applies (`sharding.mesh_axes`), state sizes from
`state.capacity_bytes`. Weights are counted as `--weights` stores them on device: `f32`,
`bf16`, or `fp8` — the release's own formats kept resident (FP8 E4M3 linears with their
128×128 E8M0 block scales, FP4 E2M1 routed experts with per-32 scales, the rest bf16), or
`fp4-experts` — the FP4 experts kept so, the rest f32 values, its matrices held in bf16
(the release's BF16 and E8M0-scaled FP8 values are all bf16 values:
`model.quantized.hold_bf16_where_exact`).
States are counted dense in f32 (`ds4jax serve --state-dtype f32`; its default state dtype
is by platform — fp8 on CPU, about a quarter of it), replicated on every device — each
session's live frontier and fork points under the default state budget (two states per
session), the batch's `max_batch` rows, and the engine's empty template state. A
`--reserve` share of each device is left for activations and XLA's workspace.

`--paged-state DTYPE` (or `--state-dtype`) counts them instead as paged state holds them
(issue 26: what `ds4jax serve --paged --state-dtype DTYPE` retains; its batch rows are still
dense states at their tokens' span, counted here as the per-session parts they will be):
a session at the context's length holds its pages and one per-session part (`model.pages`,
in that dtype); its fork point shares the full pages and adds at most its partial page and
a per-session part; batch rows hold no copies, only the per-session parts they move.
Either way `sessions_fit` is how many sessions of that length (each with its fork point)
the room left after the weights and the batch holds.

`data_parallel` searches (data, expert, tensor) instead (issue 28): the arrangement V4 is
served with at scale — each data shard holds its own sessions (their states or pages live
on its devices only) and its share of the batch rows, attention and shared weights are
replicated along `data`, and the routed experts are split over every device (expert
parallelism over data × expert, tokens exchanged all-to-all per MoE layer). So a device
holds 1/data of the sessions, and the slice's sessions grow with data until the replicated
weights leave no room. The best arrangement is then the one with the most sessions that
fit. `ds4jax serve --paged --mesh data=D,…` holds sessions that way: its page pool is split
along data (`kvstore.pages.PagePool(shards=…)`), the routed experts over data × expert
(`sharding.mesh_axes`); its per-session small parts stay replicated (counted here with the
pages), as do dense states without `--paged`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import jax

from ds4jax.config import Config
from ds4jax.kvstore.pages import pages_for
from ds4jax.model import pages
from ds4jax.model.params import param_shapes, path_name
from ds4jax.model.sharding import DATA_AXIS, EXPERT_AXIS, TENSOR_AXIS, mesh_axes
from ds4jax.model.state import capacity_bytes
from ds4jax.weights.official import leaf_kind, stored_bytes

WEIGHTS = ("fp8", "bf16", "f32", "fp4-experts")
STATES_PER_SESSION = 2  # serve's default --state-budget-mb: a live frontier + a fork point
GB = 1e9


def weight_bytes_per_device(cfg: Config, expert: int, tensor: int, weights: str,
                            data: int = 1) -> int:  # fmt: skip
    """Bytes of one device's shard of every parameter on a data×expert×tensor mesh, split
    as the server places them (`sharding.mesh_axes`): the routed experts over data × expert
    where their count divides, else over expert alone; everything else replicated along
    data."""
    sizes = {DATA_AXIS: data, EXPERT_AXIS: expert, TENSOR_AXIS: tensor}

    def parts(axis: str | tuple[str, ...] | None) -> int:
        axes = axis if isinstance(axis, tuple) else (axis,) if axis else ()
        return math.prod(sizes[a] for a in axes)

    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(param_shapes(cfg)):
        name = path_name(path)
        axes = mesh_axes(name, leaf.shape, sizes)
        shard = tuple(d // parts(a) for d, a in zip(leaf.shape, axes, strict=True))
        kind = leaf_kind(name)
        if kind == "int":
            total += 4 * math.prod(shard)
        elif weights == "fp8" or (weights == "fp4-experts" and kind == "fp4"):
            total += stored_bytes(kind, shard)
        elif weights == "fp4-experts" and len(shard) == 2:
            total += 2 * math.prod(shard)
        else:
            total += (2 if weights == "bf16" else 4) * math.prod(shard)
    return total


@dataclass(frozen=True)
class MeshPlan:
    """One arrangement, per device: a device of data shard s holds shard s's sessions."""

    expert: int
    tensor: int
    weights_bytes: int
    states_bytes: int  # retained: its shard's sessions and fork points
    batch_bytes: int  # its shard's batch rows and the empty template state
    usable_bytes: int
    session_bytes: int = 0  # one more session at the context's length, with its fork point
    data: int = 1

    @property
    def sessions_fit(self) -> int:
        """Sessions of the context's length the whole slice holds: each data shard's room
        after the weights and its batch, in sessions, times the shards."""
        room = self.usable_bytes - self.weights_bytes - self.batch_bytes
        return self.data * max(0, room // self.session_bytes) if self.session_bytes else 0

    @property
    def mesh(self) -> str:
        head = f"data={self.data}," if self.data > 1 else ""
        return f"{head}expert={self.expert},tensor={self.tensor}"

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.states_bytes + self.batch_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes


def plan(
    cfg: Config, *, devices: int, hbm_gb: float, ctx: int, sessions: int, weights: str,
    max_batch: int = 8, reserve: float = 0.1, paged: str | None = None,
    data_parallel: bool = False,
) -> list[MeshPlan]:  # fmt: skip
    """Every expert×tensor factorisation of `devices`, the one it would use first: the
    smallest per-device footprint, then the most expert parallelism (fewer all-reduces).
    `paged`: count states as paged state in that dtype (module docstring).
    `data_parallel`: every data×expert×tensor factorisation (data dividing the batch), the
    one with the most sessions that fit first (then as above)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}")
    if devices < 1 or sessions < 1 or ctx < 1 or not 0 <= reserve < 1:
        raise ValueError("devices, sessions and ctx must be positive, reserve in [0, 1)")
    if paged is None:
        state = capacity_bytes(cfg, ctx)
        per_session = STATES_PER_SESSION * state
        batch = lambda rows: (rows + 1) * state  # noqa: E731
    else:
        page, part = pages.page_bytes(cfg, paged), pages.session_bytes(cfg, paged)
        per_session = pages_for(ctx) * page + part + (page + part)  # + its fork point
        batch = lambda rows: rows * part  # noqa: E731
    usable = int(hbm_gb * GB * (1 - reserve))
    out = []
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    for data in [d for d in divisors if max_batch % d == 0] if data_parallel else [1]:
        for expert in (d for d in divisors if (devices // data) % d == 0):
            tensor = devices // (data * expert)
            out.append(MeshPlan(
                expert, tensor, weight_bytes_per_device(cfg, expert, tensor, weights, data),
                -(-sessions // data) * per_session, batch(max_batch // data), usable,
                per_session, data,
            ))  # fmt: skip
    if data_parallel:
        return sorted(out, key=lambda p: (-p.sessions_fit, p.total_bytes, -p.expert))
    return sorted(out, key=lambda p: (p.total_bytes, -p.expert))


def describe(name: str, plans: list[MeshPlan], *, devices: int, hbm_gb: float, ctx: int,
             sessions: int, weights: str, max_batch: int, reserve: float,
             paged: str | None = None, data_parallel: bool = False) -> str:  # fmt: skip
    best = plans[0]
    gb = lambda b: f"{b / GB:,.2f} GB"  # noqa: E731
    if paged is None:
        kind = "dense f32 states (serve --state-dtype f32)"
        held = f"{STATES_PER_SESSION * sessions} states: live frontiers and fork points"
        rows = f"{max_batch} rows + the empty state"
    else:
        kind = (
            f"paged {paged} states (as `ds4jax serve --paged --state-dtype {paged}` "
            "retains them; its batch rows are still dense, at their tokens' span)"
        )
        held = f"{sessions} sessions' pages and fork points"
        rows = f"{max_batch} rows' per-session parts"
    lines = [
        f"{name}: {devices} device(s) × {hbm_gb:g} GB, context {ctx:,}, {sessions} "
        f"session(s), weights {weights}, batches of up to {max_batch}, {kind}",
        f"mesh: {best.mesh}",
        f"per device: weights {gb(best.weights_bytes)}; session states "
        f"{gb(best.states_bytes)} ({held}); batch {gb(best.batch_bytes)} ({rows}); total "
        f"{gb(best.total_bytes)} of {gb(best.usable_bytes)} usable ({reserve:.0%} reserved)",
        f"fits: {'yes' if best.fits else 'no'}",
    ]
    if data_parallel:
        lines += [
            "data > 1: data-parallel attention (each data shard holds its own sessions and "
            "batch rows; experts split over every device): `ds4jax serve --paged --mesh "
            "data=D,…` splits its page pool so; counted on paper here (issue 28)",
            "",
            f"data×expert×tensor   weights/device   total/device   fits   sessions of "
            f"{ctx:,} that fit",
        ]
        for p in plans:
            lines.append(f"{p.data:>6}×{p.expert}×{p.tensor:<9} {gb(p.weights_bytes):>16} "
                         f"{gb(p.total_bytes):>14}   {'yes' if p.fits else 'no':<4}   "
                         f"{p.sessions_fit}")  # fmt: skip
        return "\n".join(lines)
    lines += ["", f"expert×tensor   weights/device   total/device   fits   sessions of "
              f"{ctx:,} that fit"]  # fmt: skip
    for p in plans:
        lines.append(f"{p.expert:>6}×{p.tensor:<6} {gb(p.weights_bytes):>16} "
                     f"{gb(p.total_bytes):>14}   {'yes' if p.fits else 'no':<4}   "
                     f"{p.sessions_fit}")  # fmt: skip
    return "\n".join(lines)


def as_json(plans: list[MeshPlan]) -> list[dict[str, object]]:
    return [{**asdict(p), "mesh": p.mesh, "total_bytes": p.total_bytes, "fits": p.fits,
             "sessions_fit": p.sessions_fit} for p in plans]  # fmt: skip
