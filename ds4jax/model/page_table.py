"""What a page table is, as the model's paged step reads it: 256-token pages (one logical
block for every layer kind), a frontier's pages in token order padded with the null page, and
the copies a step carries out before appending. The data the device side is laid out by;
the pool that hands pages out and counts their references is `kvstore.pages`.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_TOKENS = 256
NULL_PAGE = 0


@dataclass(frozen=True)
class PageTable:
    """The pages of one frontier, in token order; the last one may be partly filled."""

    pages: tuple[int, ...] = ()
    tokens: int = 0

    def padded(self, width: int) -> list[int]:
        """The table as the step reads it: `width` entries, the unused ones the null page."""
        if len(self.pages) > width:
            raise ValueError(f"a table of {len(self.pages)} pages does not fit {width}")
        return [*self.pages, *([NULL_PAGE] * (width - len(self.pages)))]


@dataclass(frozen=True)
class Copy:
    """Copy page `src`'s first `tokens` tokens' rows into page `dst` (before appending)."""

    src: int
    dst: int
    tokens: int
