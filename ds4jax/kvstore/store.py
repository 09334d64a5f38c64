"""The disk checkpoint store as the engine sees it.

The decision asks one question — the longest stored checkpoint whose rendered text is a byte
prefix of the request's — and the engine hands the store states to keep: at the store's cold
save point of a cold prefill, at every multiple of its continued interval, before a miss
replaces the live frontier (evict), and on a clean exit (shutdown). `NoStore` is the store
when serving without `--kv-disk-dir`; `ds4jax.kvstore.disk.DiskStore` the one with it.

Contract the engine relies on: `lookup` only returns checkpoints of this model that fit the
context, whose text is a segment-wise prefix of the request's (`strip_prefix` succeeds);
`DiskHit.load()` returns a state of the capacity of `init_state(cfg, max_len)` holding
exactly `DiskHit.tokens`, or raises (never a partial or unverified state); `cold_cut` may
return `len(tokens)` (save after the whole prefill); `save` never raises for an I/O failure
and never keeps a state whose `pos` is not `len(tokens)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ds4jax.chat.segments import Segment


class SaveReason(StrEnum):
    """Why a checkpoint was written (ds4's reasons; each can be switched off)."""

    COLD = "cold"  # at the cold save point of a cold prefill
    CONTINUED = "continued"  # at a multiple of the continued interval
    EVICT = "evict"  # before a miss replaces a live frontier
    SHUTDOWN = "shutdown"  # on a clean exit


@dataclass(frozen=True)
class DiskHit:
    key: str
    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]  # the rendered text of `tokens`, as segments
    load: Any  # () -> DecodeState, called only if the decision picks this hit
    tool_entries: dict[str, str] = field(default_factory=dict)  # tool id → DSML block


class ToolEntries(Protocol):
    """What a save reads of the tool memory (`continuation.tool_memory.ToolMemory`, or a
    plain mapping in tests): its (id, block) pairs, taken as one consistent copy, since a save
    runs on the store's thread while requests keep remembering."""

    def items(self) -> Iterable[tuple[str, str]]: ...


class KVStore(Protocol):
    #: save a "continued" checkpoint whenever the live length reaches a multiple of this
    #: (0 = never)
    continued_every: int

    def lookup(self, segments: tuple[Segment, ...]) -> DiskHit | None:
        """The longest checkpoint whose text is a prefix of `segments`' text."""
        ...

    def cold_cut(self, tokens: tuple[int, ...], segments: tuple[Segment, ...]) -> int | None:
        """Where a cold prefill of `tokens` should stop for a "cold" save, if anywhere."""
        ...

    def save(
        self,
        tokens: tuple[int, ...],
        segments: tuple[Segment, ...],
        state: Any,
        reason: str,
        tool_memory: ToolEntries | None,
    ) -> None:
        """Persist `state`, which holds exactly `tokens` (reasons: cold, continued, evict,
        shutdown); `tool_memory` supplies the entries whose DSML the text contains."""
        ...


class NoStore:
    """No disk: nothing is found, nothing is kept."""

    continued_every = 0

    def lookup(self, segments: tuple[Segment, ...]) -> DiskHit | None:
        return None

    def cold_cut(self, tokens: tuple[int, ...], segments: tuple[Segment, ...]) -> int | None:
        return None

    def save(
        self,
        tokens: tuple[int, ...],
        segments: tuple[Segment, ...],
        state: Any,
        reason: str,
        tool_memory: ToolEntries | None,
    ) -> None:
        return None
