"""The host-RAM tier (issue 26): where an idle session's state goes when device memory for
retained states runs short, before the disk and before being dropped.

A session keeps everything but its device arrays — its live frontier's tokens and text,
its tool-id and thinking bindings, its client hint — so routing still finds it: a
`tool_result` for its ids continues it exactly as if it had stayed, the state coming back
to the device first (a continuation from the `host` tier in the trace and the metrics).
A `HostState` is a plain copy of the dense state's arrays in this process's memory; the
device bytes the session held are freed when nothing else holds them.

One process only: a state spread over processes has no single host copy, so the tier is
off under `jax.distributed` (`Engine` refuses it there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True, eq=False)
class HostState:
    """A retained state's arrays in host RAM (`state`: the dense state, numpy leaves)."""

    state: Any
    nbytes: int

    #: what the pool's device budget skips (`continuation.pool`)
    on_host = True

    @property
    def pos(self) -> Any:
        return self.state.pos


def to_host(state: Any) -> HostState:
    """A dense device state copied to host RAM."""
    host = jax.device_get(state)
    nbytes = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(host)))
    return HostState(host, nbytes)
