"""The Quart app: thin routes over `EngineWorker` for three protocols — Anthropic Messages
(`/v1/messages`), OpenAI Responses (`/v1/responses`) and Chat Completions
(`/v1/chat/completions`) — each converted to the same `MessagesRequest` and served by the
same decision procedure; only the wire shapes differ (`protocol`, `responses_wire`,
`chat_wire`).

Every failure a client can cause is a 4xx in its protocol's error shape (Anthropic:
`{"type":"error","error":{…}}`; OpenAI: `{"error":{"message","type","param","code"}}`); a
stream that has started always ends, with an error event if something went wrong, so
clients never hang waiting for the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from quart import Quart, Response, g, request

from ds4jax.chat.anthropic import MessagesRequest, parse_messages_request
from ds4jax.chat.bodies.common import JSONConstant, body_problem
from ds4jax.chat.chat_completions import parse_chat_request
from ds4jax.chat.errors import RequestError, field_error
from ds4jax.chat.kinds import Api
from ds4jax.chat.render import render
from ds4jax.chat.responses import parse_responses_request
from ds4jax.continuation.evidence import attach_tool_memory
from ds4jax.continuation.reasoning_seal import ReasoningSeal
from ds4jax.engine import SamplingParams
from serve import chat_wire, openapi, protocol, responses_wire
from serve.metrics import ServerMetrics
from serve.worker import EngineWorker, Job, Overloaded

log = logging.getLogger("ds4jax.serve")


@dataclass
class ServerConfig:
    model_name: str = "deepseek-v4-flash"
    api_key: str | None = None
    cors: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    ping_interval: float = 4.0
    min_p: float = 0.05  # the default filter (ds4's); Anthropic has no min_p field
    aliases: list[str] = field(default_factory=list)
    state: str = "loading"  # loading → ready
    created_at: str = "2026-01-01T00:00:00Z"
    #: seals Responses reasoning items; `ds4jax serve` keeps its key in --kv-disk-dir
    seal: ReasoningSeal = field(default_factory=ReasoningSeal.fresh)
    #: how the model is served, for /metrics' `model_config_info` (config, weights, mesh…)
    info: dict[str, str] = field(default_factory=dict)


OPENAI_PATHS = ("/v1/responses", "/v1/chat/completions")
#: answered without the API key: nothing in them is private
PUBLIC_PATHS = ("/health", "/openapi.json", "/docs")


#: seconds a client is told to wait before retrying an overloaded answer (`retry-after`)
RETRY_AFTER_S = 2


def _err(
    status: int,
    message: str,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    fields: dict[str, Any] | None = None,
) -> Response:
    """An error in the shape of the protocol the request spoke (by its path). Overloaded
    (529, Anthropic's own status; 503 in OpenAI's shape) carries `retry-after`; OpenAI's
    `param` is the JSON path of the field at fault, its `code` the error's where it has one,
    and a failure of ours is its `server_error` (Anthropic's `api_error`). `fields`: more of
    the error object, in either shape."""
    kind = error_type or protocol.ERROR_TYPES.get(status, "api_error")
    if request.path.rstrip("/") in OPENAI_PATHS:  # (a stray trailing slash: still OpenAI's)
        status = 503 if status == 529 else status
        kind = protocol.openai_type(kind)
        body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param,
                                          "code": code, **(fields or {})}}  # fmt: skip
    else:
        body = protocol.error_body(kind, message)
        body["error"].update(fields or {})
    headers = {"retry-after": str(RETRY_AFTER_S)} if kind == "overloaded_error" else {}
    return Response(json.dumps(body), status=status, content_type="application/json",
                    headers=headers)  # fmt: skip


def decode_json(raw: bytes) -> Any:
    """A request body as JSON, or a RequestError (400): empty, not JSON, or holding what no
    field may (`bodies.common.body_problem`: NaN and infinities, nesting too deep, a lone
    surrogate), named where it is. Its parse is then told so (`checked=True`): `validate`
    runs the same walk for the CLI's bodies, once a body."""
    if not raw:
        raise RequestError("request body is empty")
    try:
        body = json.loads(raw, parse_constant=JSONConstant)
    except RecursionError as err:
        raise RequestError("request body is nested too deeply") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"request body is not valid JSON: {err}") from err
    if (bad := body_problem(body)) is not None:
        where, what = bad
        raise field_error(where, what) if where else RequestError(what)
    return body


def create_app(worker: EngineWorker, config: ServerConfig) -> Quart:
    app = Quart(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.config["BODY_TIMEOUT"] = 600
    engine = worker.engine
    metrics = ServerMetrics(
        worker, config.model_name, {"context": str(engine.max_len), **config.info}
    )
    worker.watch(metrics)

    def model_ids() -> list[str]:
        return [config.model_name, *config.aliases]

    @app.before_request
    async def auth() -> Response | None:
        g.arrived = time.perf_counter()  # a request's latencies count from here
        if request.method == "OPTIONS":
            return Response("", status=204)
        if config.api_key is None or request.path in PUBLIC_PATHS:
            return None
        key = request.headers.get("x-api-key")
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            key = key or bearer[7:].strip()
        if key != config.api_key:
            return _err(401, "invalid x-api-key")
        return None

    @app.after_request
    async def cors(resp: Response) -> Response:
        if resp.status_code >= 400 and request.path != "/health":  # a probe's 503 refuses no one
            metrics.rejected(resp.status_code)
        if config.cors:
            resp.headers["Access-Control-Allow-Origin"] = "*"
            # the preflight's own list: `*` never covers Authorization (the Fetch spec), so
            # a browser client sending a Bearer key would fail its preflight
            asked = request.headers.get("Access-Control-Request-Headers")
            resp.headers["Access-Control-Allow-Headers"] = asked or "*"
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        return resp

    @app.errorhandler(404)
    async def not_found(_e: Any) -> Response:
        return _err(404, f"no route for {request.method} {request.path}")

    @app.errorhandler(405)
    async def not_allowed(_e: Any) -> Response:
        return _err(404, f"no route for {request.method} {request.path}")

    @app.errorhandler(413)
    async def too_large(_e: Any) -> Response:
        return _err(413, f"request body exceeds {config.max_body_bytes} bytes")

    @app.errorhandler(Exception)
    async def crashed(e: Exception) -> Response:
        if hasattr(e, "code") and isinstance(e.code, int) and 400 <= e.code < 500:
            return _err(e.code, str(getattr(e, "description", e)))
        log.exception("unhandled error")
        return _err(500, "internal server error")

    #: reading, validating, rendering and tokenizing a request run on this thread, not the
    #: event loop: a 30 MB prompt tokenized there (16 s) froze every stream and /health.
    #: One thread, so requests are prepared in the order they arrived, as on the loop.
    preparing = ThreadPoolExecutor(1, thread_name_prefix="ds4jax-prepare")

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(preparing, fn, *args)

    @app.after_serving
    async def _stop_preparing() -> None:  # a request being prepared is not waited for
        preparing.shutdown(wait=False, cancel_futures=True)

    @app.get("/health")
    async def health() -> Response:
        live = engine.live
        body = {
            "status": config.state if worker.failed is None else f"failed: {worker.failed}",
            "queue_depth": worker.depth,
            "model": config.model_name,
            "live_tokens": live.pos if live is not None else 0,
            "context": engine.max_len,
            **engine.stats(),
        }
        ok = config.state == "ready" and worker.failed is None
        return Response(json.dumps(body), status=200 if ok else 503,
                        content_type="application/json")  # fmt: skip

    @app.get("/openapi.json")
    async def openapi_document() -> Response:
        return Response(json.dumps(openapi.document()), content_type="application/json")

    @app.get("/docs")
    async def openapi_page() -> Response:
        return Response(openapi.page(), content_type="text/html; charset=utf-8")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), content_type=CONTENT_TYPE_LATEST)

    created = int(datetime.fromisoformat(config.created_at).timestamp())

    def model_obj(mid: str) -> dict[str, Any]:
        """Anthropic's model object and OpenAI's in one: each SDK reads its own fields."""
        return {"type": "model", "id": mid, "display_name": mid, "created_at": config.created_at,
                "object": "model", "created": created, "owned_by": "ds4jax"}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> Response:
        data = [model_obj(m) for m in model_ids()]
        body = {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"],
            "last_id": data[-1]["id"],
        }
        return Response(json.dumps(body), content_type="application/json")

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id not in model_ids():
            return _err(404, f"model {model_id!r} not found")
        return Response(json.dumps(model_obj(model_id)), content_type="application/json")

    def counted(raw: bytes) -> int:
        req = parse_messages_request(decode_json(raw), max_context=engine.max_len, checked=True)
        attach_tool_memory(req.conversation, engine.tool_memory.block_for)
        return len(engine.tokenizer.encode_segments(render(req.conversation)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        try:
            n = await off_loop(counted, await request.get_data())
        except RequestError as err:
            return _client_error(err)
        return Response(json.dumps({"input_tokens": n}), content_type="application/json")

    def prepared_request(req: MessagesRequest, api: Api, hint: str | None) -> Any:
        """The decision's evidence and the 400s it finds (`Engine.prepare_request`), off
        the loop."""
        # Claude Code always asks for 32000: anything up to the model's position limit is
        # clamped to the room left in the context (decoding stops there); beyond it the
        # value is nonsense. OpenAI bodies may leave it out: the room left.
        limit = engine.cfg.max_position_embeddings
        if req.max_tokens is not None and req.max_tokens > limit:
            raise field_error(req.max_tokens_field, f"{req.max_tokens} exceeds the "
                              f"model's maximum ({limit})")  # fmt: skip
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else float(req.top_p),
            min_p=config.min_p,
            seed=None if req.seed is None else req.seed % (2**31),
            logprobs=req.logprobs,
        )
        return engine.prepare_request(
            req, sampling=sampling, hint=hint, api=api,
            max_tokens=engine.max_len if req.max_tokens is None else None,
        )  # fmt: skip

    def _submit(body: Any, prepared: Any) -> Job | Response:
        """Queue a prepared request: its job, or the error response."""
        job = Job(prepared, asyncio.get_running_loop(), arrived=g.arrived)
        job.forced_tokens = app.config.get("TEST_FORCED_TOKENS_HOOK", lambda _b: None)(body)
        try:
            worker.submit(job)
        except Overloaded as err:
            return _err(503, str(err))
        return job

    async def _answer(
        api: Api,
        parse: Callable[[Any], Any],
        request_of: Callable[[Any], MessagesRequest],
        hint_headers: tuple[str, ...],
        wire: Callable[[Any], Any],
        whole: Callable[[Any, int], Callable[[Any], dict[str, Any]]],
    ) -> Response:
        """One API's request, the same way for all three: not ready (503); read and
        validate (`parse`: 400 naming the field); prepare and queue (`_submit`); then the
        stream through the API's `wire` writer, or the `whole` reply (a function of the
        converted request and the created time)."""
        if config.state != "ready":
            return _err(503, "the model is still loading")
        hint = next((request.headers[h] for h in hint_headers if request.headers.get(h)), None)

        def read(raw: bytes) -> tuple[Any, Any, MessagesRequest, Any]:
            body = decode_json(raw)
            converted = parse(body)
            req = request_of(converted)
            return body, converted, req, prepared_request(req, api, hint)

        try:
            body, converted, req, prepared = await off_loop(read, await request.get_data())
        except RequestError as err:  # an EngineError is one
            return _client_error(err)
        job = _submit(body, prepared)
        if isinstance(job, Response):
            return job
        if req.stream:
            return await _stream(job, wire(converted))
        return await _complete(job, whole(converted, int(time.time())))

    @app.post("/v1/messages")
    async def messages() -> Response:
        mid = protocol.new_message_id()
        return await _answer(
            Api.ANTHROPIC,
            lambda b: parse_messages_request(
                b, max_context=engine.max_len, require_max_tokens=True, checked=True
            ),
            lambda req: req,
            ("x-session-id",),
            lambda req: protocol.AnthropicStream(mid, req.model),
            lambda req, _t: lambda r: protocol.final_message(mid, req.model, r),
        )

    @app.post("/v1/responses")
    async def responses() -> Response:
        rid = responses_wire.new_id("resp_")
        return await _answer(
            Api.RESPONSES,
            lambda b: parse_responses_request(
                b, max_context=engine.max_len, unseal=config.seal.open, checked=True
            ),
            lambda rreq: rreq.request,
            ("session-id", "x-session-id"),
            lambda rreq: responses_wire.ResponsesStream(rid, rreq, config.seal.seal),
            lambda rreq, t: (
                lambda r: responses_wire.final_response(rid, rreq, r, config.seal.seal, t)
            ),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        cid = chat_wire.new_completion_id()
        return await _answer(
            Api.CHAT,
            lambda b: parse_chat_request(b, max_context=engine.max_len, checked=True),
            lambda creq: creq.request,
            ("session-id", "x-session-id"),
            lambda creq: chat_wire.ChatStream(cid, creq.request.model, creq.include_usage),
            lambda creq, t: lambda r: chat_wire.final_completion(cid, creq.request.model, r, t),
        )

    async def _complete(job: Job, shape: Callable[[Any], dict[str, Any]]) -> Response:
        """A non-streaming reply: the job's result in its protocol's `shape`, or its error."""
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "done":
                    return Response(json.dumps(shape(payload)), content_type="application/json")
                if kind == "error":
                    return _engine_error(payload)
        except asyncio.CancelledError:
            job.cancel.set()
            raise

    async def _stream(job: Job, wire: Any) -> Response:
        """The one SSE loop of the three APIs: the job's events, projected by `wire` (the
        API's writer: `protocol.AnthropicStream`, `responses_wire.ResponsesStream`,
        `chat_wire.ChatStream`), with the API's keepalive through long prefills and queues.
        A stream that has started always ends — with the API's failure frame if the work
        failed — and a client that goes away cancels the work."""
        first = await _first(job)
        if isinstance(first, Response):
            return first

        async def frames():
            finished = False
            pending = [first] if first is not None else []
            try:
                for frame in wire.start(first is None, job.prepared.prompt_tokens):
                    yield frame
                while True:
                    item = pending.pop(0) if pending else await _next(job, config.ping_interval)
                    if item is None or item[0] in ("progress", "queued"):
                        yield wire.keepalive
                        continue
                    kind, payload = item
                    if kind == "decided":
                        decision, prefill_n = payload
                        out = wire.decided(decision.cached, prefill_n)
                    elif kind == "event":
                        out = wire.feed(payload)
                    elif kind == "done":
                        finished = True
                        out = wire.finish(payload)
                    else:  # "error"
                        finished = True
                        metrics.rejected(_status(payload))
                        out = wire.fail(*_failure(payload))
                    for frame in out:
                        yield frame
                    if finished:
                        return
            finally:
                if not finished:  # the client went away (or the stream broke): stop work
                    job.cancel.set()

        return _sse(frames())

    async def _next(job: Job, timeout: float | None) -> tuple[str, Any] | None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
        # that lands in the same loop step as the event, and a disconnect would go unnoticed
        try:
            async with asyncio.timeout(timeout):
                return await job.events.get()
        except TimeoutError:
            return None

    async def _first(job: Job) -> tuple[str, Any] | Response | None:
        """Wait briefly for the decision so a 409 can still be a real HTTP status (the
        response); a request that stays queued longer gets its stream (None) right away."""
        first = await _next(job, 1.0)
        while first is not None and first[0] in ("queued", "progress"):
            first = await _next(job, 1.0)
        if first is not None and first[0] == "error":
            return _engine_error(first[1])
        return first

    def _sse(frames: Any) -> Response:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        resp = Response(frames, content_type="text/event-stream", headers=headers)
        resp.timeout = None
        return resp

    def _engine_error(err: Exception) -> Response:
        if isinstance(err, RequestError):
            return _client_error(err)
        if isinstance(err, Overloaded):
            return _err(_status(err), str(err))
        log.error("request failed: %r", err)
        return _err(500, f"generation failed: {type(err).__name__}")

    app.worker = worker  # type: ignore[attr-defined]
    app.metrics = metrics  # type: ignore[attr-defined]  # held here: the worker's is weak
    app.server_config = config  # type: ignore[attr-defined]
    return app


def _client_error(err: RequestError) -> Response:
    return _err(err.status, err.message, err.error_type, err.param, err.code, err.fields)


def _failure(err: Exception) -> tuple[str, str, str | None]:
    """(message, error type, OpenAI's code) of a failure after a stream started."""
    if isinstance(err, RequestError):
        return err.message, err.error_type, err.code
    if isinstance(err, Overloaded):  # the shutdown: the client should retry
        return str(err), "overloaded_error", None
    return f"generation failed: {type(err).__name__}", "api_error", None


def _status(err: Exception) -> int:
    """The HTTP status an engine-side failure answers with."""
    if isinstance(err, RequestError):
        return err.status
    return 503 if isinstance(err, Overloaded) else 500


async def warm_up(worker: EngineWorker) -> float:
    """Compile every prefill chunk size and the decode step before serving."""
    t0 = time.perf_counter()
    await asyncio.get_running_loop().run_in_executor(None, worker.engine.warm_up)
    return time.perf_counter() - t0
