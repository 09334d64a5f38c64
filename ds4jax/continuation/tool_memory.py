"""Tool id → the exact DSML bytes the model sampled for that turn.

Clients re-serialise the `tool_use` input they replay (key order, spacing, escapes); rendering
their JSON would break the prefix the live and disk caches match on, and would not be what
the model said. So every id of a sampled tool-call turn maps to that turn's whole block
(`\\n\\n<｜DSML｜tool_calls>…</｜DSML｜tool_calls>`), and a replayed assistant turn renders
those bytes when all its ids map to one block. Bounded by id count and bytes, least recently
used first out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_IDS", "ToolMemory"]

DEFAULT_MAX_IDS = 100_000
DEFAULT_MAX_BYTES = 512 * 1024 * 1024


class ToolMemory:
    def __init__(self, max_ids: int = DEFAULT_MAX_IDS, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self._by_id: OrderedDict[str, str] = OrderedDict()  # most recent last
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cost(tid: str, block: str) -> int:
        return len(tid.encode()) + len(block.encode())

    def remember(self, ids: Iterable[str], block: str) -> None:
        with self._lock:
            for tid in ids:
                old = self._by_id.pop(tid, None)
                if old is not None:
                    self._bytes -= self._cost(tid, old)
                self._by_id[tid] = block
                self._bytes += self._cost(tid, block)
            while self._by_id and (len(self._by_id) > self.max_ids or self._bytes > self.max_bytes):
                tid, old = self._by_id.popitem(last=False)
                self._bytes -= self._cost(tid, old)

    def block_for(self, ids: list[str]) -> str | None:
        """The remembered block when every id maps to the same one (exact replay), else
        None (canonical rendering). A hit refreshes the ids."""
        if not ids:
            return None
        with self._lock:
            blocks = {self._by_id.get(tid) for tid in ids}
            if len(blocks) != 1 or None in blocks:
                return None
            for tid in ids:
                self._by_id.move_to_end(tid)
            return blocks.pop()

    def items(self) -> list[tuple[str, str]]:
        """Every (id, block), least recently used first, copied under the lock: the disk
        store reads them from its save thread while requests remember more, and remembering
        them back in this order (`remember([tid], block)`) rebuilds the same recency."""
        with self._lock:
            return list(self._by_id.items())

    def __contains__(self, tid: str) -> bool:
        with self._lock:
            return tid in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)
