"""`Ticket`: one request in the scheduler — the caller's hooks, then how far it got.

Apart because every part of the engine moves it along (admission routes and prefills it,
the step decodes it, paging may fail it) and the server holds it (`serve.worker`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.segments import Segment
from ds4jax.chat.turn import Event
from ds4jax.continuation.pool import Route, Session
from ds4jax.continuation.types import Decision
from ds4jax.decoding import Result, RowDecoder, TokenLogprob, ToolCallStarted
from ds4jax.engine.requests import Prepared


@dataclass(eq=False)
class Ticket:
    """One request in the scheduler: what it was given, then its progress."""

    prepared: Prepared
    emit: Callable[[Event | ToolCallStarted | TokenLogprob], None]
    progress: Callable[[int, int], None] | None
    cancel: threading.Event | None
    on_decision: Callable[[Decision, int], None] | None
    forced: list[int] | None
    on_done: Callable[[Ticket], None] | None = None
    #: after each token the row evaluated (or its sampled EOS): the server's metrics
    on_token: Callable[[], None] | None = None
    result: Result | None = None
    error: Exception | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    # set when it starts: the route, the prompt, the prefill cursor, then its row
    routed: Route | None = None
    decision: Decision | None = None
    session: Session | None = None
    tokens: list[int] = field(default_factory=list)
    suffix_n: int = 0
    base_segments: tuple[Segment, ...] = ()
    state: Any = None
    done_tokens: int = 0
    #: ticks in a row a shorter prompt in flight was prefilled instead (`interleave`); while
    #: it waits first in line, the later requests started past it (`Admission`)
    passed: int = 0
    cuts: dict[int, str] = field(default_factory=dict)
    before_think: int | None = None
    before_think_state: Any = None
    t0: float = 0.0
    prefill_seconds: float = 0.0
    decoder: RowDecoder | None = None
    #: with paged frontiers: the one the prompt continued, then the prompt end's
    base_paged: Any = None
    #: where its base state came back from before continuing: "host" (`kvstore.host`)
    restored: str | None = None

    def route_fields(self) -> dict[str, Any]:
        """Its result's fields that its route and prefill decided (the decoder knows the
        rest): what it continued, what it evaluated of its prompt, and where."""
        d, r = self.decision, self.routed
        assert d is not None and r is not None and self.session is not None
        return {
            "source": d.source,
            "cached": d.cached,
            "prefilled": self.done_tokens - len(d.base),
            "prefill_seconds": self.prefill_seconds,
            "session": self.session.slot,
            "forked_from": r.fork.owner if r.fork else None,
            "restored": self.restored,
        }

    @property
    def withdrawn(self) -> bool:
        """Its caller cancelled it (the client left)."""
        return self.cancel is not None and self.cancel.is_set()

    def succeed(self, result: Result) -> None:
        self.result = result
        self._end()

    def fail(self, err: Exception) -> None:
        self.error = err
        self._end()

    def _end(self) -> None:
        self.finished.set()
        if self.on_done is not None:
            self.on_done(self)
