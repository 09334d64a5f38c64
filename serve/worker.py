"""One worker thread in front of the engine, and the bridge back to asyncio.

Model work never runs on the event loop: pings, /health and new connections stay
responsive while a request prefills. Jobs are FIFO in a bounded queue (a full queue is a
503 `overloaded_error`); a job cancelled before it starts is skipped, one cancelled while
running stops at the engine's next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds4jax.engine import Engine, Prepared


class Overloaded(RuntimeError):
    pass


@dataclass
class Job:
    prepared: Prepared
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    forced_tokens: list[int] | None = None  # tests only; never set from HTTP input

    def post(self, kind: str, payload: Any = None) -> None:
        """Thread-safe: deliver (kind, payload) to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the client is gone
            pass


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int = 16) -> None:
        self.engine = engine
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="ds4jax-engine", daemon=True)
        self.running: Job | None = None
        self.hooks: list[Callable[[Job, Any], None]] = []  # called after each finished job
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._thread.start()
            self._started = True

    @property
    def depth(self) -> int:
        return self._jobs.qsize() + (1 if self.running is not None else 0)

    def submit(self, job: Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full as err:
            raise Overloaded("the server is busy; retry later") from err
        job.post("queued", self._jobs.qsize())

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running job, refuse the queued ones, and join the thread."""
        if self.running is not None:
            self.running.cancel.set()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.post("error", Overloaded("the server is shutting down"))
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        if self._started:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancel.is_set():
                continue
            self.running = job
            try:
                result = self.engine.run(
                    job.prepared,
                    on_event=lambda ev, j=job: j.post("event", ev),
                    progress=lambda done, total, j=job: j.post("progress", (done, total)),
                    cancel=job.cancel,
                    on_decision=lambda d, n, j=job: j.post("decided", (d, n)),
                    forced_tokens=job.forced_tokens,
                )
            except Exception as err:  # reported to the client; the worker lives on
                job.post("error", err)
                result = err
            else:
                job.post("done", result)
            finally:
                self.running = None
            for hook in self.hooks:
                try:
                    hook(job, result)
                except Exception:  # a trace writer must never take the worker down
                    pass
