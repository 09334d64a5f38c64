"""How much of a waiting prompt one scheduler tick may evaluate while other rows decode.

Why (issue 27): a decoding stream's gap between two tokens is one tick. With the prompt's
chunk a program of its own before the step, in whole 512-token chunks, a 15k-token prompt
stalled four bench-192m streams at a p99 gap of 2.4–3.0 s against 42–44 ms alone (`bench
stall`; 1.9–2.8× with the bound, docs/batching.md). So while rows
decode, the chunk rides inside their step (`model.batch.step`'s `chunk`: embedding, the
hyper-connections, the MoE and the head run over the rows' tokens and the chunk's
together) and is bounded: the largest chunk size whose measured extra cost keeps the step
within `stall` times the plain step, with `HEADROOM` so that the gaps' tail and not only
their mean stays within it. With no row decoding, prefill runs in whole chunks at full speed.

The costs are measured by the engine as it runs (`TickCosts`: moving averages of the plain
step by batch size, and of what a chunk of each size adds to a step), because they belong
to the machine and the model. On this 2-core CPU with bench-192m (a 400-token context, B=4):
the plain step 34.8 ms, with a 4-token chunk 44.6 ms, a 16-token one 69.2, a 64-token one
100.4 — against 27.7 / 61.4 / 89.5 ms for those chunks as programs of their own. A size not
measured yet is guessed at twice its next smaller size's cost — corrected after one tick —
so sizes are tried from the bottom up, one at a time.

The trade is the prompt's own speed: small chunks prefill fewer tokens per second than
whole ones. `serve --stall-bound` sets `stall`; 0 turns the bound off (whole chunks as
programs of their own: the prompt at full speed, the streams wait).

Which prompt a tick prefills. A request whose prompt is short — a live tool turn, a side
request — must not wait out another's long prefill (a sub-agent's 16-token tool result
behind a main agent's 16k-token cold prompt waited ~15 s on 2 cores): a waiting request may
start beside the prompts already in flight when its own prefill is at most one whole chunk,
shorter than what each of them has left, and replaces no agent's session between two tool
turns (`overtakes`), and each tick advances the prompt in flight with the least left
(`next_prefill`), unless one has been passed over `PASS_BOUND` ticks in a row, so a stream
of short requests cannot starve a long one. Which waiting request may try is the engine's
(`engine.admission`): the oldest, or a later one that continues a conversation a session
holds.

Pure data and functions; the engine only measures and follows (`Engine.tick`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

#: weight of the newest measurement in a moving average
ALPHA = 0.3
#: `serve --stall-bound`'s default: a decoding stream's gap at most two steps alone
DEFAULT_STALL_BOUND = 2.0
#: the share of the bound's allowance a chunk's mean cost may take: the gaps vary by ±20%
#: from tick to tick on a busy CPU
HEADROOM = 0.8
#: ticks a prompt in flight may be passed over for shorter ones before it goes first
PASS_BOUND = 8


def _averaged(table: Mapping[int, float], key: int, seconds: float) -> Mapping[int, float]:
    old = table.get(key)
    new = dict(table)
    new[key] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds
    return MappingProxyType(new)


@dataclass(frozen=True)
class TickCosts:
    """Moving averages, in seconds, of a plain decode step by its batch size, and of what a
    chunk riding in a step adds to it by the chunk's (padded) size."""

    step_s: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    chunk_s: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))

    def stepped(self, size: int, seconds: float) -> TickCosts:
        return TickCosts(_averaged(self.step_s, size, seconds), self.chunk_s)

    def chunked(self, size: int, seconds: float) -> TickCosts:
        return TickCosts(self.step_s, _averaged(self.chunk_s, size, seconds))


def chunk_estimates(costs: TickCosts, sizes: Sequence[int]) -> dict[int, float | None]:
    """Each chunk size's cost: measured, else twice its next smaller size's estimate, else
    unknown (None: no smaller size measured)."""
    out: dict[int, float | None] = {}
    below: float | None = None
    for size in sorted(sizes):
        below = costs.chunk_s.get(size, None if below is None else 2 * below)
        out[size] = below
    return out


def chunk_limit(sizes: Sequence[int], step_size: int, costs: TickCosts,
                stall: float | None) -> int:  # fmt: skip
    """The largest chunk a tick may evaluate in a decode step of `step_size` rows (0: none
    decode). Without a bound or a decoding row: the largest size. Before a step of that
    size was measured, or when no size fits: the smallest."""
    if not step_size or not stall:
        return max(sizes)
    step = costs.step_s.get(step_size)
    if step is None:
        return min(sizes)
    budget = HEADROOM * (stall - 1.0) * step
    fit = [s for s, e in chunk_estimates(costs, sizes).items() if e is not None and e <= budget]
    return max(fit, default=min(sizes))


def overtakes(suffix: int, remaining: Sequence[int], sizes: Sequence[int],
              displaces: bool = False) -> bool:  # fmt: skip
    """Whether a request with `suffix` prompt tokens to evaluate may start prefilling beside
    the prompts in flight, with `remaining` tokens left each: none in flight, or it fits
    one whole chunk (the largest of `sizes`), is shorter than each of them, and replaces no
    agent's session between two tool turns (`displaces`): a prompt in flight holds its own
    session, so one started beside it can only replace another's, and an agent's whose
    tool results are coming would then not continue live — waiting leaves the choice to
    when the prompt in flight is done (with two sessions, two agents' first turns started
    beside a long prompt displaced each other, and no tool turn continued live)."""
    if not remaining:
        return True
    return not displaces and suffix <= max(sizes) and all(suffix < r for r in remaining)


def next_prefill(remaining: Sequence[int], passed: Sequence[int]) -> int:
    """The index of the prompt in flight this tick advances: the earliest one passed over
    `PASS_BOUND` ticks in a row, else the one with the fewest tokens left (ties: the
    earliest)."""
    starved = [i for i, p in enumerate(passed) if p >= PASS_BOUND]
    if starved:
        return starved[0]
    return min(range(len(remaining)), key=lambda i: (remaining[i], i))
