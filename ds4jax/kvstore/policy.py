"""The disk cache's arithmetic, as pure functions (ds4_kvstore.c; spec
ds4-server-behaviour.md §4.3, §4.4, §4.6): where a cold prefill stops for its save, whether a
file fits the budget, and which checkpoint the budget evicts first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_TOKENS = 512
COLD_MAX_TOKENS = 30000
BOUNDARY_TRIM = 32
BOUNDARY_ALIGN = 2048
CONTINUED_EVERY = 10240  # ds4: ceil(10000 / 2048) * 2048
BUDGET_MB = 4096
HIT_HALF_LIFE_S = 6 * 3600.0


def store_len(n: int, min_tokens: int, trim: int, align: int) -> int:
    """ds4's `store_len`: `n - trim` aligned down to `align` when that is still at least
    `min_tokens`, else the full `n` (11011 → 10240, 1695 → 1695 with the defaults)."""
    if n > min_tokens + trim:
        s = n - trim
        if align > 0:
            s -= s % align
        if s >= min_tokens:
            return s
    return n


def chat_anchor(
    tokens: Sequence[int], user_id: int, assistant_id: int, min_tokens: int
) -> int | None:
    """The index of the last `<｜User｜>` token before the first `<｜Assistant｜>` token, when
    that is at least `min_tokens`; None otherwise (or with no assistant token at all).

    Saving `tokens[:anchor]` cuts right *before* that `<｜User｜>`: the checkpoint holds the
    system prompt, the tool definitions and any earlier user turns of a fresh conversation, and
    its text ends in plain text, so every conversation sharing that prefix extends it
    (ds4_kvstore_chat_anchor_pos)."""
    last_user: int | None = None
    for i, t in enumerate(tokens):
        if t == assistant_id:
            break
        if t == user_id:
            last_user = i
    else:
        return None
    if last_user is None or last_user < min_tokens:
        return None
    return last_user


def fits_budget(file_bytes: int, budget_bytes: int) -> bool:
    """A file fits when it and 1 % slack (rounded up) do not exceed the budget."""
    return file_bytes + math.ceil(file_bytes / 100) <= budget_bytes


@dataclass(frozen=True)
class Usage:
    """What the eviction score reads from one checkpoint."""

    key: str
    tokens: int
    size: int  # bytes on disk
    hits: int
    created: float  # unix seconds
    last_used: float  # unix seconds, 0 = never


def eviction_score(u: Usage, now: float, half_life_s: float = HIT_HALF_LIFE_S) -> float:
    """ds4's score `(effective_hits + 1) · tokens / bytes`; hits decay with a half-life since
    the last use (or the creation) and count as 0 below 0.01 or without a timestamp. Dense,
    recently useful checkpoints are worth keeping; the save reason plays no part."""
    ts = u.last_used or u.created
    eff = 0.0
    if ts > 0 and u.hits > 0:
        eff = u.hits * 2.0 ** (-max(0.0, now - ts) / half_life_s)
        if eff < 0.01:
            eff = 0.0
    return (eff + 1.0) * u.tokens / max(u.size, 1)


def eviction_order(
    entries: Iterable[Usage],
    budget_bytes: int,
    now: float,
    protect: str | None = None,
    half_life_s: float = HIT_HALF_LIFE_S,
) -> list[Usage]:
    """The checkpoints to delete, first to last, until the total fits `budget_bytes`: lowest
    score first, ties to the older use. `protect` (the checkpoint just written) scores +∞
    unless it alone exceeds the budget."""
    items = list(entries)
    total = sum(u.size for u in items)

    def key(u: Usage) -> tuple[float, float]:
        if u.key == protect and u.size <= budget_bytes:
            return (math.inf, 0.0)
        return (eviction_score(u, now, half_life_s), u.last_used or u.created)

    out: list[Usage] = []
    for u in sorted(items, key=key):
        if total <= budget_bytes:
            break
        if key(u)[0] == math.inf:
            break
        out.append(u)
        total -= u.size
    return out
