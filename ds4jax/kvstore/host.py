"""The host-RAM tier (issue 26): where an idle session's state goes when device memory for
retained states runs short, before the disk and before being dropped.

A session keeps everything but its device arrays — its live frontier's tokens and text,
its tool-id and thinking bindings, its client hint — so routing still finds it: a
`tool_result` for its ids continues it exactly as if it had stayed, the state coming back
to the device first (a continuation from the `host` tier in the trace and the metrics).
A `HostState` is a plain copy of the dense state's arrays in this process's memory; the
device bytes the session held are freed when nothing else holds them.

What it holds follows the tokens held, not the state's span (every span is ≥ 4,096 tokens:
`model.state.SPAN_BASE`): the compressed and indexer rows past the last row written are
zeros (a state is canonical past its tokens), so they are cut on the way in and put back
on the way out — the state that returns is the one that left, bit for bit. A 400-token
session spilled from a 4,096-token span holds its ~100 compressed rows of a layer, not
1,025.

One process only: a state spread over processes has no single host copy, so the tier is
off under `jax.distributed` (`Engine` refuses it there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True, eq=False)
class HostState:
    """A retained state's arrays in host RAM: `state` is the dense state (numpy leaves)
    with its compressed and indexer rows cut after the last one written; `capacities`
    their rows in the state that left (per layer, comp and idx; None: no such rows)."""

    state: Any
    nbytes: int
    capacities: tuple[tuple[int | None, int | None], ...] = ()

    #: what the pool's device budget skips (`continuation.pool`)
    on_host = True

    @property
    def pos(self) -> Any:
        return self.state.pos

    def dense(self) -> Any:
        """The state as it left: the cut rows back, as zeros, at its capacity."""
        layers = tuple(
            replace(ls, comp=_pad(ls.comp, comp), idx=_pad(ls.idx, idx))
            for ls, (comp, idx) in zip(self.state.layers, self.capacities, strict=True)
        )
        return replace(self.state, layers=layers)


def least_bytes(state: Any) -> int:
    """The fewest bytes `to_host(state)` can hold, before copying anything: every leaf
    but the compressed and indexer rows (which it cuts)."""
    rows = {id(x) for ls in state.layers for x in (ls.comp, ls.idx) if x is not None}
    return sum(int(x.nbytes) for x in jax.tree.leaves(state) if id(x) not in rows)


def to_host(state: Any) -> HostState:
    """A dense device state copied to host RAM, its unwritten rows left behind."""
    host = jax.device_get(state)
    capacities = tuple((_rows(ls.comp), _rows(ls.idx)) for ls in host.layers)
    layers = tuple(replace(ls, comp=_cut(ls.comp), idx=_cut(ls.idx)) for ls in host.layers)
    host = replace(host, layers=layers)
    nbytes = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(host)))
    return HostState(host, nbytes, capacities)


def _rows(rows: np.ndarray | None) -> int | None:
    return None if rows is None else rows.shape[-2]


def _cut(rows: np.ndarray | None) -> np.ndarray | None:
    """`rows` [capacity, width] up to its last row with a nonzero bit (a copy: the
    device_get result may be a view of the whole)."""
    if rows is None:
        return None
    bits = np.ascontiguousarray(rows).view(f"u{rows.dtype.itemsize}")
    written = np.flatnonzero(bits.reshape(rows.shape[0], -1).any(axis=1))
    return rows[: written[-1] + 1 if written.size else 0].copy()


def _pad(rows: np.ndarray | None, capacity: int | None) -> np.ndarray | None:
    if rows is None:
        return None
    return np.concatenate([rows, np.zeros((capacity - rows.shape[0], *rows.shape[1:]),
                                          rows.dtype)])  # fmt: skip
