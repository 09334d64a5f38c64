"""Over a real socket with the synchronous SDK, and client disconnects.

`ds4jax serve` runs as a user runs it (one subprocess, started with `--api-key` when the
session starts, see conftest); Hypercorn in a thread serves the shared engine where a test
must look at the engine after a client went away; one test drives the ASGI app by hand to
place a disconnect exactly (the race it pins is timing-dependent over a socket)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import pytest

from ds4jax.engine import Engine
from ds4jax.engine.requests import Cancelled
from serve.worker import EngineWorker
from tests.serve.conftest import (
    MODEL,
    NO_THINK,
    SERVE_KEY,
    SOCKET_SERVE_ARGS,
    Gate,
    ServeProcess,
    ThreadServer,
    assert_anthropic_error,
    assert_cold_equivalent,
    force,
    make_app,
    serving,
    user,
    wait_idle,
    wait_until,
)
from tests.serve.metrics_scrape import Scrape

ITALIAN = "Rispondi in italiano con una frase: chi era Ada Lovelace?"


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    """The server conftest started at collection time (it warmed up meanwhile)."""
    yield from serving("served")


@pytest.fixture
def sync_client(served: ServeProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=served.url, api_key=SERVE_KEY, max_retries=0) as c:
        yield c


def test_serve_prints_ready_and_reports_health(served: ServeProcess) -> None:
    assert "RANDOM weights" in served.stderr and "ready on" in served.stderr
    resp = httpx2.get(f"{served.url}/health")  # no key needed
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ready" and body["context"] == 2048 and body["model"] == MODEL


def test_sync_client_create_stream_and_count_over_a_socket(
    sync_client: anthropic.Anthropic,
) -> None:
    msg = sync_client.messages.create(
        model=MODEL, max_tokens=4, messages=user("hi"), thinking=NO_THINK
    )
    assert msg.id.startswith("msg_") and msg.type == "message"
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.output_tokens <= 4 and msg.usage.input_tokens > 0
    with sync_client.messages.stream(
        model=MODEL, max_tokens=4, messages=user("hi"), thinking=NO_THINK
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == text
    assert final.usage.output_tokens <= 4
    count = sync_client.messages.count_tokens(
        model=MODEL, messages=user(ITALIAN), thinking=NO_THINK
    )
    assert count.input_tokens == 21
    assert [m.id for m in sync_client.models.list().data] == [MODEL]


def test_api_key_flag_requires_the_key_in_either_header(served: ServeProcess) -> None:
    kw = dict(model=MODEL, max_tokens=2, messages=user("hi"), thinking=NO_THINK)
    for client in (
        anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0),
        anthropic.Anthropic(base_url=served.url, api_key=None, auth_token="wrong", max_retries=0),
    ):
        with client, pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(**kw)
        assert_anthropic_error(info.value.response, 401, "authentication_error")
    resp = httpx2.post(f"{served.url}/v1/messages", json=kw)  # no key at all
    assert_anthropic_error(resp, 401, "authentication_error")
    with anthropic.Anthropic(base_url=served.url, api_key=None, auth_token=SERVE_KEY) as bearer:
        assert bearer.messages.create(**kw).type == "message"
    resp = httpx2.post(f"{served.url}/v1/messages", json=kw, headers={"x-api-key": SERVE_KEY})
    assert resp.status_code == 200


def test_unknown_routes_are_404_over_a_socket(served: ServeProcess) -> None:
    headers = {"x-api-key": SERVE_KEY}
    assert httpx2.head(f"{served.url}/", headers=headers).status_code == 404  # Claude Code's probe
    assert_anthropic_error(httpx2.get(f"{served.url}/v1/nope", headers=headers), 404)


def test_disconnect_mid_stream_then_the_server_goes_on(
    served: ServeProcess, sync_client: anthropic.Anthropic
) -> None:
    with sync_client.messages.stream(
        model=MODEL, max_tokens=1500, messages=user("talk"), thinking=NO_THINK
    ) as stream:
        for event in stream:
            if event.type == "text":
                break  # leaving the block closes the connection
    deadline = time.monotonic() + 120
    while httpx2.get(f"{served.url}/health").json()["queue_depth"]:
        assert time.monotonic() < deadline, "the abandoned request never ended"
        time.sleep(0.05)
    msg = sync_client.messages.create(
        model=MODEL, max_tokens=2, messages=user("again"), thinking=NO_THINK
    )
    assert msg.type == "message"


def test_two_concurrent_streams_interleave(served: ServeProcess) -> None:
    """`ds4jax serve` decodes concurrent requests in one batch: each client sees its tokens
    arrive while the other is still generating."""
    from concurrent.futures import ThreadPoolExecutor

    def stream(text: str) -> list[float]:
        stamps = []
        with anthropic.Anthropic(base_url=served.url, api_key=SERVE_KEY, max_retries=0) as c:
            with c.messages.stream(
                model=MODEL, max_tokens=48, messages=user(text), thinking=NO_THINK
            ) as s:
                for event in s:
                    if event.type == "content_block_delta":
                        stamps.append(time.monotonic())
        return stamps

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(stream, ["tell a story", "write a poem"])
    assert len(a) > 10 and len(b) > 10
    assert a[0] < b[-1] and b[0] < a[-1]  # the two streams overlap in time
    merged = sorted([(t, "a") for t in a] + [(t, "b") for t in b])
    switches = sum(x[1] != y[1] for x, y in itertools.pairwise(merged))
    assert switches >= 4, switches  # their deltas interleave, not one stream then the other
    assert "batches of up to 2" in served.stderr


def test_sigterm_stops_the_server_cleanly(served: ServeProcess) -> None:
    """Last in the module: it ends the shared server. A stream decoding and a non-stream
    request in flight when the signal arrives end while their connections are open: the
    stream with an `overloaded_error` event, the other a 503 in the Anthropic shape, both
    saying the server is shutting down (before, the stream was cut mid-chunk and the other
    got an empty 500 once Hypercorn gave up waiting on them)."""
    headers = {"x-api-key": SERVE_KEY}
    body = {"model": MODEL, "max_tokens": 1900, "messages": user("talk"), "thinking": NO_THINK}
    lines: list[str] = []
    replies: list[httpx2.Response] = []
    started = threading.Event()

    def stream() -> None:
        with httpx2.stream("POST", f"{served.url}/v1/messages", json={**body, "stream": True},
                           headers=headers, timeout=60) as resp:  # fmt: skip
            for line in resp.iter_lines():
                lines.append(line)
                if '"text_delta"' in line:
                    started.set()

    def plain() -> None:
        replies.append(httpx2.post(f"{served.url}/v1/messages", json=body, headers=headers,
                                   timeout=60))  # fmt: skip

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    assert started.wait(60), served.stderr
    deadline = time.monotonic() + 60
    while httpx2.get(f"{served.url}/health").json()["queue_depth"] < 2:  # both in flight
        assert time.monotonic() < deadline, served.stderr
        time.sleep(0.05)
    rc = served.stop()
    for t in threads:
        t.join(60)
    assert rc == 0, served.stderr
    assert "stopped" in served.stderr
    assert "Traceback" not in served.stderr
    events = [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: ")]
    assert events[-1]["type"] == "error", lines[-4:]
    assert events[-1]["error"]["type"] == "overloaded_error"
    assert "shutting down" in events[-1]["error"]["message"]
    (reply,) = replies
    assert "shutting down" in assert_anthropic_error(reply, 503, "overloaded_error")


def test_sigterm_during_warm_up_exits_at_once_without_ready() -> None:
    """A signal while the server compiles ends it then (no session exists yet), never
    after the compiles with a "ready on" line that scripts and probes would believe."""
    server = ServeProcess(*SOCKET_SERVE_ARGS)
    try:
        deadline = time.monotonic() + 300
        while "compiling and warming up" not in server.stderr:
            assert server.proc.poll() is None, server.stderr
            assert time.monotonic() < deadline, server.stderr
            time.sleep(0.05)
        rc = server.stop()
    finally:
        server.stop()
    assert rc == 0, server.stderr
    # the line is printed only where the warm-up had not finished
    assert "stopped during warm-up" in server.stderr and "ready on" not in server.stderr


# ---------------------------------------------------------------------- in-thread Hypercorn

LONG = " ".join(f"w{i}" for i in range(700))  # ~1400 forced tokens


@pytest.fixture
def results(engine: Engine, worker: EngineWorker) -> Iterator[list[Any]]:
    """The engine results of the jobs the worker finishes during the test."""
    out: list[Any] = []

    def hook(_job: Any, result: Any) -> None:
        out.append(result)

    worker.hooks.append(hook)
    yield out
    worker.hooks.remove(hook)


def test_client_disconnect_mid_stream_keeps_the_frontier_consistent(
    socket_app: ThreadServer, engine: Engine, worker: EngineWorker, results: list[Any]
) -> None:
    with anthropic.Anthropic(base_url=socket_app.url, api_key="k", max_retries=0) as client:
        with client.messages.stream(
            model=MODEL,
            max_tokens=1500,
            messages=user("talk"),
            thinking=NO_THINK,
            extra_body=force(LONG),
        ) as stream:
            for event in stream:
                if event.type == "text":
                    break
        wait_idle(worker, timeout=120)
        (first,) = results
        # "cancelled", or "end_turn" when the cancellation was swallowed (the race pinned,
        # deterministically, by test_disconnect_with_events_pending_cancels_generation)
        assert first.finish in ("cancelled", "end_turn")
        assert_cold_equivalent(engine)
        msg = client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=user("again"),
            thinking=NO_THINK,
            extra_body=force("fine"),
        )
    assert msg.content[0].text == "fine" and msg.stop_reason == "end_turn"
    assert_cold_equivalent(engine)


def test_non_stream_client_that_gives_up_is_never_routed(
    socket_app: ThreadServer,
    engine: Engine,
    worker: EngineWorker,
    gate: Gate,
    results: list[Any],
) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 1500,
        "thinking": NO_THINK,
        "messages": user("talk"),
        **force(LONG),
    }
    with pytest.raises(httpx2.ReadTimeout):  # the job is held at the gate meanwhile
        httpx2.post(f"{socket_app.url}/v1/messages", json=body, timeout=0.5)
    job = worker.running
    assert job is not None
    deadline = time.monotonic() + 10
    while not job.cancel.is_set():  # the server noticed the client is gone
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.01)
    lives = [s.live for s in engine.pool.sessions]
    gate.open()  # the engine takes the job only now, its client long gone
    wait_idle(worker)
    (cancelled,) = results
    # dropped before routing: no slot chosen, no session's frontier replaced, no prefill
    assert isinstance(cancelled, Cancelled)
    assert [s.live for s in engine.pool.sessions] == lives


@pytest.mark.anyio
async def test_disconnect_while_queued_skips_the_job(
    socket_app: ThreadServer, engine: Engine, worker: EngineWorker, gate: Gate
) -> None:
    def req(text: str, **extra: Any) -> dict[str, Any]:
        return {
            "model": MODEL,
            "max_tokens": 4,
            "thinking": NO_THINK,
            "messages": user(text),
            **force("ok"),
            **extra,
        }

    metrics = socket_app.app.metrics
    before = Scrape.parse(metrics.render().decode())
    async with httpx2.AsyncClient(base_url=socket_app.url, timeout=30) as c:
        first = asyncio.ensure_future(c.post("/v1/messages", json=req("first")))
        await wait_until(lambda: worker.running is not None)  # held at the gate
        async with c.stream("POST", "/v1/messages", json=req("second", stream=True)) as resp:
            assert resp.status_code == 200  # queued past the grace period: the stream is open
            assert worker.depth == 2
        # the server sees the disconnect and cancels the queued job
        queued = list(worker._jobs.queue)
        assert len(queued) == 1
        await wait_until(lambda: all(job.cancel.is_set() for job in queued))
        gate.open()
        assert (await first).json()["content"][0]["text"] == "ok"
    wait_idle(worker)
    assert gate.runs == ["first"]  # the abandoned job never ran
    # /metrics: the abandoned one counts once, as cancelled; never routed, it has no latencies
    after = Scrape.parse(metrics.render().decode())
    d = lambda name, **kw: after.delta(before, "ds4jax:" + name, **kw)  # noqa: E731
    assert d("requests_total", finish_reason="cancelled") == 1
    assert d("requests_total", finish_reason="end_turn") == 1 and d("requests_total") == 2
    assert d("e2e_request_latency_seconds_count") == 1 and d("continuation_total") == 1


async def drive_until_disconnect(app: Any, payload: dict[str, Any]) -> None:
    """Run one streaming request through the ASGI app by hand: after the first text frame,
    pause 50 ms (the worker keeps queueing events meanwhile), then report a disconnect the way
    Hypercorn does (`http.disconnect` from receive), so Quart cancels the handler while the
    request's event queue is not empty."""
    data = json.dumps(payload).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/messages",
        "raw_path": b"/v1/messages",
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ],
    }
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        body = message.get("body", b"")
        if not gone.is_set() and message["type"] == "http.response.body" and b"text" in body:
            await asyncio.sleep(0.05)
            gone.set()

    await app(scope, receive, send)


@pytest.mark.anyio
async def test_disconnect_with_events_pending_cancels_generation(
    engine: Engine, worker: EngineWorker, results: list[Any]
) -> None:
    payload = {
        "model": MODEL,
        "max_tokens": 1500,
        "stream": True,
        "thinking": NO_THINK,
        "messages": user("talk"),
        **force(LONG),
    }
    app = make_app(worker)
    await drive_until_disconnect(app, payload)
    wait_idle(worker, timeout=120)
    (result,) = results
    assert result.finish == "cancelled" and result.output_tokens < 1000
    m = Scrape.parse(app.metrics.render().decode())  # counted once, as such
    assert m.get("ds4jax:requests_total") == 1
    assert m.get("ds4jax:requests_total", finish_reason="cancelled") == 1
    assert m.get("ds4jax:e2e_request_latency_seconds_count") == 1
    assert m.get("ds4jax:generation_tokens_total") == result.output_tokens
    assert_cold_equivalent(engine)
