"""Requests declared once (`ds4jax.chat.bodies`): the probe of 30 malformed requests on all
three APIs, each answered 4xx in its API's shape naming the field; `/openapi.json` generated
from the same models; schemathesis fuzzing the server from that document (positive and
negative cases) with no 5xx and the server still serving."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from ds4jax.engine import Engine
from serve import openapi
from serve.app import ServerConfig
from serve.worker import EngineWorker
from tests.serve.conftest import BASE, MODEL, NO_THINK, ThreadServer, force, make_app

pytestmark = pytest.mark.anyio

KEY = "sekrit"
MESSAGES, COUNT, RESPONSES, CHAT = (
    "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/chat/completions"
)  # fmt: skip
OPENAI = (RESPONSES, CHAT)


def valid(path: str, **changes: Any) -> dict[str, Any]:
    """A small valid body for `path`, with `changes` (`...` removes a field)."""
    if path in (MESSAGES, COUNT):
        base: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "thinking": NO_THINK,
                                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    elif path == RESPONSES:
        base = {"model": MODEL, "max_output_tokens": 2, "input": "hi"}
    else:
        base = {"model": MODEL, "max_tokens": 2, "think": False,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def user_parts(path: str, parts: list[Any]) -> dict[str, Any]:
    if path == RESPONSES:
        return valid(path, input=[{"role": "user", "content": parts}])
    return valid(path, messages=[{"role": "user", "content": parts}])


IMAGE = {
    MESSAGES: {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "AA=="}},
    RESPONSES: {"type": "input_image", "image_url": "data:image/png;base64,AA=="},
    CHAT: {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
}  # fmt: skip
AUDIO = {
    RESPONSES: {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
    CHAT: {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}},
}
CONTENT_KEY = {MESSAGES: "messages", RESPONSES: "input", CHAT: "messages"}
TEMPERATURE = {MESSAGES: "temperature", RESPONSES: "temperature", CHAT: "temperature"}
ORPHAN = {
    MESSAGES: [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_zz",
                                             "content": "x"}]}],
    RESPONSES: [{"type": "function_call_output", "call_id": "call_zz", "output": "x"}],
    CHAT: [{"role": "tool", "tool_call_id": "call_zz", "content": "x"}],
}  # fmt: skip


BAD_TOOL = {
    MESSAGES: ({"tools": [{"name": 'a"b', "input_schema": {"type": "object"}}]}, "tools[0].name"),
    CHAT: ({"tools": [{"type": "function", "function": {"name": "a\nb"}}]},
           "tools[0].function.name"),
    RESPONSES: ({"tools": [{"type": "function", "name": "a<b"}]}, "tools[0].name"),
}  # fmt: skip


def _deep(path: str, depth: int) -> bytes:
    """A valid body whose tool schema nests `depth` objects."""
    schema = '{"a": ' * depth + "1" + "}" * depth
    tool = {
        MESSAGES: '{"name": "t", "input_schema": %s}',
        RESPONSES: '{"type": "function", "name": "t", "parameters": %s}',
        CHAT: '{"type": "function", "function": {"name": "t", "parameters": %s}}',
    }[path] % schema
    body = json.dumps(valid(path))
    return (body[:-1] + ', "tools": [' + tool + "]}").encode()


def probes(path: str) -> dict[str, tuple[int, bytes | dict[str, Any], str | None]]:
    """name → (status, body, the field the error must name) for one API."""
    msgs = CONTENT_KEY[path]
    out: dict[str, tuple[int, bytes | dict[str, Any], str | None]] = {
        "bad-json": (400, b'{"model": ', None),
        "bad-utf8": (400, b'{"model": "\xff\xfe"}', None),
        "not-an-object": (400, b"[1, 2]", None),
        "empty-body": (400, b"", None),
        "json-null": (400, b"null", None),
        "deep-nesting": (400, b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
        # parsed, but deeper than rendering a schema back to JSON (~970 levels) or the
        # Responses echo (255) could take: those were 500s
        "nesting-past-the-limit": (400, _deep(path, 300), None),
        "nesting-near-the-parse-limit": (400, _deep(path, 960), None),
        # a discriminating field that is a list: unhashable, it was a 500 (hypothesis)
        "role-a-list": (
            400,
            valid(path, input=[{"type": ["message"], "role": "user", "content": "hi"}])
            if path == RESPONSES
            else valid(path, messages=[{"role": ["user"], "content": "hi"}]),
            f"{msgs}[0]",
        ),
        "nan-in-an-ignored-field": (
            400,
            (json.dumps(valid(path))[:-1] + ', "x": NaN}').encode(),
            "x",
        ),
        "number-out-of-range": (
            400,
            (json.dumps(valid(path))[:-1] + ', "x": [1e400]}').encode(),
            "x[0]",
        ),
        "stream-string": (400, valid(path, stream="yes"), "stream"),
        "nan-temperature": (
            400,
            json.dumps(valid(path, temperature=float("nan"))).encode(),
            "temperature",
        ),
        "temperature-string": (400, valid(path, temperature="hot"), "temperature"),
        "temperature-out-of-range": (400, valid(path, temperature=7), "temperature"),
        "top_p-huge-int": (400, valid(path, top_p=10**400), "top_p"),
        "model-number": (400, valid(path, model=4), "model"),
        "no-conversation": (400, valid(path, **{msgs: ...}), msgs),
        "conversation-empty": (400, valid(path, **{msgs: []}), msgs),
        "conversation-string-of-number": (400, valid(path, **{msgs: 5}), msgs),
        "image": (400, user_parts(path, [IMAGE[path]]), f"{msgs}[0].content[0]"),
        "unknown-part-type": (
            400,
            user_parts(path, [{"type": "hologram"}]),
            f"{msgs}[0].content[0]",
        ),
        "unknown-tool-call-id": (400, valid(path, **{msgs: ORPHAN[path]}), None),
        # valid JSON (`"a\\ud800b"`) that is not Unicode text: no tokenizer takes it
        "lone-surrogate": (
            400,
            valid(path, input="a\ud800b")
            if path == RESPONSES
            else valid(path, messages=[{"role": "user", "content": "a\ud800b"}]),
            "input" if path == RESPONSES else "messages[0].content",
        ),
        "lone-surrogate-in-a-key": (400, valid(path, metadata={"k\udc00": "v"}), "metadata"),
        # a name the model writes inside `invoke name="…"` cannot hold what ends it
        "tool_choice-forcing-without-tools": (
            400,
            valid(path, tool_choice={"type": "any"} if path == MESSAGES else "required"),
            "tool_choice",
        ),
        "tool-name-breaking-dsml": (400, valid(path, **BAD_TOOL[path][0]), BAD_TOOL[path][1]),
        "tools-not-a-list": (400, valid(path, tools={"name": "x"}), "tools"),
        "unknown-tool-type": (
            400,
            valid(path, tools=[{"type": "hologram", "name": "x"}]),
            "tools[0]",
        ),
        "tool_choice-unknown-tool": (
            400,
            valid(
                path,
                tools=[],
                tool_choice=(
                    {"type": "tool", "name": "nope"}
                    if path == MESSAGES
                    else {"type": "function", "name": "nope"}
                ),
            ),
            "tool_choice",
        ),
    }
    max_key = {MESSAGES: "max_tokens", RESPONSES: "max_output_tokens", CHAT: "max_tokens"}[path]
    out |= {
        "max-tokens-zero": (400, valid(path, **{max_key: 0}), max_key),
        "max-tokens-string": (400, valid(path, **{max_key: "5"}), max_key),
        "max-tokens-bool": (400, valid(path, **{max_key: True}), max_key),
        "max-tokens-huge": (400, valid(path, **{max_key: 10**30}), max_key),
        "max-tokens-past-the-model": (400, valid(path, **{max_key: 10**6}), max_key),
    }
    if path == MESSAGES:
        out["document-source-a-string"] = (
            400,
            user_parts(path, [{"type": "document", "source": "text"}]),
            "messages[0].content[0]: a document needs a source object",
        )
        out["user-without-content"] = (400, valid(path, messages=[{"role": "user"}]),
                                       "messages[0].content")  # fmt: skip
        out["lone-surrogate-in-a-tool-schema"] = (
            400,
            valid(
                path,
                tools=[{"name": "t", "input_schema": {"type": "object", "description": "\udfff"}}],
            ),
            "tools[0].input_schema.description",
        )
    if path == CHAT:
        out |= {
            "user-without-content": (
                400,
                valid(path, messages=[{"role": "user"}]),
                "messages[0].content",
            ),
            "audio": (400, user_parts(path, [AUDIO[path]]), "messages[0].content[0]"),
            "n-2": (400, valid(path, n=2), "n"),
            "top_logprobs-99": (400, valid(path, logprobs=True, top_logprobs=99), "top_logprobs"),
            "top_logprobs-without-logprobs": (400, valid(path, top_logprobs=2), "top_logprobs"),
            "stream_options-without-stream": (
                400,
                valid(path, stream_options={"include_usage": True}),
                "stream_options",
            ),
            "presence_penalty": (400, valid(path, presence_penalty=1.0), "presence_penalty"),
            "functions": (400, valid(path, functions=[{"name": "add"}]), "functions"),
            "tool_choice-function-without-a-name": (
                400,
                valid(
                    path,
                    tools=[{"type": "function", "function": {"name": "a"}}],
                    tool_choice={"type": "function"},
                ),
                "tool_choice",
            ),
            "function_call": (400, valid(path, function_call="auto"), "function_call"),
            "assistant-function_call": (
                400,
                valid(
                    path,
                    messages=[
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "function_call": {"name": "add"}},
                        {"role": "user", "content": "and?"},
                    ],
                ),
                "messages[1].function_call",
            ),
            "json_schema-format": (
                400,
                valid(path, response_format={"type": "json_schema"}),
                "response_format",
            ),
        }
    if path == RESPONSES:
        out |= {
            "user-without-content": (
                400,
                valid(path, input=[{"role": "user"}]),
                "input[0].content",
            ),
            "audio": (400, user_parts(path, [AUDIO[path]]), "input[0].content[0]"),
            "previous_response_id": (
                400,
                valid(path, previous_response_id="resp_1"),
                "previous_response_id",
            ),
            "item_reference": (
                400,
                valid(path, input=[{"type": "item_reference", "id": "x"}]),
                "input[0].type",
            ),
            "top_logprobs": (400, valid(path, top_logprobs=3), "top_logprobs"),
            "metadata-not-a-map": (400, valid(path, metadata=[1, 2]), "metadata"),
            "metadata-not-strings": (400, valid(path, metadata={"a": 1}), "metadata.a"),
        }
    return out


CASES = [
    pytest.param(path, name, *case, id=f"{path.rsplit('/', 1)[1]}-{name}")
    for path in (MESSAGES, RESPONSES, CHAT)
    for name, case in probes(path).items()
]


@pytest.fixture
async def raw(engine: Engine, worker: EngineWorker) -> AsyncIterator[httpx2.AsyncClient]:
    app = make_app(worker, ServerConfig(api_key=KEY, max_body_bytes=8 * 1024 * 1024))
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url=BASE,
                                  headers={"x-api-key": KEY}) as c:  # fmt: skip
        yield c


def assert_error_shape(path: str, resp: Any, status: int) -> dict[str, Any]:
    """The error in `path`'s API shape; returns its inner object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    if path in OPENAI:
        err = body["error"]
        assert set(err) - {"n_prompt_tokens", "n_ctx"} == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and err["type"], body
    else:
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        err = body["error"]
    return err


@pytest.mark.parametrize(("path", "name", "status", "payload", "field"), CASES)
async def test_the_probe_is_answered_4xx_in_each_apis_shape(
    raw: httpx2.AsyncClient, path: str, name: str, status: int, payload: Any, field: str | None
) -> None:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    resp = await raw.post(path, content=content, headers={"content-type": "application/json"})
    err = assert_error_shape(path, resp, status)
    if field is not None:
        assert err["message"].startswith(field), err
        if path in OPENAI:
            assert err["param"] is not None and err["param"].startswith(field), err


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES, CHAT])
async def test_a_prompt_past_the_context_says_so_as_agents_test_it(
    raw: httpx2.AsyncClient, engine: Engine, path: str
) -> None:
    """Codex compacts on OpenAI's `context_length_exceeded`, Claude Code on Anthropic's
    "prompt is too long": both, with the counts, in each API's shape."""
    long = "word " * engine.max_len
    body = (valid(path, input=long) if path == RESPONSES
            else valid(path, messages=[{"role": "user", "content": long}]))  # fmt: skip
    err = assert_error_shape(path, await raw.post(path, json=body), 400)
    assert err["message"].startswith("prompt is too long: "), err
    assert err["n_ctx"] == engine.max_len < err["n_prompt_tokens"], err
    if path in OPENAI:
        assert err["code"] == "context_length_exceeded", err
        assert err["param"] == ("input" if path == RESPONSES else "messages"), err


async def test_count_tokens_refuses_a_lone_surrogate(raw: httpx2.AsyncClient) -> None:
    def post(body: dict[str, Any]) -> Any:  # json.dumps writes "\\ud83d" escapes
        return raw.post(COUNT, content=json.dumps(body).encode(),
                        headers={"content-type": "application/json"})  # fmt: skip

    body = valid(COUNT, system=[{"type": "text", "text": "\ud83d"}])
    err = assert_error_shape(COUNT, await post(body), 400)
    assert err["message"].startswith("system[0].text: holds a lone UTF-16 surrogate (\\ud83d)")
    pair = valid(COUNT, system="\ud83d\ude00")  # a whole pair is one character: counted
    assert (await post(pair)).status_code == 200


@pytest.mark.parametrize("path", [MESSAGES, COUNT, RESPONSES, CHAT])
async def test_keys_size_and_still_serving(raw: httpx2.AsyncClient, path: str) -> None:
    for headers in ({"x-api-key": ""}, {"x-api-key": "wrong"}):
        resp = await raw.post(path, json=valid(path), headers=headers)
        assert_error_shape(path, resp, 401)
    big = valid(path, metadata={"pad": "x" * (9 * 1024 * 1024)})  # over the 8 MiB limit
    assert_error_shape(path, await raw.post(path, json=big), 413)
    resp = await raw.post(path, json=valid(path, **force("ok")))
    assert resp.status_code == 200, resp.text


async def test_twenty_megabytes_is_413_at_the_default_limit(engine: Engine, worker: EngineWorker):
    app = make_app(worker)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        for path in (MESSAGES, RESPONSES, CHAT):
            big = valid(path, metadata={"pad": "x" * (20 * 1024 * 1024)})  # > 32 MiB? no: 20
            resp = await c.post(path, content=json.dumps(big).encode())
            # 20 MB is under the default 32 MiB: validated (the pad is an ignored field)
            assert resp.status_code == 200, (path, resp.status_code)


async def test_openapi_document_and_page(raw: httpx2.AsyncClient) -> None:
    resp = await raw.get("/openapi.json", headers={"x-api-key": ""})  # public
    doc = resp.json()
    assert resp.status_code == 200 and doc["openapi"].startswith("3.1")
    for path in (MESSAGES, COUNT, RESPONSES, CHAT):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = ref["$ref"].rsplit("/", 1)[1]
        assert doc["components"]["schemas"][name]["properties"], name
    assert '"ge"' not in resp.text and '"le"' not in resp.text  # JSON Schema's own keywords
    chat = doc["components"]["schemas"]["ChatBody"]["properties"]
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    page = await raw.get("/docs")
    assert page.status_code == 200 and "POST /v1/chat/completions" in page.text
    assert "top_logprobs" in page.text


# ---------------------------------------------------------------------- schemathesis

SCHEMA = schemathesis.openapi.from_dict(openapi.document())
#: examples per operation and mode: 4 operations × 2 modes × this many requests
EXAMPLES = 25
_MAX_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _short(path: str, body: Any) -> Any:
    """Keep replies short: a limit over 2 clamped to 2, whole numbers written as floats
    (`64939.0`, a JSON Schema integer) too; in an OpenAI body a null limit (the server's
    default) or none set to 2. Else a reply runs to the context: a minute of decoding on 2
    cores. The fuzzing is of the request shapes, not of long generations."""
    if not isinstance(body, dict):
        return body
    for key in _MAX_KEYS:
        value = body.get(key)
        if value is None and key in body and path in OPENAI:
            body[key] = 2
        elif (isinstance(value, int | float) and not isinstance(value, bool) and value > 2
              and float(value).is_integer()):  # fmt: skip
            body[key] = 2
    if path in OPENAI and not any(k in body for k in _MAX_KEYS):
        body["max_output_tokens" if path == RESPONSES else "max_tokens"] = 2
    return body


@pytest.fixture(scope="module")
def keyed_server(worker: EngineWorker) -> Any:
    with ThreadServer(make_app(worker, ServerConfig(api_key=KEY))) as server:
        yield server


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["positive", "negative"])  # fmt: skip
@pytest.mark.parametrize("path", [MESSAGES, COUNT, RESPONSES, CHAT])
def test_schemathesis_finds_no_5xx(
    keyed_server: ThreadServer, engine: Engine, path: str, mode: GenerationMode
) -> None:
    """Bodies generated from `/openapi.json`: never a 5xx, every 4xx in the API's shape, a
    positive body that is refused says which field; the server serves afterwards."""
    statuses: dict[int, int] = {}
    reasons: set[str] = set()
    session = requests.Session()
    session.headers["x-api-key"] = KEY

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=SCHEMA[path]["POST"].as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        body = _short(path, case.body if isinstance(case.body, dict | list) else None)
        data = b"" if body is None else json.dumps(body).encode()
        resp = session.post(keyed_server.url + path, data=data, timeout=120,
                            headers={"content-type": "application/json"})  # fmt: skip
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, resp.text
        if resp.status_code >= 400:
            err = assert_error_shape(path, resp, resp.status_code)
            reasons.add(err["message"][:90])

    run()
    print(f"{path} {mode.value}: statuses {statuses}", *sorted(reasons)[:12], sep="\n  ")
    resp = session.post(keyed_server.url + path, json=valid(path))
    assert resp.status_code == 200, resp.text
    if mode is GenerationMode.POSITIVE:  # valid bodies mostly pass (some name unknown ids)
        assert statuses.get(200, 0) > 0, statuses


def test_a_long_prompt_tokenizes_off_the_event_loop(worker: EngineWorker) -> None:
    """A multi-megabyte prompt is read, rendered and tokenized on the preparing thread,
    the tokenizer letting go of the GIL: the server answers probes all the while (on the
    loop, a 30 MB prompt's 16 s of tokenizing stopped every stream and /health)."""
    body = json.dumps(valid(MESSAGES, messages=[
        {"role": "user", "content": "hello world " * 400_000}]))  # fmt: skip
    sent, done = threading.Event(), threading.Event()
    answer: list[Any] = []

    def chunks() -> Any:
        for i in range(0, len(body), 1 << 16):
            yield body[i : i + (1 << 16)].encode()
        sent.set()

    def post(url: str) -> None:
        answer.append(requests.post(url + MESSAGES, data=chunks(), timeout=300,
                                    headers={"content-type": "application/json"}))  # fmt: skip
        done.set()

    with ThreadServer(make_app(worker)) as server:
        thread = threading.Thread(target=post, args=(server.url,))
        thread.start()
        assert sent.wait(120)
        probes = 0
        while not done.is_set():
            assert requests.get(server.url + "/health", timeout=300).status_code == 200
            probes += not done.is_set()
        thread.join()
    assert answer[0].status_code == 400 and "prompt is too long" in answer[0].text
    assert probes >= 5, probes  # on the loop: none until the prompt's answer


def test_a_prompt_of_exactly_the_context_says_no_room_is_left() -> None:
    from ds4jax.engine.requests import prompt_too_long

    assert str(prompt_too_long(9, 8, "messages")).endswith("9 tokens, the context is 8")
    assert str(prompt_too_long(8, 8, "messages")).endswith(
        "8 tokens, the context is 8 (a prompt must leave room for a token of reply)"
    )


def test_a_body_names_where_it_is_not_json_numbers() -> None:
    from serve.app import decode_json

    for raw, says in ((b'{"a": {"b": [1, NaN]}}', "a.b[1]: NaN is not a JSON number"),
                      (b'{"t": -Infinity}', "t: -Infinity is not a JSON number"),
                      (b'{"t": 1e400}', "t: a number out of range (beyond float)"),
                      (b'[NaN]', "[0]: NaN is not a JSON number")):  # fmt: skip
        with pytest.raises(Exception, match=re.escape(says)):
            decode_json(raw)
    assert decode_json(b'{"t": 1e300, "u": [true, null]}') == {"t": 1e300, "u": [True, None]}
