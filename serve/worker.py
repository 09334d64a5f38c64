"""One worker thread in front of the engine's scheduler, and the bridge back to asyncio.

Model work never runs on the event loop: pings, /health and new connections stay
responsive while requests prefill and decode. Jobs arrive in a bounded FIFO queue (a full
queue is a 503 `overloaded_error`: it counts requests not yet started, never the ones
decoding); the worker hands each to the engine (`Engine.submit`) and steps the engine's
scheduler (`Engine.tick`) while it has work, so requests decode together, a new one's
prefill interleaves chunk by chunk with the others' tokens, and each stream gets its
tokens as they are sampled. A job cancelled before it starts is skipped; one cancelled
while running stops at the engine's next step.

A job carries its own timeline (arrived, submitted, decided, first content event, tokens,
finished), written on the engine's thread as things happen, so the server's metrics and log
lines read one clock (`time.perf_counter`) and no request is timed twice.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ds4jax.chat.kinds import Finish
from ds4jax.continuation.types import Decision
from ds4jax.engine import Engine, Prepared, Result
from ds4jax.engine.requests import Cancelled
from ds4jax.engine.ticket import Ticket

log = logging.getLogger("ds4jax.serve")


class Overloaded(RuntimeError):
    pass


SHUTTING_DOWN = "the server is shutting down; retry shortly"


@dataclass
class Job:
    prepared: Prepared
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    forced_tokens: list[int] | None = None  # tests only; never set from HTTP input
    #: the request's timeline, `time.perf_counter()` seconds: when its HTTP request arrived
    arrived: float = field(default_factory=time.perf_counter)
    submitted: float | None = None  # queued for the engine
    decided: float | None = None  # routed: its continuation path chosen, prefill begins
    first_event: float | None = None  # its first content event (a stream's first delta)
    first_token: float | None = None  # the first token of its reply
    last_token: float | None = None
    finished: float | None = None
    tokens: int = 0  # tokens of its reply so far

    def post(self, kind: str, payload: Any = None) -> None:
        """Thread-safe: deliver (kind, payload) to the request's coroutine."""
        if kind == "event" and self.first_event is None:
            self.first_event = time.perf_counter()
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the client is gone
            pass


class Observer(Protocol):
    """What watches jobs go by (the server's metrics); called on the engine's thread, so
    each call must be quick and must not raise."""

    def decided(self, job: Job, decision: Decision, prefill: int) -> None: ...

    def token(self, job: Job, gap: float | None) -> None: ...

    def finished(self, job: Job, result: Any) -> None: ...


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int = 16) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="ds4jax-engine", daemon=True)
        self._inflight: list[Job] = []  # handed to the engine, not finished
        self.running: Job | None = None  # the latest job handed to the engine, until it ends
        self.hooks: list[Callable[[Job, Any], None]] = []  # called after each finished job
        #: weak: an app that goes away (tests make many over one worker) stops observing
        self._observers: tuple[weakref.ref[Observer], ...] = ()
        self._started = False
        self._stopping = False
        #: why the worker can serve nothing more (`fail`), else None
        self.failed: str | None = None

    def start(self) -> None:
        if not self._started:
            self._thread.start()
            self._started = True

    @property
    def depth(self) -> int:
        """Jobs queued, prefilling or decoding."""
        return self._jobs.qsize() + len(self._inflight)

    @property
    def waiting(self) -> int:
        """Requests not started yet: queued here, or handed over and waiting for a row."""
        return self._jobs.qsize() + len(self.engine.waiting)

    def submit(self, job: Job) -> None:
        if self.failed is not None:
            raise Overloaded(f"the server failed ({self.failed}); retry shortly")
        if self._stopping:
            raise Overloaded(SHUTTING_DOWN)
        if self.waiting >= self.max_queue:
            raise Overloaded("the server is busy; retry later")
        try:
            self._jobs.put_nowait(job)
        except queue.Full as err:
            raise Overloaded("the server is busy; retry later") from err
        job.submitted = time.perf_counter()
        job.post("queued", self._jobs.qsize())
        if self.failed is not None:  # `fail` drained the queue between the check and the put
            self._refuse(job)

    def fail(self, why: str) -> None:
        """Nothing can be served any more (the engine could not recover from a step's
        failure; a process of the group is gone): every request in flight or queued gets
        its 503 now — a stream its error event — from any thread, without waiting on the
        engine's (it may never return), and new ones are refused. Health reads `failed`."""
        self.failed = why
        stopped = False
        for job in list(self._inflight):
            self._refuse(job)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stopped = True
            else:
                self._refuse(job)
        if stopped:  # `stop`'s sentinel stays for the thread to read
            self._jobs.put_nowait(None)

    def _refuse(self, job: Job) -> None:
        """A job `fail` answers: told to the observers and hooks (the log line, the
        metrics) as what its client gets, then posted."""
        err = Overloaded(f"the server failed ({self.failed}); retry shortly")
        job.finished = time.perf_counter()
        self._record(job, err)
        job.post("error", err)

    def _record(self, job: Job, result: Any) -> None:
        """A job's end, counted and logged (observers, then hooks) before its client hears
        of it: a scrape, the log or the trace read after the reply already have it."""
        self._tell("finished", job, result)
        for hook in self.hooks:
            try:
                hook(job, result)
            except Exception:  # a trace writer must never take the worker down
                pass

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running jobs, refuse the queued ones, and join the thread. Every job
        not finished by then ends in a 503 "shutting down" (a stream with its error event),
        so a client retries against the next server instead of reading a cut reply as
        complete. Idempotent: the server calls it when a signal arrives, while the
        connections are still open, and again on its way out."""
        if self._stopping:
            return
        self._stopping = True
        for job in list(self._inflight):
            job.cancel.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.post("error", Overloaded(SHUTTING_DOWN))
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        if self._started:
            self._thread.join(timeout)

    def _start_job(self, job: Job) -> None:
        if self.failed is not None:  # taken off the queue as `fail` drained it
            self._refuse(job)
            return
        self._inflight.append(job)
        if self._stopping:  # taken off the queue as `stop` began: it may not have seen it
            job.cancel.set()  # (appended first, read second: one of the two sees the other)
        self.running = job
        self.engine.submit(
            job.prepared,
            on_event=lambda ev, j=job: j.post("event", ev),
            progress=lambda done, total, j=job: j.post("progress", (done, total)),
            cancel=job.cancel,
            on_decision=lambda d, n, j=job: self._decided(j, d, n),
            forced_tokens=job.forced_tokens,
            on_done=lambda t, j=job: self._finished(j, t),
            on_token=lambda j=job: self._token(j),
        )

    def _decided(self, job: Job, decision: Decision, prefill: int) -> None:
        job.decided = time.perf_counter()
        self._tell("decided", job, decision, prefill)
        job.post("decided", (decision, prefill))

    def _token(self, job: Job) -> None:
        now = time.perf_counter()
        gap = None if job.last_token is None else now - job.last_token
        if job.first_token is None:
            job.first_token = now
        job.last_token = now
        job.tokens += 1
        self._tell("token", job, gap)

    def watch(self, observer: Observer) -> None:
        """Tell `observer` of every job from now on, for as long as something else holds it."""
        alive = tuple(r for r in self._observers if r() is not None)
        self._observers = (*alive, weakref.ref(observer))  # replaced whole: no lock to read

    def _tell(self, what: str, *args: Any) -> None:
        for ref in self._observers:
            observer = ref()
            if observer is None:
                continue
            try:
                getattr(observer, what)(*args)
            except Exception:  # metrics must never take the worker down
                log.exception("observer %s failed", what)

    def _finished(self, job: Job, ticket: Ticket | None) -> None:
        """`ticket` None: the job was cancelled before the engine had it; a ticket that
        failed `Cancelled`: before the engine routed it. Either way its client is gone."""
        job.finished = time.perf_counter()
        if ticket is None:
            result: Any = Cancelled("the client went away while the request was queued")
        else:
            result = ticket.error if ticket.error is not None else ticket.result
        if job in self._inflight:
            self._inflight.remove(job)
        if self.running is job:
            self.running = None
        refused = self._stopping and (
            isinstance(result, Cancelled)
            or (isinstance(result, Result) and result.finish == Finish.CANCELLED)
        )  # cut short by the shutdown (or its client left meanwhile): a 503 to retry
        if refused:  # logged and counted as what its client gets, not as a client gone
            result = Overloaded(SHUTTING_DOWN)
        self._record(job, result)
        if refused:
            job.post("error", result)
        elif not isinstance(result, Cancelled):  # an error is reported to the client; the
            job.post("error" if ticket.error is not None else "done", result)  # worker lives on

    def _loop(self) -> None:
        while True:
            if self.engine.busy:  # keep stepping; take new jobs as they come
                try:
                    job: Job | bool | None = self._jobs.get_nowait()
                except queue.Empty:
                    job = False
            else:  # idle: sleep until a job (or the stop sentinel) arrives
                job = self._jobs.get()
            if job is None:
                self._drain()
                return
            if isinstance(job, Job):
                if job.cancel.is_set():  # its client left while it was queued
                    self._finished(job, None)
                else:
                    self._start_job(job)
            self._step()

    def _step(self) -> None:
        if self.engine.busy:
            try:
                self.engine.tick()
            except Exception as err:  # never expected: fail what is in flight, go on
                log.exception("engine step failed")
                try:
                    self.engine.abort(err)
                except Exception as again:  # the engine cannot even reset its batch
                    log.exception("engine abort failed: the server can serve nothing more")
                    self.fail(f"engine: {again}")
                    raise

    def _drain(self) -> None:
        """Stopping: let the cancelled jobs in flight reach their next step and end."""
        while self.engine.busy:
            self._step()
