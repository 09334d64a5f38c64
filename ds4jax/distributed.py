"""One engine over several processes, with JAX's own multi-controller runtime.

Every process of the group holds the same `Engine` over one global mesh, and every process
must make the same jitted calls in the same order: each call is a collective over all the
devices. Process 0, the leader, runs the HTTP server and so the only scheduler whose inputs
are not known in advance: requests arrive, clients cancel, errors abort. Before each engine
operation the leader publishes what the others need to make the same call — the requests
handed over since the last step, the cancellations it has seen, the operation — through
the key-value store of `jax.distributed`'s coordination service; followers replay the
operations in order. No RPC of our own.

Replay is exact because everything else the scheduler reads is a function of those inputs:
routing, fork choice and batching are pure functions of the pool; the sampled tokens come
out of the jitted step replicated on every process; a request's sampling key and tool ids
derive from its `Prepared.nonce`, which travels with it; cancellations are applied at step
boundaries on every process, never mid-step.

Failure: the coordination service's heartbeats (`HEARTBEAT_TIMEOUT_S`) find a dead process.
The leader's `Watchdog` then reports which one, so the server fails health and exits
non-zero; a follower whose leader is gone exits non-zero. A step already running when a
process dies may never return; the exit does not wait for it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import jax
import numpy as np

from ds4jax.engine import Engine, EngineError, Prepared
from ds4jax.engine.ticket import Ticket
from ds4jax.kvstore import policy
from ds4jax.kvstore.checkpoint import KVStoreError
from ds4jax.kvstore.store import DiskHit
from ds4jax.model.state import init_state, span_for, spans

log = logging.getLogger("ds4jax.distributed")

#: seconds without a heartbeat before the coordination service calls a process dead
#: (env `DS4JAX_HEARTBEAT_TIMEOUT_S` overrides)
HEARTBEAT_TIMEOUT_S = int(float(os.environ.get("DS4JAX_HEARTBEAT_TIMEOUT_S", "10")))
#: published operations kept in the key-value store: followers are at most a step behind
#: (every step is a collective), so older ones are deleted
KEEP_OPS = 64
#: seconds the group's clean exit waits for every process
STOP_TIMEOUT_S = 30
_KEY = "ds4jax/op/{}"
_STOP_BARRIER = "ds4jax/stop"


#: seconds `initialize` waits for every process of the group to join (env
#: `DS4JAX_JOIN_TIMEOUT_S`); past it the runtime ends the process, non-zero
JOIN_TIMEOUT_S = int(float(os.environ.get("DS4JAX_JOIN_TIMEOUT_S", "300")))


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize` before any other JAX call. On CPU each process takes
    `JAX_NUM_CPU_DEVICES` devices (JAX reads it) and collectives go through gloo. A
    loopback coordinator (127.0.0.1, localhost: a group on one machine) is served on that
    address only, not on every interface as JAX's default: the operations it carries are
    for the group alone."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # a dead process is reported (`Channel.dead`, the `Watchdog`) rather than aborting every
    # other process from inside the runtime: the server says which one and exits itself
    jax.config.update("jax_enable_recoverability", True)
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    loopback = host == "localhost" or host == "::1" or host.startswith("127.")
    jax.distributed.initialize(
        coordinator, num_processes, process_id, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        initialization_timeout=JOIN_TIMEOUT_S + 60,  # past `serve`'s own timer: its line
        coordinator_bind_address=coordinator if loopback else None,
    )  # fmt: skip


#: seconds a process waits for the others' flags (they all passed `initialize`, which
#: waits for the whole group, so they are close behind), and for their engine settings,
#: which come once each has loaded its weights (a Hub download, a slow disk: env
#: `DS4JAX_LOAD_TIMEOUT_S`)
AGREE_TIMEOUT_S = 300.0
LOAD_TIMEOUT_S = float(os.environ.get("DS4JAX_LOAD_TIMEOUT_S", "3600"))
#: what each host's own memory decides when no flag sets it (`engine_settings`)
MEMORY_SETTINGS = frozenset({"state budget", "pages"})


def agree(what: str, settings: dict[str, Any], client: Any = None,
          timeout_s: float = AGREE_TIMEOUT_S, poll_s: float = 10.0) -> None:  # fmt: skip
    """Refuse to go on unless every process of the group has the same `settings` (`what`
    names them in the refusal): a follower replays the leader's operations against its own
    settings, so one started with another --ctx or --sessions served until the first
    request they route differently, then hung in a collective forever or aborted both
    processes. Each process publishes its own; the leader compares every follower's, each
    follower the leader's, so the processes of a mismatched pair exit with the difference
    named (a third process that matches the leader is then ended by the runtime). A
    process that leaves, or does not report within `timeout_s`, is named too."""
    client = client if client is not None else _client()
    me, n = jax.process_index(), jax.process_count()
    key = "ds4jax/agree/" + what.replace(" ", "-") + "/{}"
    mine = {k: str(v) for k, v in settings.items()}
    client.key_value_set(key.format(me), json.dumps(mine, sort_keys=True))
    for other in range(1, n) if me == 0 else [0]:
        theirs = json.loads(_wait_for(client, key.format(other), other, what, timeout_s, poll_s))
        keys = sorted(mine.keys() | theirs.keys())
        differ = [k for k in keys if mine.get(k) != theirs.get(k)]
        if differ:
            if me == 0:  # the followers read this process's values from the service it
                time.sleep(2.0)  # hosts: a moment for them to, so each names the difference
            said = "; ".join(f"{k}: {mine.get(k)} here, {theirs.get(k)} on process {other}"
                             for k in differ)  # fmt: skip
            hint = ("each host's memory set its default: pass the same --state-budget-mb or "
                    "--state-memory to every process" if set(differ) <= MEMORY_SETTINGS
                    else "every process must be started with the same ones")  # fmt: skip
            raise SystemExit(f"ds4jax serve: process {me} and process {other} of the group "
                             f"differ in {what} ({said}): {hint}")  # fmt: skip


def _wait_for(client: Any, key: str, other: int, what: str, timeout_s: float,
              poll_s: float) -> str:  # fmt: skip
    """Process `other`'s value of `key`, waited for in rounds, so that one which left the
    group is named at once rather than at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return client.blocking_key_value_get(key, int(max(1.0, min(poll_s, left)) * 1000))
        except Exception as err:  # a round's deadline, or the service itself is gone
            if "DEADLINE_EXCEEDED" not in str(err) and "timed out" not in str(err).lower():
                raise SystemExit(f"ds4jax serve: process {other} left the group before it "
                                 f"reported its {what} (if it refused them, its log says "
                                 "why)") from err  # fmt: skip
        if other not in client.get_live_nodes(list(range(jax.process_count()))):
            raise SystemExit(f"ds4jax serve: process {other} left the group before it "
                             f"reported its {what}")  # fmt: skip
        if time.monotonic() >= deadline:
            raise SystemExit(f"ds4jax serve: process {other} did not report its {what} "
                             f"within {timeout_s:.0f} s")  # fmt: skip


def engine_settings(engine: Engine) -> dict[str, Any]:
    """What a follower's engine must share with the leader's to replay its operations:
    the model's shape and the pool's and batch's sizes, which flags and each host's own
    memory (a default state budget) decide."""
    pages = engine.pages.pool.num_pages if engine.pages is not None else None
    cfg = engine.cfg
    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {"": cfg}
    return {
        **{f"model config {k}".strip(): v for k, v in fields.items()},
        "context": engine.max_len,
        "chunk sizes": engine.chunk_sizes, "sessions": len(engine.pool.sessions),
        "state budget": engine.pool.budget, "pages": pages, "max batch": engine.max_batch,
        "stall bound": engine.stall_bound, "burst": engine.burst,
    }  # fmt: skip


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class Channel:
    """The leader's operations, in order, through the coordination service's key-value
    store (pickled: they come only from the group's own leader)."""

    def __init__(self, client: Any = None) -> None:
        self.client = client if client is not None else _client()
        self.seq = 0

    def publish(self, op: tuple) -> None:
        self.client.key_value_set_bytes(_KEY.format(self.seq), pickle.dumps(op))
        if self.seq >= KEEP_OPS:
            self.client.key_value_delete(_KEY.format(self.seq - KEEP_OPS))
        self.seq += 1

    def receive(self, timeout_s: float) -> tuple | None:
        """The next operation, or None when none came within `timeout_s`."""
        try:
            data = self.client.blocking_key_value_get_bytes(
                _KEY.format(self.seq), int(timeout_s * 1000)
            )
        except Exception as err:  # a timeout, or the service itself is gone
            if "DEADLINE_EXCEEDED" in str(err) or "timed out" in str(err).lower():
                return None
            raise
        self.seq += 1
        return pickle.loads(data)

    def dead(self) -> list[int]:
        """Processes the coordination service no longer hears from."""
        everyone = list(range(jax.process_count()))
        live = self.client.get_live_nodes(everyone)
        return [p for p in everyone if p not in live]


def _next(channel: Channel, poll_s: float = 1.0) -> tuple:
    """A follower's wait for the leader's next operation; RuntimeError once the leader is
    gone (no heartbeat, or the coordination service it hosts is unreachable)."""
    while True:
        op = channel.receive(poll_s)
        if op is not None:
            return op
        if 0 in channel.dead():
            raise RuntimeError("the leader (process 0) stopped")


def _answer(channel: Channel) -> Any:
    """The leader's next answer, published mid-step."""
    op = _next(channel)
    if op[0] != "answer":
        raise RuntimeError(f"expected the leader's answer, got {op[0]!r}: out of step")
    return op[1]


def _broadcast_state(state: Any) -> Any:
    """A decode state from process 0 to every process (a collective: all call it at the
    same point, the others with zeros of the same shapes); host arrays back."""
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(jax.tree.map(np.asarray, state))


class LeaderStore:
    """Process 0's disk store: it alone reads and writes the disk. What the scheduler
    learns from it mid-step — a lookup's hit, a cold save point, whether a load worked — is
    published for the followers, and a loaded state is broadcast to them."""

    def __init__(self, store: Any, channel: Channel) -> None:
        self.store = store
        self.channel = channel

    def __getattr__(self, name: str) -> Any:  # continued_every, save, flush, tool_entries, …
        return getattr(self.store, name)

    def lookup(self, segments: Any) -> Any:
        hit = self.store.lookup(segments)
        if hit is None:
            self.channel.publish(("answer", None))
            return None
        self.channel.publish(("answer", (hit.key, hit.tokens, hit.segments, hit.tool_entries)))
        return replace(hit, load=lambda: self._load(hit))

    def _load(self, hit: Any) -> Any:
        try:
            state = hit.load()
        except Exception as err:
            self.channel.publish(("answer", f"{type(err).__name__}: {err}"))
            raise
        self.channel.publish(("answer", None))
        return _broadcast_state(state)

    def cold_cut(self, tokens: Any, segments: Any) -> int | None:
        cut = self.store.cold_cut(tokens, segments)
        self.channel.publish(("answer", cut))
        return cut


class FollowerStore:
    """A follower's disk store: no disk. It answers what the leader's store answered, and a
    hit's state arrives by broadcast from process 0."""

    def __init__(self, channel: Channel, cfg: Any, max_len: int,
                 continued_every: int = policy.CONTINUED_EVERY) -> None:  # fmt: skip
        """`continued_every`: the leader's (`ds4jax serve` leaves it at the default)."""
        self.channel = channel
        self.cfg, self.spans = cfg, spans(cfg, max_len)
        self.continued_every = continued_every

    def lookup(self, segments: Any) -> DiskHit | None:
        found = _answer(self.channel)
        if found is None:
            return None
        key, tokens, segs, tool_entries = found
        return DiskHit(key, tokens, segs, partial(self._load, len(tokens)), tool_entries)

    def _load(self, n: int) -> Any:
        failed = _answer(self.channel)
        if failed is not None:
            raise KVStoreError(f"the leader could not load the checkpoint: {failed}")
        # a broadcast's shapes: the leader's store loads at the span of the tokens held
        span = span_for(self.spans, n)
        empty = jax.eval_shape(lambda: init_state(self.cfg, span))
        return _broadcast_state(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), empty))

    def cold_cut(self, tokens: Any, segments: Any) -> int | None:
        return _answer(self.channel)

    def save(self, *_args: Any) -> None:
        return None  # process 0 keeps the checkpoints


class GroupStuck(RuntimeError):
    """The leader's clean exit found a step that never returned (`Leader.shutdown`)."""


class Leader:
    """Process 0's engine, as the server's worker sees it: `submit`, `tick`, `abort`,
    `warm_up` and `shutdown` publish before they run; everything else is the engine's."""

    def __init__(self, engine: Engine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self._ids = itertools.count()
        self._handed: list[tuple[int, Prepared]] = []  # submitted since the last step
        #: id → (the client's cancel event, the one the engine reads, the ticket)
        self._open: dict[int, tuple[threading.Event | None, threading.Event, Ticket]] = {}
        self._lock = threading.Lock()  # one published operation at a time, in order
        self._watchdog: Watchdog | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def submit(self, prepared: Prepared, *, cancel: threading.Event | None = None,
               **hooks: Any) -> Ticket:  # fmt: skip
        """Queue here now, on the followers with the next step. The engine reads a cancel
        event of its own, set from the client's at step boundaries, as the followers' is."""
        if hooks.get("forced_tokens") is not None:
            raise ValueError("forced tokens (a test hook) are not replayed on followers")
        own = threading.Event()
        tid = next(self._ids)
        ticket = self.engine.submit(prepared, cancel=own, **hooks)
        self._handed.append((tid, prepared))
        self._open[tid] = (cancel, own, ticket)
        return ticket

    def tick(self) -> None:
        with self._lock:
            cancels = []
            for tid, (cancel, own, ticket) in list(self._open.items()):
                if ticket.finished.is_set():
                    del self._open[tid]
                elif cancel is not None and cancel.is_set() and not own.is_set():
                    own.set()
                    cancels.append(tid)
            limit = self.engine.chunk_limit()  # from this process's timings: handed over
            self.channel.publish(("tick", self._handed, cancels, limit))
            self._handed = []
            self.engine.tick(limit)

    def abort(self, err: Exception) -> None:
        with self._lock:
            self.channel.publish(("abort", str(err)))
            self._handed, self._open = [], {}
            self.engine.abort(err)

    def warm_up(self) -> None:
        with self._lock:
            self.channel.publish(("warm_up",))
            self.engine.warm_up()

    def remember(self, tool_entries: dict[str, str]) -> None:
        """Tool ids → sampled DSML from the disk store (process 0's), on every process."""
        with self._lock:
            self.channel.publish(("remember", tool_entries))
            for tid, block in tool_entries.items():
                self.engine.tool_memory.remember([tid], block)

    def watch(self, on_dead: Callable[[list[int]], None]) -> None:
        """Start the `Watchdog`; `shutdown` stops it first (a clean exit is no failure)."""
        self._watchdog = Watchdog(self.channel, on_dead)
        self._watchdog.start()

    def shutdown(self) -> None:
        """The group's clean exit: every process runs the engine's shutdown (its saves),
        then the followers leave the coordination service before the leader, which hosts
        it, takes it down. A step that has not returned within `STOP_TIMEOUT_S` (stuck in a
        collective with a process that is gone or out of step) raises `GroupStuck`: the
        exit cannot be clean, and must not wait for it forever. The watchdog runs until
        the last step has returned, so a process dying meanwhile is still reported."""
        if not self._lock.acquire(timeout=STOP_TIMEOUT_S):
            raise GroupStuck(f"a step has not returned in {STOP_TIMEOUT_S} s: a process of "
                             "the group is stuck or gone, so the group cannot stop "
                             "cleanly")  # fmt: skip
        try:
            if self._watchdog is not None:
                self._watchdog.stop()
            self.channel.publish(("shutdown",))
            self.engine.shutdown()
            self.channel.client.wait_at_barrier(_STOP_BARRIER, STOP_TIMEOUT_S * 1000)
            followers = set(range(1, jax.process_count()))
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while not followers <= set(self.channel.dead()) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            self._lock.release()


def follow(engine: Engine, channel: Channel, poll_s: float = 1.0) -> int:
    """A follower's whole life: replay the leader's operations until it publishes
    `shutdown` (→ 0) or is gone (→ 1)."""
    tickets: dict[int, Ticket] = {}
    while True:
        try:
            op = _next(channel, poll_s)
        except Exception as err:
            log.error("lost the leader (process 0): %s; this follower exits", err)
            return 1
        kind = op[0]
        if kind == "tick":
            for tid, prepared in op[1]:
                tickets[tid] = engine.submit(prepared, cancel=threading.Event())
            for tid in op[2]:
                tickets[tid].cancel.set()
            try:
                engine.tick(op[3])
            except Exception:  # the leader's step raised too: its abort comes next
                log.exception("engine step failed")
            tickets = {t: k for t, k in tickets.items() if not k.finished.is_set()}
        elif kind == "abort":
            engine.abort(EngineError(500, op[1], "api_error"))
            tickets = {}
        elif kind == "warm_up":
            engine.warm_up()
        elif kind == "remember":
            for tid, block in op[1].items():
                engine.tool_memory.remember([tid], block)
        elif kind == "shutdown":
            engine.shutdown()
            channel.client.wait_at_barrier(_STOP_BARRIER, STOP_TIMEOUT_S * 1000)
            jax.distributed.shutdown()  # leave before the leader takes the service down
            return 0
        else:
            raise ValueError(f"unknown operation {kind!r} from the leader")


class Watchdog:
    """On the leader: polls the coordination service; once a process is gone, calls
    `on_dead(processes)` once from its own thread (a step stuck in a collective with the
    dead process never returns, so this cannot wait for the worker)."""

    def __init__(self, channel: Channel, on_dead: Callable[[list[int]], None],
                 every_s: float = 1.0) -> None:  # fmt: skip
        self.channel = channel
        self.on_dead = on_dead
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds4jax-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                dead = self.channel.dead()
            except Exception as err:  # the service itself failed: nobody can step
                log.error("coordination service unreachable: %s", err)
                dead = [-1]
            if dead and not self._stop.is_set():
                self.on_dead(dead)
                return
