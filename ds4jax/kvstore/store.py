"""The disk checkpoint store as the decision procedure sees it.

The decision asks one question — the longest stored checkpoint whose rendered text is a byte
prefix of the request's — and the engine may ask the store to keep the live state before
replacing it. The Orbax-backed implementation arrives with the disk-checkpoint issue; until
then `NoStore` answers "nothing stored".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ds4jax.chat.segments import Segment


@dataclass(frozen=True)
class DiskHit:
    key: str
    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]  # the rendered text of `tokens`, as segments
    load: Any  # () -> DecodeState, called only if the decision picks this hit


class KVStore(Protocol):
    def lookup(self, segments: tuple[Segment, ...]) -> DiskHit | None: ...

    def save(
        self, tokens: tuple[int, ...], segments: tuple[Segment, ...], state: Any, reason: str
    ) -> None: ...


class NoStore:
    def lookup(self, segments: tuple[Segment, ...]) -> DiskHit | None:
        return None

    def save(
        self, tokens: tuple[int, ...], segments: tuple[Segment, ...], state: Any, reason: str
    ) -> None:
        return None
