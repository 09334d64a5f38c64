"""The multi-host replay (`ds4jax.distributed`) without a second process: a leader engine
behind `Leader` and a follower engine running `follow` in a thread, joined by an in-memory
channel in place of the coordination service. Both are the same tiny model on one device,
so any input the scheduler reads that is not in the published operations (a clock, a
random draw, a cancel seen mid-step) shows up as a follower whose sessions differ."""

from __future__ import annotations

import queue
import threading
from typing import Any

from ds4jax.chat.ids import id_stream, new_tool_id
from ds4jax.distributed import Leader, follow
from ds4jax.engine import Engine, SamplingParams
from tests.continuation.conftest import TOOLS, prepare


class MemoryChannel:
    """`distributed.Channel`'s interface over a queue; every process is always live."""

    def __init__(self) -> None:
        self.ops: queue.Queue[tuple] = queue.Queue()
        self.client = self
        self._barrier = threading.Barrier(2)

    def publish(self, op: tuple) -> None:
        self.ops.put(op)

    def receive(self, timeout_s: float) -> tuple | None:
        try:
            return self.ops.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def dead(self) -> list[int]:
        return []

    def wait_at_barrier(self, _name: str, timeout_ms: int) -> None:
        self._barrier.wait(timeout_ms / 1000)


def pool_engine(like: Engine) -> Engine:
    # the shared engine's shapes: its compiled programs serve these engines too
    return Engine(like.cfg, like.params, like.tokenizer, max_len=like.max_len,
                  chunk_sizes=like.chunk_sizes, sessions=3, fork_points=True,
                  max_batch=2)  # fmt: skip


def sessions(engine: Engine) -> list[Any]:
    return [
        (s.slot, s.live.tokens if s.live else None, s.used, sorted(s.bindings.tool or ()))
        for s in engine.pool.sessions
    ] + [(f.owner, f.frontier.tokens) for f in engine.pool.forks]


def test_a_follower_replays_the_leader_exactly(_engine: Engine) -> None:
    lead, mirror = pool_engine(_engine), pool_engine(_engine)
    channel = MemoryChannel()
    leader = Leader(lead, channel)  # type: ignore[arg-type]
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(follow(mirror, channel, 0.05)))
    thread.start()

    system = "You are one of several agents."
    hot = SamplingParams(temperature=1.0)  # unseeded: the key comes from the request's nonce

    def ask(text: str, max_tokens: int = 12, **kw: Any) -> Any:
        body = {"system": system, "tools": TOOLS, "messages": [{"role": "user", "content": text}]}
        p = prepare(lead, body, max_tokens)
        p.sampling = hot
        return leader.submit(p, **kw)

    first = ask("List the files.")
    cancel = threading.Event()
    doomed = ask("Count the lines of every file.", max_tokens=40, cancel=cancel)
    steps = 0
    while lead.busy:
        leader.tick()
        steps += 1
        if steps == 6:
            cancel.set()  # the client goes away mid-decode: seen at the next step on both
        if steps == 3:
            ask("And the tests?")  # arrives while the others decode
    retry = ask("List the files.")  # a retry: forks from the first request's fork point
    while lead.busy:
        leader.tick()
    leader.shutdown()
    thread.join(30)

    assert exit_code == [0]
    assert first.result is not None and retry.result is not None
    assert doomed.result is not None and doomed.result.finish == "cancelled"
    assert retry.result.source.value == "fork-point"
    assert sessions(mirror) == sessions(lead)
    assert len({s[1] for s in sessions(lead)[:3]}) == 3  # three different conversations


def test_tool_ids_follow_the_request_nonce() -> None:
    a, b = id_stream(b"k" * 16), id_stream(b"k" * 16)
    ids = [new_tool_id((), "toolu_", a) for _ in range(3)]
    assert ids == [new_tool_id((), "toolu_", b) for _ in range(3)]
    assert len(set(ids)) == 3 and all(len(i) == len("toolu_") + 32 for i in ids)
    other = id_stream(b"j" * 16)
    assert new_tool_id((), "toolu_", other) not in ids
    # an id already taken is skipped, as with `secrets`
    c = id_stream(b"k" * 16)
    assert new_tool_id([ids[0]], "toolu_", c) == ids[1]


def test_the_leaders_exit_gives_up_on_a_step_that_never_returns(
    _engine: Engine, monkeypatch: Any
) -> None:
    """A step stuck in a collective (a process gone or out of step) held the leader's lock
    for good, and its SIGTERM waited on it forever (minutes, until the follower was
    killed): the clean exit now gives up after `STOP_TIMEOUT_S`, saying why, and nothing
    is published to the followers."""
    import pytest

    from ds4jax import distributed

    monkeypatch.setattr(distributed, "STOP_TIMEOUT_S", 0.2)
    channel = MemoryChannel()
    leader = Leader(pool_engine(_engine), channel)  # type: ignore[arg-type]
    stuck, held = threading.Event(), threading.Event()

    def hold() -> None:  # a step that never returns
        with leader._lock:
            held.set()
            stuck.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    try:
        with pytest.raises(distributed.GroupStuck, match="cannot stop cleanly"):
            leader.shutdown()
        assert channel.ops.empty()
    finally:
        stuck.set()
        holder.join()


class AgreeClient:
    """The coordination service's key-value store and liveness, for `distributed.agree`:
    process 1's values are set beforehand (or never)."""

    def __init__(self, theirs: dict[str, str], alive: bool = True) -> None:
        self.kv, self.alive = dict(theirs), alive

    def key_value_set(self, key: str, value: str) -> None:
        self.kv[key] = value

    def blocking_key_value_get(self, key: str, _timeout_ms: int) -> str:
        if key not in self.kv:
            raise RuntimeError("DEADLINE_EXCEEDED: no such key yet")
        return self.kv[key]

    def get_live_nodes(self, everyone: list[int]) -> list[int]:
        return everyone if self.alive else [0]


def test_a_group_agrees_on_its_settings_or_names_what_differs(monkeypatch: Any) -> None:
    """The leader's side of `agree` (what `serve` runs before and after the weights load):
    equal settings pass; a flag that differs is named; a state budget alone differing says
    each host's memory set it and how to pin it; a process that left, or never reports,
    is named rather than waited on forever."""
    import json

    import pytest

    from ds4jax import distributed

    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.jax, "process_index", lambda: 0)
    mine = {"context": 8192, "state budget": 100, "pages": 7}

    def theirs(**changes: Any) -> AgreeClient:
        values = {k: str(v) for k, v in {**mine, **changes}.items()}
        return AgreeClient({"ds4jax/agree/engine-settings/1": json.dumps(values)})

    distributed.agree("engine settings", mine, theirs())
    with pytest.raises(SystemExit, match=r"context: 8192 here, 4096 on process 1.*same ones"):
        distributed.agree("engine settings", mine, theirs(context=4096))
    with pytest.raises(SystemExit, match="memory set its default: pass the same --state-budget"):
        distributed.agree("engine settings", mine, theirs(**{"state budget": 90, "pages": 6}))
    with pytest.raises(SystemExit, match="process 1 left the group before it reported"):
        distributed.agree("engine settings", mine, AgreeClient({}, alive=False), poll_s=0.01)
    with pytest.raises(SystemExit, match="process 1 did not report its engine settings"):
        distributed.agree("engine settings", mine, AgreeClient({}), timeout_s=0.05,
                          poll_s=0.01)  # fmt: skip
