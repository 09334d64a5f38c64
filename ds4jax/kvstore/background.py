"""Disk saves off the request path: a store whose `save` hands the state to one writer thread.

A frontier is an immutable pytree, so a save can take its state and write it later while the
request that produced it goes on — a cold prefill's save at its cut point no longer delays
the prompt's first token, and an eviction no longer delays the end of a stream. The writer is
one thread, so saves land in the order they were asked for, through the wrapped store's own
code (its crash safety and checksums unchanged).

Readers see every save asked for before them: `lookup`, `checkpoints` and `tool_entries`
wait for the pending saves first. A request served from a live state or a fork point never
reads the store, so it never waits; one that reaches the disk step waits only for saves it
might find. `flush` waits for everything (the engine's shutdown calls it). Anything else is
the wrapped store's.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger("ds4jax.kvstore")

EXIT_WAIT_S = 60.0  # at interpreter exit, how long pending saves may still take


class BackgroundSaves:
    def __init__(self, store: Any) -> None:
        self.store = store
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write, name="ds4jax-saves", daemon=True)
        self._thread.start()
        # a process that exits mid-save would kill the writer inside JAX / Orbax (an abort):
        # let pending saves finish first, for a bounded time (registered after JAX started,
        # so this runs before JAX's own exit handlers)
        atexit.register(self.flush, EXIT_WAIT_S)

    def __getattr__(self, name: str) -> Any:  # continued_every, cold_cut, reasons, …
        return getattr(self.store, name)

    def save(self, tokens: Any, segments: Any, state: Any, reason: str, tool_memory: Any) -> None:
        self._jobs.put((tokens, segments, state, reason, tool_memory))

    def _write(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is not None:
                    self.store.save(*job)
            except Exception as err:  # the wrapped store logs its own; never kill the writer
                log.warning("kv cache background save failed: %s", err)
            finally:
                self._jobs.task_done()

    @property
    def pending(self) -> int:
        return self._jobs.unfinished_tasks

    def flush(self, timeout: float | None = None) -> bool:
        """Until every save asked for so far is written (or has failed), or `timeout`
        seconds; whether everything was."""
        if timeout is None:
            self._jobs.join()
            return True
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.pending:
            log.warning("kv cache: %d save(s) still pending after %.0f s", self.pending, timeout)
        return not self.pending

    def lookup(self, segments: Any) -> Any:
        self.flush()
        return self.store.lookup(segments)

    def checkpoints(self) -> Any:
        self.flush()
        return self.store.checkpoints()

    def tool_entries(self) -> Any:
        self.flush()
        return self.store.tool_entries()
