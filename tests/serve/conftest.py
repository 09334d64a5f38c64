"""The Anthropic shim driven by the official `anthropic` SDK.

One real engine on the tiny config (real V4 tokenizer, random weights) and one started
worker serve the whole module set: in-process through `httpx2.ASGITransport` (no socket),
and over a real socket through Hypercorn in a thread (the ASGI transport buffers the whole
response, so a client disconnect mid-stream needs a socket). `ds4jax serve` itself runs as a
subprocess in `test_socket.py`.

Random weights sample noise, so every test that needs a particular turn teacher-forces it:
the app's `TEST_FORCED_TOKENS_HOOK` maps a body to forced tokens, and the hook installed
here reads the text to force from the request field `FORCE_KEY` (sent with the SDK's
`extra_body`). The hook is test-only; nothing in serve/ reads that field.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import numpy as np
import pytest
from quart import Quart

from ds4jax.chat import specials
from ds4jax.engine import Engine
from serve.app import ServerConfig, create_app
from serve.worker import EngineWorker
from tests.conftest import SERVED_XLA_FLAGS
from tests.continuation.conftest import TOOLS, exact_tiny_engine, forced, tool_call_text

__all__ = ["TOOLS", "forced", "tool_call_text"]

MODEL = "deepseek-v4-flash"
BASE = "http://test"
FORCE_KEY = "x_ds4jax_test_force"  # read by the test hook only
NO_THINK = {"type": "disabled"}


def force(text: str) -> dict[str, Any]:
    """`extra_body` that makes the model emit `text` (DSML and think markers as specials)."""
    return {FORCE_KEY: text}


def dsml_call(command: str, name: str = "bash") -> str:
    """One tool-call block as the model writes it after its reasoning (and any text)."""
    return (
        f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n'
        f'<｜DSML｜parameter name="command" string="true">{command}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )


def template_special_ids(engine: Engine) -> set[int]:
    return {engine.tokenizer.special_id(s) for s in specials.TEMPLATE_SPECIALS}


def assert_anthropic_error(resp: Any, status: int, error_type: str | None = None) -> str:
    """A raw response in the Anthropic error shape; returns its message."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error", body
    assert isinstance(body["error"], dict), body
    assert isinstance(body["error"]["type"], str) and body["error"]["type"], body
    assert isinstance(body["error"]["message"], str), body
    if error_type is not None:
        assert body["error"]["type"] == error_type, body
    return body["error"]["message"]


def assert_cold_equivalent(engine: Engine) -> None:
    """The live frontier equals a cold prefill of its own tokens."""
    live = engine.live
    assert live is not None
    cold = engine.logits_for(live.tokens)
    assert np.abs(cold - np.asarray(live.state.logits)).max() <= 1e-5


# ---------------------------------------------------------------------- engine and worker


@pytest.fixture(scope="session")
def _engine() -> Engine:
    # the continuation tests' engine, so both families' programs are compiled once per run
    # (eight of these files with test_batching: 171 → 151 s on one worker, empty cache)
    return exact_tiny_engine()


@pytest.fixture(scope="session")
def worker(_engine: Engine) -> Iterator[EngineWorker]:
    w = EngineWorker(_engine, max_queue=16)
    w.start()
    yield w
    w.stop()


@pytest.fixture
def engine(_engine: Engine, worker: EngineWorker) -> Engine:
    """The shared engine, reset: no live frontier, no bindings, no remembered tool calls."""
    wait_idle(worker)
    _engine.reset()
    _engine.tool_memory = type(_engine.tool_memory)()
    return _engine


def wait_idle(worker: EngineWorker, timeout: float = 30.0) -> None:
    """Until the worker has no running or queued job (a cancelled stream stops at the next
    step, a moment after its client went away)."""
    deadline = time.monotonic() + timeout
    while worker.depth:
        assert time.monotonic() < deadline, "the worker is still busy"
        time.sleep(0.01)


class Gate:
    """While closed, the engine blocks before taking each job (`Engine.submit`), so requests
    queue up behind it; `runs` records the last user text of each job the engine took, in
    order."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.runs: list[str] = []

    def open(self) -> None:
        self.opened.set()

    def close(self) -> None:
        self.opened.clear()


@pytest.fixture
def gate(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    submit = engine.submit

    def gated(prepared: Any, **kwargs: Any) -> Any:
        assert g.opened.wait(30), "the test never opened the gate"
        last = prepared.conversation.messages[-1]
        g.runs.append(" ".join(b.text for b in last.blocks) or last.content)
        return submit(prepared, **kwargs)

    monkeypatch.setattr(engine, "submit", gated)
    yield g
    g.open()


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def make_app(worker: EngineWorker, config: ServerConfig | None = None) -> Quart:
    config = config or ServerConfig()
    config.state = "ready"  # no warm-up: each program compiles on first use
    app = create_app(worker, config)
    engine = worker.engine

    def hook(body: dict[str, Any]) -> list[int] | None:
        text = body.get(FORCE_KEY)
        return forced(engine, text) if isinstance(text, str) else None

    app.config["TEST_FORCED_TOKENS_HOOK"] = hook
    return app


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def app(engine: Engine, worker: EngineWorker) -> Quart:
    return make_app(worker)


def sdk_client(app: Quart, **kw: Any) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE)
    kw.setdefault("api_key", "k")
    # no retries: the SDK retries 409 and 5xx, which would hide the statuses under test
    return anthropic.AsyncAnthropic(base_url=BASE, http_client=http, max_retries=0, **kw)


@pytest.fixture
async def client(app: Quart) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk_client(app) as c:
        yield c


@pytest.fixture
async def raw(app: Quart) -> AsyncIterator[httpx2.AsyncClient]:
    """A plain HTTP client on the same app, for bodies the SDK would refuse to send."""
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        yield c


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def sse_events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE frame; every frame must have both lines."""
    out = []
    for frame in body.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.strip().split("\n"))
        assert set(lines) == {"event", "data"}, frame
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"], frame
        out.append((lines["event"], data))
    return out


# ---------------------------------------------------------------------- a real socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """Hypercorn serving an app on 127.0.0.1 from its own thread and event loop."""

    def __init__(self, app: Quart) -> None:
        from hypercorn.config import Config

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cfg = Config()
        self._cfg.bind = [f"127.0.0.1:{self.port}"]
        self._cfg.accesslog = None
        self._cfg.graceful_timeout = 1
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="test-hypercorn", daemon=True)

    def _run(self) -> None:
        from hypercorn.asyncio import serve

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            task = asyncio.ensure_future(
                serve(self.app, self._cfg, shutdown_trigger=self._stop.wait)
            )
            while True:  # ready once the port accepts connections
                try:
                    _, w = await asyncio.open_connection("127.0.0.1", self.port)
                    w.close()
                    break
                except OSError:
                    await asyncio.sleep(0.02)
            self._ready.set()
            await task

        asyncio.run(main())

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        assert self._ready.wait(30), "hypercorn did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="session")
def socket_app(worker: EngineWorker) -> Iterator[ThreadServer]:
    with ThreadServer(make_app(worker)) as server:
        yield server


# ---------------------------------------------------------------------- `ds4jax serve`

ROOT = Path(__file__).resolve().parents[2]
SERVE_KEY = "sekrit"


class ServeProcess:
    """`ds4jax serve` in a subprocess; `model` are its model flags (none: the default, the
    trained demo)."""

    def __init__(
        self, *args: str, model: tuple[str, ...] = ("--config", "tiny"),
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = (*model, "--ctx", "2048", "--port", str(self.port), *args)
        cmd = [sys.executable, "-m", "ds4jax", "serve", *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.drained = threading.Event()  # every line read: the process closed its stderr
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "ready on" in line:
                self.ready.set()
        self.drained.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            assert self.proc.poll() is None, f"ds4jax serve exited:\n{self.stderr}"
            assert time.monotonic() < deadline, f"ds4jax serve never got ready:\n{self.stderr}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


_early: dict[str, Any] = {}
#: the servers the tests start decode without `--stall-bound` (`NO_MIXED`): their tests send
#: prompts one at a time or do not look at how a prompt shares the steps of decoding rows
#: (the engine's tests do: test_batching), and each batch size's mixed step doubled what
#: their warm-ups compiled (CPU to ready, alone, empty cache: the demo server's, as below,
#: 107 → 51 s; the group's two processes 71 → 54 s; test_socket's 57 → 33 s)
NO_MIXED = ("--stall-bound", "0")
#: the demo's servers (one device, speculating, the group) prefill in chunks of 512 and 16
#: tokens, not the four default sizes: each size is a program every one of them compiles
#: at warm-up (the group's two processes alone: test_multihost.py 159 → 137 CPU-s; then the
#: one-device servers: the five files sharing them, one worker, 197 → 185), and the demo's
#: prompts of ~700 tokens take the same greedy tokens either way
CHUNKS = ("--chunk-sizes", "16,512")
#: the tiny server of test_socket.py: an API key, and a warm-up of only what its tests run
#: (two chunk sizes, batches of up to 2 without mixed steps: 4 programs where the defaults
#: compile 13, over 100 s of a 2-core CI run)
SOCKET_SERVE_ARGS = ("--api-key", SERVE_KEY, "--chunk-sizes", "16,64", "--max-batch", "2",
                     *NO_MIXED)  # fmt: skip
#: the demo server's flags: no model flags, a session for each of six concurrent agents (in
#: batches of up to 4: the default 8 only adds a step program no test needs), a stats line
#: every second, retained frontiers in pages
DEMO_SERVE_ARGS = ("--sessions", "6", "--max-batch", "4", "--stats-interval", "1", "--paged",
                   *CHUNKS, *NO_MIXED)  # fmt: skip
#: the demo server compiles as served (the suite's processes do not, `tests/conftest.py`):
#: its six agents decode long on a few programs
AS_SERVED = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0", "XLA_FLAGS": SERVED_XLA_FLAGS}
#: the demo speculating with its MTP block in every step (issue 29), of up to 2 rows: its
#: tests send one request at a time, and the default batches of 8 only added 4 programs to
#: its warm-up (about 40 s of CPU on 2 cores)
SPEC_SERVE_ARGS = ("--speculative", "mtp", "--speculative-max-batch", "2", "--max-batch", "2",
                   "--mesh", "none", "--stats-interval", "1", *CHUNKS, *NO_MIXED)  # fmt: skip
#: the multi-host group: two processes of 4 CPU devices each, one 4×2 mesh over all 8 with
#: sessions' pages split along data (issue 28: shards 0-1 on process 0's devices, 2-3 on
#: process 1's), a row on each shard
GROUP_MESH = "data=4,expert=2"
GROUP_ARGS = ("--paged", "--mesh", GROUP_MESH, "--sessions", "2", "--max-batch", "4",
              *CHUNKS, *NO_MIXED)  # fmt: skip


class ServeGroup:
    """`ds4jax serve` as a group of processes on this machine (jax.distributed, coordinator
    on 127.0.0.1, gloo collectives): the leader serves HTTP, the followers replay."""

    def __init__(self, processes: int = 2, devices_each: int = 4) -> None:
        self.kv_dir = tempfile.mkdtemp(prefix="ds4jax-group-kv-")
        group = ("--coordinator", f"127.0.0.1:{free_port()}", "--num-processes",
                 str(processes), "--kv-disk-dir", self.kv_dir)  # fmt: skip
        # (JAX_NUM_CPU_DEVICES, not a forced device count in XLA_FLAGS)
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
        env = {"JAX_NUM_CPU_DEVICES": str(devices_each), "XLA_FLAGS": " ".join(flags),
               "DS4JAX_HEARTBEAT_TIMEOUT_S": "15"}  # fmt: skip
        # followers first: the leader's HTTP port is the one tests use
        self.followers = [
            ServeProcess(*GROUP_ARGS, *group, "--process-id", str(i), model=(), env=env)
            for i in range(1, processes)
        ]
        self.leader = ServeProcess(*GROUP_ARGS, *group, "--process-id", "0", model=(), env=env)

    def wait_ready(self, timeout: float = 300.0) -> None:
        for f in self.followers:
            assert f.proc.poll() is None, f"a follower exited:\n{f.stderr}"
        self.leader.wait_ready(timeout)

    def stop(self) -> None:
        self.leader.stop()
        for f in self.followers:
            f.stop()


#: how each server the tests share starts (a fixture's kind → a new, starting server)
STARTERS: dict[str, Callable[[], Any]] = {
    "served": lambda: ServeProcess(*SOCKET_SERVE_ARGS),
    "demo_served": lambda: ServeProcess(*DEMO_SERVE_ARGS, model=(), env=AS_SERVED),
    "served_group": ServeGroup,
    "spec_served": lambda: ServeProcess(*SPEC_SERVE_ARGS, model=()),
}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start `ds4jax serve` as soon as a selected test needs it: its ~30 s warm-up then
    overlaps the in-process tests instead of adding to them. Not under pytest-xdist: every
    worker collects every test, and each would start servers for tests another runs."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wanted = {f for item in session.items for f in getattr(item, "fixturenames", ())}
    for kind, start in STARTERS.items():
        if kind in wanted:
            _early[kind] = start()


def serving(kind: str) -> Iterator[Any]:
    """A fixture's body: the `kind` of server (the one started at collection, else a new
    one), ready, stopped after its last test."""
    server = _early.pop(kind, None) or STARTERS[kind]()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def demo_served() -> Iterator[ServeProcess]:
    """`ds4jax serve` with no model flags: the trained demo, on one device."""
    yield from serving("demo_served")


@pytest.fixture(scope="session")
def spec_served() -> Iterator[ServeProcess]:
    """`ds4jax serve --speculative mtp` on the trained demo."""
    yield from serving("spec_served")


def pytest_sessionfinish(session: pytest.Session) -> None:
    for server in _early.values():  # started but never used (a failure stopped the run first)
        server.stop()
    _early.clear()
