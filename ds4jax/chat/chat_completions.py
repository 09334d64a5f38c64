"""OpenAI Chat Completions request bodies (`POST /v1/chat/completions`) → `MessagesRequest`.

Messages: `system` / `developer` (see `openai_items`), `user` (a string or text parts),
`assistant` (content, `reasoning_content` — DeepSeek's field for its reasoning — and
`tool_calls`), `tool` (`tool_call_id` + content: a tool_result). Thinking follows the same
controls as the Anthropic side (`thinking`, `reasoning_effort`) plus ds4's boolean `think`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds4jax.chat.anthropic import (
    MessagesRequest,
    RequestError,
    model_of,
    number,
    stop_strings,
    thinking_controls,
)
from ds4jax.chat.conversation import Conversation, ToolCall
from ds4jax.chat.openai_items import Builder, arguments_of, fail, offered, parse_tools, parts_text


@dataclass
class ChatRequest:
    request: MessagesRequest
    include_usage: bool = False  # `stream_options.include_usage`: a final usage chunk


def _assistant(m: dict[str, Any], where: str, b: Builder) -> None:
    reasoning = m.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise fail(f"{where}.reasoning_content", "must be a string")
        b.reasoning(reasoning)
    b.assistant_text(parts_text(m.get("content"), f"{where}.content"))
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise fail(f"{where}.tool_calls", "must be a list")
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise fail(at, "must have a function with a name")
        cid = c.get("id")
        if not isinstance(cid, str) or not cid:
            raise fail(f"{at}.id", "must be a non-empty string")
        args = arguments_of(fn.get("arguments"), f"{at}.function.arguments")
        b.call(ToolCall(name=fn["name"], arguments=args, id=cid))


def parse_chat_request(body: Any, *, max_context: int | None = None) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("missing messages")
    if body.get("n") not in (None, 1):
        raise fail("n", "only 1 is supported")
    schemas, choice = offered(parse_tools(body.get("tools")).schemas, body)

    controls = {k: body[k] for k in ("thinking", "reasoning_effort", "model") if k in body}
    if isinstance(body.get("think"), bool):
        controls["thinking"] = body["think"]
    thinking, think_max, budget = thinking_controls(controls, max_context)

    b = Builder()
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise fail(where, "must be an object")
        role = m.get("role")
        if role in ("system", "developer"):
            b.instruction(parts_text(m.get("content"), f"{where}.content"))
        elif role == "user":
            b.user_text(parts_text(m.get("content"), f"{where}.content"))
        elif role == "assistant":
            _assistant(m, where, b)
        elif role in ("tool", "function"):
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise fail(f"{where}.tool_call_id", "must be a non-empty string")
            b.tool_output(cid, parts_text(m.get("content"), f"{where}.content"))
        else:
            raise fail(f"{where}.role", f"unknown role {role!r}")

    max_tokens = number(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise fail("max_tokens", "must be >= 1")
    options = body.get("stream_options")
    hint = body.get("prompt_cache_key") or body.get("user")
    req = MessagesRequest(
        conversation=Conversation(b.finish(schemas), thinking=thinking, think_max=think_max),
        model=model_of(body),
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        stop_sequences=stop_strings(body, "stop"),
        temperature=number(body, "temperature", float),
        top_p=number(body, "top_p", float),
        top_k=number(body, "top_k", int),
        tool_choice=choice,
        thinking_budget=budget,
        user_id=hint[:256] if isinstance(hint, str) and hint else None,
    )
    include = isinstance(options, dict) and options.get("include_usage") is True
    return ChatRequest(request=req, include_usage=include)
