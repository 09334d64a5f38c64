"""What the engine retains between requests, and how it lets go.

Sessions, their live frontiers and bindings, fork points; the state budget's evictions (to
the host-RAM tier, else saved to disk first), the 529 for a request the budget cannot hold,
and the store's saves. Readers on other threads (the server's) take the state lock; the
scheduler writes under it. `Sessions` is a part of `Engine`, which owns the pool and the
store (`core`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import jax

from ds4jax.chat.segments import normalize
from ds4jax.continuation.pool import (
    Pool,
    Route,
    Session,
    evictions,
    held_bytes,
    host_victims,
    route,
)
from ds4jax.continuation.types import Bindings, Decision, LiveFrontier, Rejection
from ds4jax.engine.requests import EngineError, Prepared
from ds4jax.kvstore.host import HostState, least_bytes, to_host
from ds4jax.kvstore.pages import pages_for
from ds4jax.kvstore.store import NoStore, SaveReason
from ds4jax.model.sharding import fetch
from ds4jax.model.state import capacity_bytes

#: one logger for the whole engine, so its lines keep the name they always had
log = logging.getLogger("ds4jax.engine")


class Sessions:
    """The session pool's views, routing, the state budget, and saves."""

    @property
    def session(self) -> Session:
        """The session of the latest request."""
        return self.pool.sessions[self.pool.current]

    @property
    def live(self) -> LiveFrontier | None:
        """The latest request's live frontier (the only one of a single-session engine)."""
        return self.session.live

    @live.setter
    def live(self, frontier: LiveFrontier | None) -> None:
        self.session.live = frontier

    @property
    def bindings(self) -> Bindings:
        return self.session.bindings

    def live_tool_ids(self) -> frozenset[str]:
        """The tool ids of every session's live tool call."""
        with self._state_lock:
            return self.pool.live_tool_ids()

    def stats(self) -> dict[str, Any]:
        with self._state_lock:
            return self.pool.stats()

    def route(self, prepared: Prepared) -> Route | Rejection | None:
        with self._state_lock:
            return route(prepared.view, self.pool, self.store, prepared.hint,
                         busy=self._busy_slots())  # fmt: skip

    def decide(self, prepared: Prepared) -> Decision | Rejection | None:
        r = self.route(prepared)
        return r.decision if isinstance(r, Route) else r

    def _busy_slots(self) -> frozenset[int]:
        slots = {t.session.slot for t in self._rows if t is not None}
        slots.update(t.session.slot for t in self._prefilling)
        return frozenset(slots)

    def _enforce_budget(self, keep: int | None, budget: int | None = None, pages: int = 0) -> bool:
        """Drop what the state budget (or `budget`) no longer holds, beside the sessions
        serving requests and `keep`; with a store, evicted states are saved first (they
        come back as disk hits). With `pages`, only if that frees so many pages (False, and
        nothing dropped, when it cannot)."""
        with self._state_lock:
            busy = self._busy_slots() | ({keep} if keep is not None else set())
            forks, slots = evictions(self.pool, busy, budget)
            if pages and self._pages_freed(forks, slots) < pages:
                return False
            dropped = [f.frontier for f in forks]
            self.pool.forks = [f for f in self.pool.forks if f not in forks]
            for i in slots:
                session = self.pool.sessions[i]
                if not self._to_host(session, busy, dropped):
                    dropped.append(session.live)
                    session.clear()
        for frontier in dropped:
            if frontier is not None and frontier.pos:
                log.info("evict %d tokens (state budget)", frontier.pos)
                self._save(frontier.tokens, frontier.state, SaveReason.EVICT)
        return True

    def _to_host(self, session: Session, keep: set[int], dropped: list[Any]) -> bool:
        """Move an evicted session's state to the host tier, whole session kept (sessions
        held there longest go on to `dropped` to make room); False when there is no tier or
        the state cannot fit it. Under the state lock."""
        if self.host_budget is None or session.live is None:
            return False
        dense = self.pages.dense(session.live.state) if self.pages else session.live.state
        if least_bytes(dense) > self.host_budget:  # never fits: no copy to throw away
            return False
        host = to_host(dense)
        victims = host_victims(self.pool, host.nbytes, self.host_budget, keep | {session.slot})
        if victims is None:
            return False
        for i in victims:
            dropped.append(self.pool.sessions[i].live)
            self.pool.sessions[i].clear()
        session.live = replace(session.live, state=host)
        log.info("spill %d tokens of session %d to host RAM (%d bytes)", session.live.pos,
                 session.slot, host.nbytes)  # fmt: skip
        return True

    def _check_room(self, tokens: int, slot: int) -> None:
        """Refuse, changing nothing, a request whose state the budget cannot hold beside
        the states of the requests in flight, whatever else it evicts: a 529 (the client
        retries; `serve` adds `retry-after`)."""
        budget = self.pool.budget
        if budget is None:
            return
        if self.pages is None:
            need = capacity_bytes(self.cfg, self._span(tokens))
        else:  # its pages (none shared, at worst) and its small part
            need = pages_for(tokens) * self.pages.page_nbytes + self.pages.small_nbytes
        with self._state_lock:
            busy = self._busy_slots() - {slot}
            held = held_bytes(self.pool, busy)
        if held + need > budget:
            raise EngineError(
                529,
                f"overloaded: a {tokens}-token state ({need} bytes) does not fit the state "
                f"budget ({budget} bytes) beside the {len(busy)} requests in flight "
                f"({held} bytes); retry shortly",
                "overloaded_error",
            )

    def _save(self, tokens: tuple[int, ...], state: Any, reason: str) -> None:
        """Hand a state to the store (written in the background unless the engine was made
        without `background_saves`: the state is immutable). Never rolls the live state
        back; a failing store is logged, not raised: serving goes on without the
        checkpoint."""
        try:
            if isinstance(self.store, NoStore):
                return
            if isinstance(state, HostState):
                state = state.dense()
            elif self.pages is not None:
                state = self.pages.dense(state)
            if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(state)):
                # split over processes (a group's mesh without a data axis): every process
                # gathers it here, in step, and process 0's store writes it (the store's
                # writer could not read the other processes' parts: every save failed)
                state = jax.tree.map(fetch, state)
            self.store.save(
                tokens, normalize(self.segments_of(tokens)), state, reason, self.tool_memory
            )
        except Exception as err:
            log.warning("kv store: %s save of %d tokens failed: %s", reason, len(tokens), err)

    def shutdown(self) -> None:
        """Clean exit: persist every session's live frontier (the store decides whether to
        keep each), the latest request's first."""
        with self._lock:
            order = sorted(self.pool.sessions, key=lambda s: -s.used)
            for live in (s.live for s in order):
                if live is not None and live.pos:
                    self._save(live.tokens, live.state, SaveReason.SHUTDOWN)
        flush = getattr(self.store, "flush", None)
        if flush is not None:  # every save asked for, written before the process exits
            flush()

    def reset(self) -> None:
        """Forget every session and fork point (a restart, as far as RAM goes)."""
        with self._lock, self._state_lock:
            self.pool = Pool.create(len(self.pool.sessions), **self._pool_args)
