"""`GET /openapi.json` and `GET /docs`: the server's HTTP surface as an OpenAPI 3.1
document, generated from the request schemas every request is validated against
(`ds4jax.chat.bodies`), so the document, the validation and the fuzzing in the suite
(schemathesis) cannot drift apart. Response bodies are described loosely (an object): their
exact shapes are the official APIs', checked by the official SDKs in the tests.
"""

from __future__ import annotations

import html
import json
from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from ds4jax.chat.bodies.anthropic import CountTokensBody, MessagesBody
from ds4jax.chat.bodies.openai import ChatBody, ResponsesBody

_REF = "#/components/schemas/{model}"
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_OBJECT = {"type": "object"}
#: (path, request schema, summary, error shape, streams)
_POSTS = (
    ("/v1/messages", MessagesBody, "Anthropic Messages (Claude Code)", "AnthropicError", True),
    ("/v1/messages/count_tokens", CountTokensBody, "Count a Messages prompt's tokens",
     "AnthropicError", False),
    ("/v1/responses", ResponsesBody, "OpenAI Responses (Codex CLI)", "OpenAIError", True),
    ("/v1/chat/completions", ChatBody, "OpenAI Chat Completions", "OpenAIError", True),
)  # fmt: skip
_ERRORS = {
    "400": "invalid request: the message names the field's JSON path",
    "401": "missing or wrong API key (when the server has one)",
    "409": "the live continuation state moved: replay the full history",
    "413": "request body over the server's limit",
    "503": "overloaded, or the model is still loading (retry-after)",
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error_responses(shape: str) -> dict[str, Any]:
    ref = {"$ref": _REF.format(model=shape)}
    return {code: {"description": why, "content": _json(ref)} for code, why in _ERRORS.items()}


@cache
def document(version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI document (the same object for the life of the process)."""
    _, defs = models_json_schema(
        [(model, "validation") for _, model, *_ in _POSTS], ref_template=_REF
    )
    schemas = {**defs["$defs"], "AnthropicError": _ANTHROPIC_ERROR, "OpenAIError": _OPENAI_ERROR}
    paths: dict[str, Any] = {}
    for path, model, summary, shape, streams in _POSTS:
        ok: dict[str, Any] = _json(_OBJECT)
        if streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        paths[path] = {
            "post": {
                "summary": summary,
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {
                    "required": True,
                    "content": _json({"$ref": _REF.format(model=model.__name__)}),
                },
                "responses": {
                    "200": {"description": "the reply (a stream when `stream` is true)",
                            "content": ok},
                    **_error_responses(shape),
                },
            }
        }  # fmt: skip
    gets = {
        "/v1/models": "the served model ids",
        "/health": "readiness and live-state counters (503 while loading)",
        "/metrics": "Prometheus metrics (text exposition)",
    }
    for path, summary in gets.items():
        paths[path] = {"get": {"summary": summary,
                               "operationId": path.strip("/").replace("/", "_"),
                               "responses": {"200": {"description": summary},
                                             "503": {"description": "loading"}}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ds4jax",
            "version": version,
            "description": "DeepSeek V4 for coding agents: Anthropic Messages, OpenAI "
            "Responses and Chat Completions with live tool continuation.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "bearer": {"type": "http", "scheme": "bearer"},
            },
        },
        "security": [{"apiKey": []}, {"bearer": []}, {}],
    }


def page() -> str:
    """`/docs`: the document as one plain HTML page (no scripts, nothing fetched)."""
    doc = document()
    out = [
        "<!doctype html><meta charset=utf-8><title>ds4jax API</title>",
        "<style>body{font:15px/1.45 system-ui;max-width:60em;margin:2em auto}"
        "code,pre{font:13px ui-monospace,monospace}pre{background:#f6f6f6;padding:1em;"
        "overflow:auto}</style>",
        "<h1>ds4jax API</h1><p>The machine-readable document: "
        '<a href="/openapi.json"><code>/openapi.json</code></a>.</p>',
    ]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            out.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>")
            out.append(f"<p>{html.escape(op['summary'])}</p>")
            body = op.get("requestBody")
            if body:
                ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                schema = doc["components"]["schemas"][ref]
                rows = "".join(
                    f"<tr><td><code>{html.escape(name)}</code>"
                    f"{' (required)' if name in schema.get('required', []) else ''}</td>"
                    f"<td><code>{html.escape(_brief(prop))}</code></td></tr>"
                    for name, prop in schema["properties"].items()
                )
                out.append(f"<table>{rows}</table>")
    return "\n".join(out)


def _brief(schema: dict[str, Any]) -> str:
    """A one-line type: `integer ≥ 1`, `string | array`, `→ Tool`."""
    if "$ref" in schema:
        return "→ " + schema["$ref"].rsplit("/", 1)[1]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_brief(s) for s in schema[key])
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    kind = str(schema.get("type", "any"))
    if kind == "array" and "items" in schema:
        kind = f"array of {_brief(schema['items'])}"
    bounds = [f"≥ {schema['minimum']}" if "minimum" in schema else "",
              f"≤ {schema['maximum']}" if "maximum" in schema else ""]  # fmt: skip
    return " ".join([kind, *[b for b in bounds if b]])
