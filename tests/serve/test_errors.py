"""Failures a client can cause: each is a 4xx (or 503) in the Anthropic error shape, never a
5xx and never a crash; the server keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ds4jax.engine import Engine
from serve.app import ServerConfig
from serve.worker import EngineWorker
from tests.serve.conftest import (
    BASE,
    MODEL,
    NO_THINK,
    TOOLS,
    Gate,
    assert_anthropic_error,
    assert_cold_equivalent,
    force,
    make_app,
    sdk_client,
    sse_events,
    user,
    wait_until,
)
from tests.serve.metrics_scrape import Scrape

pytestmark = pytest.mark.anyio

OK_BODY = {"model": MODEL, "max_tokens": 2, "thinking": NO_THINK, "messages": user("hi")}


def body(**changes: Any) -> dict[str, Any]:
    out = {**OK_BODY, **changes}
    return {k: v for k, v in out.items() if v is not ...}


async def still_serving(raw: httpx2.AsyncClient) -> None:
    resp = await raw.post("/v1/messages", json=body(**force("ok")))
    assert resp.status_code == 200, resp.text
    assert resp.json()["content"][0]["text"] == "ok"


# ---------------------------------------------------------------------- auth


@pytest.fixture
async def keyed(engine: Engine, worker: EngineWorker) -> AsyncIterator[httpx2.AsyncClient]:
    app = make_app(worker, ServerConfig(api_key="sekrit"))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        c.app = app  # type: ignore[attr-defined]
        yield c


@pytest.mark.parametrize(
    "headers",
    [{}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}],
    ids=["missing", "wrong-x-api-key", "wrong-bearer", "no-bearer-prefix"],
)
async def test_missing_or_wrong_key_is_401(
    keyed: httpx2.AsyncClient, headers: dict[str, str]
) -> None:
    for method, path in [
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/models"),
    ]:
        resp = await keyed.request(method, path, json=body(), headers=headers)
        assert_anthropic_error(resp, 401, "authentication_error")


async def test_the_sdk_authenticates_with_x_api_key_and_with_bearer(
    keyed: httpx2.AsyncClient,
) -> None:
    app = keyed.app  # type: ignore[attr-defined]
    for kw in (
        {"api_key": "sekrit"},  # the SDK 2.x sends api_key as Authorization: Bearer
        {"api_key": None, "auth_token": "sekrit"},  # Authorization: Bearer
        {"api_key": None, "default_headers": {"x-api-key": "sekrit"}},  # x-api-key
    ):
        async with sdk_client(app, **kw) as c:
            msg = await c.messages.create(**body(**{"extra_body": force("ok")}))
            assert msg.content[0].text == "ok"
    async with sdk_client(app, api_key="wrong") as c:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await c.models.list()
        assert info.value.status_code == 401
    resp = await keyed.get("/health")  # health needs no key
    assert resp.status_code == 200


# ---------------------------------------------------------------------- routes


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/"),
        ("HEAD", "/"),
        ("GET", "/v1/nope"),
        ("POST", "/v1/complete"),
        ("GET", "/v1/messages"),
        ("POST", "/v1/completions"),
        ("DELETE", "/v1/models"),
    ],
)
async def test_unknown_routes_are_404_in_the_anthropic_shape(
    raw: httpx2.AsyncClient, method: str, path: str
) -> None:
    resp = await raw.request(method, path)
    assert resp.status_code == 404
    if method != "HEAD":
        assert_anthropic_error(resp, 404, "not_found_error")


async def test_an_openai_path_with_a_trailing_slash_is_404_in_openai_shape(
    raw: httpx2.AsyncClient,
) -> None:
    resp = await raw.post("/v1/chat/completions/", json={})
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["type"] == "not_found_error", err
    assert set(err) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------- validation


BAD_BODIES = {
    "malformed-json": b'{"model": "x", "messages": [',
    "empty-body": b"",
    "not-an-object": b"[1, 2, 3]",
    "not-utf8": b'{"model": "\xff\xfe"}',
    "json-null": b"null",
}


@pytest.mark.parametrize("content", BAD_BODIES.values(), ids=BAD_BODIES.keys())
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_unparseable_bodies_are_400(
    raw: httpx2.AsyncClient, path: str, content: bytes
) -> None:
    resp = await raw.post(path, content=content, headers={"content-type": "application/json"})
    assert_anthropic_error(resp, 400, "invalid_request_error")


INVALID = {
    "max_tokens-missing": (body(max_tokens=...), "max_tokens"),
    "max_tokens-string": (body(max_tokens="5"), "max_tokens"),
    "max_tokens-float": (body(max_tokens=2.5), "max_tokens"),
    "max_tokens-bool": (body(max_tokens=True), "max_tokens"),
    "max_tokens-zero": (body(max_tokens=0), "max_tokens"),
    "max_tokens-negative": (body(max_tokens=-1), "max_tokens"),
    "max_tokens-huge": (body(max_tokens=10**30), "max_tokens"),
    "messages-missing": (body(messages=...), "messages"),
    "messages-empty": (body(messages=[]), "messages"),
    "messages-string": (body(messages="hi"), "messages"),
    "message-not-object": (body(messages=["hi"]), "messages[0]"),
    "role-unknown": (body(messages=[{"role": "robot", "content": "x"}]), "role"),
    "content-number": (body(messages=[{"role": "user", "content": 5}]), "content"),
    "block-not-object": (body(messages=[{"role": "user", "content": [5]}]), "content[0]"),
    "text-not-string": (
        body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "text",
    ),
    "tool_result-no-id": (
        body(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]),
        "tool_use_id",
    ),
    "assistant-bad-block": (
        body(
            messages=[*user("a"), {"role": "assistant", "content": [{"type": "image"}]}, *user("b")]
        ),
        "type",
    ),
    "system-number": (body(system=5), "system"),
    "tools-object": (body(tools={"name": "x"}), "tools"),
    "tool-no-schema": (body(tools=[{"name": "x"}]), "input_schema"),
    "tool-duplicate": (body(tools=[TOOLS[0], TOOLS[0]]), "tools[1].name"),
    "tool_choice-unknown-type": (body(tools=TOOLS, tool_choice={"type": "some"}), "tool_choice"),
    "tool_choice-unknown-tool": (
        body(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}),
        "tool_choice",
    ),
    "thinking-type": (body(thinking={"type": "sometimes"}), "thinking"),
    "thinking-budget": (body(thinking={"type": "enabled", "budget_tokens": -3}), "budget_tokens"),
    "effort-unknown": (body(output_config={"effort": "extreme"}), "effort"),
    "stop_sequences-number": (body(stop_sequences=5), "stop_sequences"),
    "stop_sequences-mixed": (body(stop_sequences=["a", 1]), "stop_sequences"),
    "temperature-string": (body(temperature="hot"), "temperature"),
    "top_k-float": (body(top_k=1.5), "top_k"),
    "model-number": (body(model=4), "model"),
}


@pytest.mark.parametrize(("payload", "field"), INVALID.values(), ids=INVALID.keys())
async def test_invalid_fields_are_400_naming_the_field(
    raw: httpx2.AsyncClient, payload: dict[str, Any], field: str
) -> None:
    resp = await raw.post("/v1/messages", json=payload)
    message = assert_anthropic_error(resp, 400, "invalid_request_error")
    assert field in message


def crash(name: str, payload: dict[str, Any], reason: str) -> Any:
    return pytest.param(payload, id=name)


UNHASHABLE = (
    "BUG: a list where the parser expects a string is tested with `in <set>`, which raises "
    "TypeError (unhashable) in parse_messages_request: a 500, not a 400"
)
OVERFLOW = (
    "BUG: an integer temperature/top_p beyond float range makes float() raise OverflowError "
    "in the /v1/messages handler: a 500, not a 400"
)
TOP_K = (
    "BUG: a negative top_k is accepted and reaches jax.lax.top_k in the worker, which raises: "
    "a 500 'generation failed: ValueError' (an error event when streaming), not a 400"
)

# Bodies that crash the request parser or the sampler instead of being refused.
CRASHES = [
    crash("tool_choice-type-list", body(tools=TOOLS, tool_choice={"type": ["any"]}), UNHASHABLE),
    crash(
        "tool_choice-name-list",
        body(tools=TOOLS, tool_choice={"type": "tool", "name": ["bash"]}),
        UNHASHABLE,
    ),
    crash("effort-list", body(output_config={"effort": ["high"]}), UNHASHABLE),
    crash("reasoning_effort-dict", body(reasoning_effort={"x": 1}), UNHASHABLE),
    crash("temperature-huge-int", body(temperature=10**400), OVERFLOW),
    crash("top_p-huge-int", body(top_p=10**400), OVERFLOW),
    crash("top_k-negative", body(top_k=-1), TOP_K),
]


@pytest.mark.parametrize("payload", CRASHES)
async def test_hostile_field_values_are_400_not_500(
    raw: httpx2.AsyncClient, payload: dict[str, Any]
) -> None:
    resp = await raw.post("/v1/messages", content=json.dumps(payload))
    assert_anthropic_error(resp, 400, "invalid_request_error")


async def test_a_top_k_past_the_vocabulary_samples_from_all_of_it(raw: httpx2.AsyncClient):
    """A valid `top_k` of any size (the fuzzer's 10**20 once overflowed the step's int32
    into a 500) keeps every token, as no top-k does."""
    resp = await raw.post("/v1/messages", json=body(**force("ok"), top_k=10**20))
    assert resp.status_code == 200 and resp.json()["content"][0]["text"] == "ok"


async def test_deeply_nested_json_is_400(raw: httpx2.AsyncClient) -> None:
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    resp = await raw.post("/v1/messages", content=deep)
    assert_anthropic_error(resp, 400, "invalid_request_error")


async def test_unknown_fields_are_ignored(raw: httpx2.AsyncClient) -> None:
    payload = body(
        **force("ok"),
        frobnicate=True,
        metadata={"user_id": "u"},
        container={"id": None},
        service_tier="auto",
    )
    resp = await raw.post("/v1/messages", json=payload)
    assert resp.status_code == 200 and resp.json()["content"][0]["text"] == "ok"


async def test_bad_requests_leave_the_server_serving(raw: httpx2.AsyncClient) -> None:
    for payload, _ in INVALID.values():
        assert (await raw.post("/v1/messages", json=payload)).status_code == 400
    await still_serving(raw)


# ---------------------------------------------------------------------- size limits


async def test_body_over_the_limit_is_413(engine: Engine, worker: EngineWorker) -> None:
    app = make_app(worker, ServerConfig(max_body_bytes=4096))
    big = body(messages=user("x" * 5000))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            resp = await c.post(path, json=big)
            assert_anthropic_error(resp, 413, "request_too_large")
        resp = await c.post("/v1/messages", json=body(**force("ok")))  # under the limit
        assert resp.status_code == 200
        metrics = Scrape.parse((await c.get("/metrics")).text)
    assert metrics.get("ds4jax:rejected_requests_total", status="413") == 2
    assert metrics.get("ds4jax:rejected_requests_total") == 2


async def test_body_over_the_default_32_mib_is_413(raw: httpx2.AsyncClient) -> None:
    content = json.dumps(body(messages=user("x" * (32 * 1024 * 1024 + 1)))).encode()
    resp = await raw.post("/v1/messages", content=content)
    assert_anthropic_error(resp, 413, "request_too_large")


async def test_prompt_over_the_context_is_400_with_both_counts(
    client: anthropic.AsyncAnthropic, raw: httpx2.AsyncClient
) -> None:
    text = "word " * 3000
    count = await client.messages.count_tokens(
        model=MODEL, messages=user(text), thinking=NO_THINK
    )  # counting is fine at any length
    assert count.input_tokens > 2048
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as info:
            await client.messages.create(
                model=MODEL, max_tokens=4, messages=user(text), thinking=NO_THINK, stream=stream
            )
        message = assert_anthropic_error(info.value.response, 400, "invalid_request_error")
        assert str(count.input_tokens) in message and "2048" in message
    await still_serving(raw)


# ---------------------------------------------------------------------- overload


async def test_full_queue_is_503_overloaded(engine: Engine) -> None:
    """A worker whose queue (size 1) holds a job it has not started: the next request is
    refused at once, streaming or not; the queued one ends with a 503 on shutdown."""
    idle = EngineWorker(engine, max_queue=1)  # never started: its queue only fills
    app = make_app(idle)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        first = asyncio.ensure_future(c.post("/v1/messages", json=body()))
        await wait_until(lambda: idle.depth == 1)
        for stream in (False, True):
            resp = await c.post("/v1/messages", json=body(stream=stream))
            assert_anthropic_error(resp, 503, "overloaded_error")
        health = (await c.get("/health")).json()
        assert health["queue_depth"] == 1
        metrics = Scrape.parse((await c.get("/metrics")).text)
        assert metrics.get("ds4jax:requests_waiting") == 1
        idle.stop()
        assert_anthropic_error(await first, 503, "overloaded_error")
    # each refusal counted once, under its status
    assert (
        app.metrics.registry.get_sample_value(
            "ds4jax:rejected_requests_total", {"model_name": MODEL, "status": "503"}
        )
        == 3
    )


def test_the_queue_limit_counts_requests_not_started_only() -> None:
    """Requests the engine took but has no row for yet count against `--queue`; requests
    decoding in rows do not."""
    import types

    from serve.worker import Job, Overloaded

    engine = types.SimpleNamespace(waiting=[], busy=True)
    w = EngineWorker(engine, max_queue=2)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    try:
        w.submit(Job(None, loop))  # type: ignore[arg-type]
        engine.waiting.append("handed over, waiting for a row")
        with pytest.raises(Overloaded):
            w.submit(Job(None, loop))  # type: ignore[arg-type]
        assert w.waiting == 2
        engine.waiting.clear()  # it got a row: it no longer counts
        w.submit(Job(None, loop))  # type: ignore[arg-type]
        assert w.waiting == 2
    finally:
        loop.close()


async def test_full_queue_is_503_while_a_job_runs(engine: Engine, gate: Gate) -> None:
    """The same through the SDK, with a started worker busy on one job and one queued."""
    busy = EngineWorker(engine, max_queue=1)
    busy.start()
    try:
        async with sdk_client(make_app(busy)) as c:
            kw = dict(
                model=MODEL,
                max_tokens=2,
                messages=user("hi"),
                thinking=NO_THINK,
                extra_body=force("ok"),
            )
            running = asyncio.ensure_future(c.messages.create(**kw))
            await wait_until(lambda: busy.running is not None)
            queued = asyncio.ensure_future(c.messages.create(**kw))
            await wait_until(lambda: busy.depth == 2)
            with pytest.raises(anthropic.InternalServerError) as info:
                await c.messages.create(**kw)
            assert info.value.status_code == 503
            assert_anthropic_error(info.value.response, 503, "overloaded_error")
            gate.open()
            assert (await running).content[0].text == "ok"
            assert (await queued).content[0].text == "ok"
    finally:
        gate.open()
        busy.stop()


async def test_failure_mid_stream_ends_with_an_error_event(
    client: anthropic.AsyncAnthropic,
    raw: httpx2.AsyncClient,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(*_args: Any, **_kw: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "_decode_step", boom)  # fails after the decision and the prefill
    resp = await raw.post("/v1/messages", json=body(stream=True))
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert [e for e, _ in events if e != "ping"] == ["message_start", "error"]
    assert events[-1][1]["error"]["type"] == "api_error"
    stream = await client.messages.create(**body(), stream=True)
    with pytest.raises(anthropic.APIStatusError) as info:
        async for _ in stream:
            pass
    assert info.value.body["error"]["type"] == "api_error"
    monkeypatch.undo()
    assert_cold_equivalent(engine)  # the frontier after the prefill
    await still_serving(raw)


async def test_a_failure_of_ours_is_openais_server_error(
    raw: httpx2.AsyncClient, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAI's type for a server failure is `server_error` (Anthropic's `api_error`), in
    the 500 and in a stream's last event alike."""

    def boom(*_args: Any, **_kw: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "_decode_step", boom)
    chat = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    resp = await raw.post("/v1/chat/completions", json=chat)
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error", resp.text
    resp = await raw.post("/v1/chat/completions", json={**chat, "stream": True})
    chunks = [json.loads(ln[6:]) for ln in resp.text.splitlines()
              if ln.startswith("data: {")]  # fmt: skip
    assert chunks[-1]["error"]["type"] == "server_error", chunks[-1]
    reply = {"model": "m", "max_output_tokens": 4, "input": "hi"}
    resp = await raw.post("/v1/responses", json=reply)
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error", resp.text
    resp = await raw.post("/v1/responses", json={**reply, "stream": True})
    failed = [d for e, d in sse_events(resp.text) if e == "response.failed"]
    assert failed and failed[0]["response"]["error"]["code"] == "server_error", resp.text
    monkeypatch.undo()
    await still_serving(raw)


async def test_loading_server_answers_503(engine: Engine, worker: EngineWorker) -> None:
    """Requests are refused (and counted); the health probe says `loading` with a 503 that
    refuses no one, so it is not counted (a probe every second inflated the figure)."""
    app = make_app(worker)
    app.server_config.state = "loading"  # type: ignore[attr-defined]
    before = Scrape.parse(app.metrics.render().decode())  # type: ignore[attr-defined]
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        assert_anthropic_error(await c.post("/v1/messages", json=body()), 503, "overloaded_error")
        for _ in range(3):
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "loading"
    after = Scrape.parse(app.metrics.render().decode())  # type: ignore[attr-defined]
    assert after.delta(before, "ds4jax:rejected_requests_total", status="503") == 1


async def test_cors_preflight_allows_the_headers_asked_for(worker: EngineWorker) -> None:
    """With `--cors`, a preflight's `Access-Control-Request-Headers` come back allowed:
    `*` alone never covers `Authorization`, so a browser client with a Bearer key failed."""
    app = make_app(worker, ServerConfig(cors=True))
    asked = "authorization,content-type"
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        resp = await c.options("/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        })  # fmt: skip
        assert resp.headers["access-control-allow-headers"] == asked
        assert resp.headers["access-control-allow-origin"] == "*"
        resp = await c.get("/health")
        assert resp.headers["access-control-allow-headers"] == "*"


# ---------------------------------------------------------------------- fuzz

FIELDS = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "output_config",
}

# JSON-ish values, biased toward the request schema's field names and near-valid shapes.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.just(10**20),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(
        [
            "user",
            "assistant",
            "system",
            "text",
            "tool_use",
            "tool_result",
            "thinking",
            "any",
            "tool",
            "auto",
            "none",
            "enabled",
            "disabled",
            "bash",
            "<｜User｜>",
        ]
    ),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "text",
                    "content",
                    "role",
                    "id",
                    "name",
                    "input",
                    "tool_use_id",
                    "thinking",
                    "signature",
                    "source",
                    "is_error",
                    "budget_tokens",
                    "effort",
                    "input_schema",
                ]
            ),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=12,
)
blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_result", "tool_use", "thinking", "image", "doc"])},
    optional={
        "text": json_values,
        "content": json_values,
        "tool_use_id": json_values,
        "id": json_values,
        "name": json_values,
        "input": json_values,
        "thinking": json_values,
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "ctx", "bot"])},
        optional={
            "content": st.one_of(st.text(max_size=20), st.lists(blocks, max_size=3), json_values)
        },
    ),
    max_size=4,
)
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}}
valid_messages = st.sampled_from(
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": [{"type": "text", "text": "<｜User｜> hi </think>"}]}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "again"},
            {"role": "system", "content": "remember"},
        ],
        [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "t", "signature": "s"}, TOOL_USE],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "ok"}],
                        "is_error": True,
                    }
                ],
            },
        ],
    ]
)
# Mostly valid requests with one or two fields replaced: what reaches the engine.
near_valid = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "max_tokens": st.integers(1, 3),
        "messages": valid_messages,
    },
    optional={
        "stream": st.booleans(),
        "thinking": st.sampled_from(
            [NO_THINK, {"type": "enabled", "budget_tokens": 1}, {"type": "adaptive"}, True]
        ),
        "tools": st.just(TOOLS),
        "tool_choice": st.sampled_from(
            [
                {"type": "auto"},
                {"type": "any"},
                {"type": "none"},
                {"type": "tool", "name": "bash"},
                {"type": "any", "disable_parallel_tool_use": True},
            ]
        ),
        "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(0, 50),
        "system": st.text(max_size=10),
        "output_config": st.sampled_from([{"effort": "max"}, {"effort": "none"}]),
    },
).flatmap(
    lambda base: st.one_of(
        st.just(base),
        st.dictionaries(st.sampled_from(sorted(FIELDS)), json_values, min_size=1, max_size=1).map(
            lambda bad: {**base, **bad}
        ),
    )
)
wild = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just(MODEL), json_values),
        "max_tokens": st.one_of(st.integers(-2, 3), json_values),
        "messages": st.one_of(messages, json_values),
        "system": st.one_of(st.text(max_size=10), json_values),
        "tools": st.one_of(st.just(TOOLS), json_values),
        "tool_choice": json_values,
        "thinking": st.one_of(st.sampled_from([NO_THINK, {"type": "enabled"}]), json_values),
        "stop_sequences": json_values,
        "temperature": st.one_of(st.floats(0, 2), json_values),
        "top_p": st.one_of(st.floats(0, 1), json_values),
        "top_k": st.one_of(st.integers(0, 50), json_values),
        "stream": st.booleans(),
        "metadata": json_values,
        "output_config": json_values,
    },
)
request_bodies = st.one_of(near_valid, near_valid, wild)


def check_response(resp: httpx2.Response, path: str, streamed: bool) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert_anthropic_error(resp, resp.status_code)
    elif path.endswith("count_tokens"):
        assert isinstance(resp.json()["input_tokens"], int)
    elif streamed:
        events = sse_events(resp.text)
        assert events[-1][0] in ("message_stop", "error"), resp.text
        assert all(d["error"]["type"] != "api_error" for e, d in events if e == "error")
    else:
        msg = resp.json()
        assert msg["type"] == "message" and msg["id"].startswith("msg_")


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=request_bodies)
async def test_fuzzed_request_bodies_never_yield_5xx(
    raw: httpx2.AsyncClient, payload: dict[str, Any]
) -> None:
    if isinstance(payload.get("max_tokens"), int) and not isinstance(payload["max_tokens"], bool):
        payload["max_tokens"] = min(payload["max_tokens"], 3)  # keep generation short
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        resp = await raw.post(path, content=json.dumps(payload))  # NaN / Infinity allowed
        event(f"{path} {resp.status_code}")
        check_response(resp, path, streamed=payload.get("stream") is True)


async def test_a_request_the_shutdown_refuses_is_logged_as_refused_not_as_a_client_gone() -> None:
    """A request still waiting for a batch row when SIGTERM came is dropped by the engine
    (`Cancelled`) and its client answered 503 "shutting down"; the log line and the
    metrics heard "the client went away while the request was queued" — read by an
    operator as clients leaving. They now hear the 503 its client got."""
    import types

    from ds4jax.engine.requests import Cancelled
    from serve.worker import SHUTTING_DOWN, Job, Overloaded

    w = EngineWorker(types.SimpleNamespace(waiting=[], busy=False), max_queue=2)  # type: ignore[arg-type]
    heard: list[Any] = []
    w.hooks.append(lambda _job, result: heard.append(result))
    job = Job(None, asyncio.get_running_loop())  # type: ignore[arg-type]
    w._stopping = True
    w._finished(job, types.SimpleNamespace(error=Cancelled("dropped unrouted"), result=None))  # type: ignore[arg-type]
    kind, payload = await asyncio.wait_for(job.events.get(), 5)
    assert kind == "error" and isinstance(payload, Overloaded) and str(payload) == SHUTTING_DOWN
    assert heard == [payload]
    # not stopping: a client that left is just that, and nothing is posted to it
    w._stopping, heard[:] = False, []
    w._finished(job, types.SimpleNamespace(error=Cancelled("gone"), result=None))  # type: ignore[arg-type]
    assert isinstance(heard[0], Cancelled)


async def test_a_failed_worker_answers_every_open_request_and_refuses_new_ones() -> None:
    """A process of the group gone (or an engine that cannot reset after a failed step):
    the open streams were cut with no error event when the server exited, and requests
    were still accepted meanwhile. `fail` answers each open or queued request its 503 at
    once, from the watchdog's thread, and refuses new ones."""
    import types

    from serve.worker import Job, Overloaded

    w = EngineWorker(types.SimpleNamespace(waiting=[], busy=False), max_queue=4)  # type: ignore[arg-type]
    heard: list[Any] = []
    w.hooks.append(lambda _job, result: heard.append(result))
    loop = asyncio.get_running_loop()
    running, queued = Job(None, loop), Job(None, loop)  # type: ignore[arg-type]
    w._inflight.append(running)
    w.submit(queued)
    assert (await queued.events.get())[0] == "queued"
    w._jobs.put_nowait(None)  # `stop`'s sentinel, queued behind
    w.fail("process 1 of the serving group stopped")
    assert w._jobs.get_nowait() is None  # kept for the worker's thread to read
    assert len(heard) == 2 and all(isinstance(r, Overloaded) for r in heard)  # logged
    for job in (running, queued):
        kind, err = await asyncio.wait_for(job.events.get(), 5)
        assert kind == "error" and isinstance(err, Overloaded)
        assert "process 1 of the serving group stopped" in str(err)
    with pytest.raises(Overloaded, match="the server failed"):
        w.submit(Job(None, loop))  # type: ignore[arg-type]
    assert w.failed == "process 1 of the serving group stopped"
