"""Resident sessions, fork points, and the routing that gives a request one of them.

Agents run sub-agents, side requests and retries against one server, so one live frontier
is not enough: a request that merely looks like the live conversation would throw it away.
A frontier is an immutable state pytree, so keeping several is keeping references, and
forking from one is free. This module is plain data and pure functions (no JAX): the engine
owns the states and applies what `route` and `evictions` decide.

* A **session** is a slot (0..N-1; later the row of a batched decode) holding a live
  frontier, its bindings (tool ids, thinking) and the client hint it last served.
* A **fork point** is the state at the end of a prompt prefill, before decoding: an
  immutable frontier retained with the slot that made it. A retry, a regenerate, an edited
  last reply, a side request sharing the conversation or a sub-agent sharing system + tools
  continues from the deepest one instead of prefilling again.

`route` tries, in order (first match wins):

1. the session whose live tool ids equal the request's `tool_result` ids (set equality);
   a request that needs the live state and matches none is a 409 — fork points never
   paper over a tool-id mismatch;
2. the session whose live frontier the request extends (thinking-visible, exact token
   prefix, live text prefix), the deepest;
3. the deepest fork point (token prefix, else text prefix with the rest tokenized alone),
   continued in a **new** session: the point's owner may have moved on, and its live
   frontier is never overwritten while another slot exists;
4. the longest disk checkpoint;
5. cold.

Steps 3–5 take an empty slot if there is one, else the least recently used one that is not
waiting for tool results, else the least recently used (its live frontier the engine saves
to disk first when a store is configured), so a request that merely shares a system prompt
never takes a live session while an empty slot exists.
Between equally deep matches the better path wins (`_rank`: thinking-visible, then an
exact token prefix, then a live text prefix — sampled ids over a retokenization), then a
client hint (Claude Code's `metadata.user_id`, an `x-session-id` header), then the most
recently used session.

The budget bounds the bytes of the distinct retained states (live frontiers and fork
points; paged states by the distinct pages they hold); `evictions` drops fork points least
recently used first, then sessions in the same order as slots are taken. With a host-RAM
tier (`kvstore.host`) an evicted session's state moves there instead, the session kept
whole; `host_victims` says which host-held ones go on to disk when the tier is full.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from ds4jax.continuation.decide import cold, match_disk, match_fork, match_live, match_tool
from ds4jax.continuation.types import (
    ORDER,
    Bindings,
    Decision,
    LiveFrontier,
    Rejection,
    RequestView,
    live_gone_message,
)
from ds4jax.kvstore.store import KVStore


@dataclass
class Session:
    slot: int
    live: LiveFrontier | None = None
    bindings: Bindings = field(default_factory=Bindings)
    hint: str | None = None
    used: int = 0  # the pool clock at its last request

    @property
    def tool_ids(self) -> frozenset[str]:
        tb = self.bindings.tool
        return tb.ids if tb is not None else frozenset()

    def clear(self) -> None:
        self.live, self.bindings, self.hint = None, Bindings(), None


@dataclass(eq=False)  # identity: two points are never "equal" by their arrays
class ForkPoint:
    frontier: LiveFrontier  # immutable: the state at a prompt end, its tokens and text
    owner: int  # the slot whose prefill made it
    used: int = 0


@dataclass(frozen=True)
class Route:
    slot: int
    decision: Decision
    fork: ForkPoint | None = None  # the fork point continued (CacheSource.FORK)
    #: the slot's live frontier that this request replaces (steps 3–5 into a used slot)
    displaced: LiveFrontier | None = None


@dataclass
class Pool:
    sessions: list[Session]
    forks: list[ForkPoint] = field(default_factory=list)
    #: bytes of distinct retained states; None: unbounded
    budget: int | None = None
    #: bytes of a dense state that does not say its own (`nbytes`: a state's capacity
    #: follows its tokens, `model.state.spans`)
    state_nbytes: int = 0
    #: a paged state (one with a page `table`): bytes of a page and of its small part
    page_nbytes: int = 0
    small_nbytes: int = 0
    keep_forks: bool = True
    clock: int = 0
    current: int = 0  # the slot of the latest request
    hits: Counter = field(default_factory=Counter)  # types.source_label → requests

    @classmethod
    def create(
        cls, n: int, *, budget: int | None = None, state_nbytes: int = 0, keep_forks: bool = True,
        page_nbytes: int = 0, small_nbytes: int = 0,
    ) -> Pool:  # fmt: skip
        if n < 1:
            raise ValueError(f"a pool needs at least one session, got {n}")
        return cls([Session(i) for i in range(n)], budget=budget, state_nbytes=state_nbytes,
                   keep_forks=keep_forks, page_nbytes=page_nbytes,
                   small_nbytes=small_nbytes)  # fmt: skip

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def live_tool_ids(self) -> frozenset[str]:
        return frozenset().union(*(s.tool_ids for s in self.sessions))

    def in_use(self) -> int:
        return sum(s.live is not None for s in self.sessions)

    def state_bytes(self) -> int:
        return _bytes(self, [s.live for s in self.sessions], self.forks)

    def retain(self, frontier: LiveFrontier, owner: int) -> None:
        """Keep a prompt-end state as a fork point (one per token sequence: the newer wins)."""
        if not self.keep_forks or frontier.pos == 0:
            return
        self.forks = [f for f in self.forks if f.frontier.tokens != frontier.tokens]
        self.forks.append(ForkPoint(frontier, owner, self.tick()))

    def stats(self) -> dict[str, object]:
        return {
            "sessions": len(self.sessions),
            "sessions_in_use": self.in_use(),
            "fork_points": len(self.forks),
            "state_bytes": self.state_bytes(),
            "state_budget_bytes": self.budget,
            "hits": {**{s.value: 0 for s in ORDER}, **self.hits},
        }


def _bytes(pool: Pool, lives: list[LiveFrontier | None], forks: list[ForkPoint]) -> int:
    """Bytes of the distinct states held: a dense state its capacity; paged states their
    pages, each counted once however many frontiers share it, and a small part each."""
    states = {id(f.state): f.state for f in lives if f is not None}
    states |= {id(f.frontier.state): f.frontier.state for f in forks}
    states = {k: s for k, s in states.items() if not on_host(s)}  # the host tier's own
    paged = [s for s in states.values() if hasattr(s, "table")]
    pages = set().union(*(s.table.pages for s in paged))
    dense = sum(getattr(s, "nbytes", pool.state_nbytes) for s in states.values()
                if not hasattr(s, "table"))  # fmt: skip
    return dense + len(pages) * pool.page_nbytes + len(paged) * pool.small_nbytes


def held_bytes(pool: Pool, slots: Collection[int]) -> int:
    """Device bytes the live frontiers of `slots` hold (the requests in flight)."""
    return _bytes(pool, [pool.sessions[i].live for i in slots], [])


def on_host(state: object) -> bool:
    """A state in the host-RAM tier (`kvstore.host`): it costs no device bytes."""
    return getattr(state, "on_host", False)


def host_bytes(pool: Pool) -> int:
    return sum(s.live.state.nbytes for s in pool.sessions
               if s.live is not None and on_host(s.live.state))  # fmt: skip


def host_victims(
    pool: Pool, need: int, host_budget: int, keep: Collection[int] = ()
) -> list[int] | None:
    """The sessions to move out of the host tier (to disk, or dropped) so that a state of
    `need` bytes fits `host_budget` beside the rest, in the order sessions give up device
    room (`_victim_order`: one waiting for tool results last); None when it cannot fit."""
    if need > host_budget:
        return None
    held = sorted((s for s in pool.sessions if s.slot not in keep and s.live is not None
                   and on_host(s.live.state)), key=_victim_order)  # fmt: skip
    total, out = host_bytes(pool), []
    for s in held:
        if total + need <= host_budget:
            break
        total -= s.live.state.nbytes
        out.append(s.slot)
    return out if total + need <= host_budget else None


def _victim_order(s: Session) -> tuple[bool, int]:
    """Which used session to give up first: one that is not waiting for tool results (an
    agent's tool may run for minutes; its session is the one it will come back to), then
    the least recently used."""
    return (s.bindings.tool is not None, s.used)


def choose_slot(
    pool: Pool, avoid: int | None = None, busy: frozenset[int] = frozenset()
) -> int | None:
    """An empty slot (the lowest), else the first victim (`_victim_order`) other than
    `avoid` (a fork's owner), else `avoid` itself (a pool of one); never a `busy` slot (one
    serving a request right now): None when every slot is."""
    free = [s for s in pool.sessions if s.slot not in busy]
    for s in free:
        if s.live is None:
            return s.slot
    others = [s for s in free if s.slot != avoid] or free
    return min(others, key=_victim_order).slot if others else None


def _rank(d: Decision, hint_match: bool, used: int) -> tuple:
    return (d.cached, -ORDER.index(d.source), hint_match, used)


def route(
    req: RequestView,
    pool: Pool,
    store: KVStore,
    hint: str | None = None,
    busy: frozenset[int] = frozenset(),
) -> Route | Rejection | None:
    """The route of a request (module docstring), or None when it has to wait: the slot
    it would take is serving another request (`busy`), whose live frontier is still moving;
    a busy slot's fork points can be forked from all the same."""
    idle = [s for s in pool.sessions if s.slot not in busy]
    for s in idle:
        hit = match_tool(req, s.live, s.bindings)
        if hit is not None:
            return Route(s.slot, hit)
    if req.requires_live:
        return Rejection(409, live_gone_message(req.api))

    best: tuple[tuple, Session, Decision] | None = None
    for s in idle:
        d = match_live(req, s.live, s.bindings)
        if d is not None:
            rank = _rank(d, hint is not None and s.hint == hint, s.used)
            if best is None or rank > best[0]:
                best = (rank, s, d)
    if best is not None:
        return Route(best[1].slot, best[2])

    fork: tuple[tuple, ForkPoint, Decision] | None = None
    for f in pool.forks:
        d = match_fork(req, f.frontier)
        if d is not None:
            owner_hint = pool.sessions[f.owner].hint
            rank = _rank(d, hint is not None and owner_hint == hint, f.used)
            if fork is None or rank > fork[0]:
                fork = (rank, f, d)
    if fork is not None:
        slot = choose_slot(pool, avoid=fork[1].owner, busy=busy)
        if slot is None:
            return None
        return Route(slot, fork[2], fork=fork[1], displaced=pool.sessions[slot].live)

    slot = choose_slot(pool, busy=busy)
    if slot is None:
        return None
    decision = match_disk(req, store) or cold(req)
    return Route(slot, decision, displaced=pool.sessions[slot].live)


def evictions(
    pool: Pool, keep: int | Collection[int], budget: int | None = None
) -> tuple[list[ForkPoint], list[int]]:
    """What to drop so the retained states fit the budget (`budget`, default the pool's:
    a smaller one frees room for pages a decoding row needs now): fork points least
    recently used first, then the least recently used sessions other than `keep` (the one
    just served, and those serving requests).
    Dropping a fork point whose state a live frontier still holds frees nothing, so it is
    kept, and so is a session whose pages other frontiers hold. Returns (fork points,
    slots); nothing is changed here."""
    budget = pool.budget if budget is None else budget
    if budget is None:
        return [], []
    keep = {keep} if isinstance(keep, int) else set(keep)
    lives = {s.slot: s.live for s in pool.sessions}
    forks = list(pool.forks)
    drop_forks: list[ForkPoint] = []
    drop_slots: list[int] = []

    def size(fs: list[ForkPoint]) -> int:
        return _bytes(pool, list(lives.values()), fs)

    def shed_forks() -> None:
        nonlocal forks
        for f in sorted(forks, key=lambda f: f.used):
            if size(forks) <= budget:
                return
            rest = [g for g in forks if g is not f]
            if size(rest) < size(forks):
                forks = rest
                drop_forks.append(f)

    shed_forks()
    idle = sorted((s for s in pool.sessions if s.slot not in keep and s.live is not None
                   and not on_host(s.live.state)), key=_victim_order)  # fmt: skip
    for s in idle:
        before = size(forks)
        if before <= budget:
            break
        saved, shed = forks, len(drop_forks)
        lives[s.slot] = None
        shed_forks()  # fork points that shared this session's state free bytes now
        if size(forks) >= before:  # its pages are all held by others: dropping frees nothing
            lives[s.slot], forks = s.live, saved
            del drop_forks[shed:]
            continue
        drop_slots.append(s.slot)
    return drop_forks, drop_slots
