"""OpenAI Responses request bodies (`POST /v1/responses`, what Codex CLI sends) →
`MessagesRequest`, the request every protocol becomes, plus what the response needs back.

Codex replays its full visible history every turn (`store: false`, never
`previous_response_id`), so the server keeps no response objects: a non-null
`previous_response_id` or `conversation` is a 400 with ds4's message. A `reasoning` item
renders as its turn's reasoning: the exact text its `encrypted_content` seal carries when the
seal opens (`continuation.reasoning_seal`), else its `content` text, else its summary; a
seal that does not open is ignored with a warning. Shared rules are in `openai_items`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.anthropic import (
    MessagesRequest,
    RequestError,
    model_of,
    number,
    thinking_controls,
)
from ds4jax.chat.conversation import Conversation, ToolCall
from ds4jax.chat.openai_items import Builder, arguments_of, fail, offered, parse_tools, parts_text

log = logging.getLogger("ds4jax.serve")

#: items that record hosted tools' work, or client-side compaction: nothing to render
_SKIPPED_ITEMS = {"web_search_call", "file_search_call", "compaction", "context_compaction"}
_OUTPUT_ITEMS = {"function_call_output", "custom_tool_call_output", "local_shell_call_output"}
_CALL_ITEMS = {"function_call", "custom_tool_call", "local_shell_call"}
_NO_THINKING_EFFORTS = {"none", "minimal"}


@dataclass
class ResponsesRequest:
    request: MessagesRequest
    #: `reasoning.summary` asked for: the reasoning streams as summary events and fills
    #: the reasoning item's `summary` (the full text is its own summary); otherwise it is the
    #: item's `content`
    summary: bool = False
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Codex's thread id: a routing tie-break, like Anthropic's `metadata.user_id`
    cache_key: str | None = None
    #: echoed in the response object
    echo: dict[str, Any] = field(default_factory=dict)


def _reasoning_text(item: dict[str, Any], where: str, unseal: Callable[[str], str | None]) -> str:
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed:
        text = unseal(sealed)
        if text is not None:
            return text
        log.warning("responses: %s.encrypted_content does not authenticate; ignored", where)
    content = item.get("content")
    if content:
        return parts_text(content, f"{where}.content")
    summary = item.get("summary")
    return parts_text(summary, f"{where}.summary") if summary else ""


def _call_id(item: dict[str, Any], where: str) -> str:
    cid = item.get("call_id") or item.get("id")
    if not isinstance(cid, str) or not cid:
        raise fail(f"{where}.call_id", "must be a non-empty string")
    return cid


def _input(raw: Any, b: Builder, unseal: Callable[[str], str | None]) -> None:
    if isinstance(raw, str):
        b.user_text(raw)
        return
    if not isinstance(raw, list) or not raw:
        raise RequestError("missing input")
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise fail(where, "must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role, text = item.get("role"), parts_text(item.get("content"), f"{where}.content")
            if role in ("system", "developer"):
                b.instruction(text)
            elif role == "user":
                b.user_text(text)
            elif role == "assistant":
                b.assistant_text(text)
            else:
                raise fail(f"{where}.role", f"unknown role {role!r}")
        elif kind == "reasoning":
            b.reasoning(_reasoning_text(item, where, unseal))
        elif kind in _CALL_ITEMS:
            name = item.get("name", "local_shell" if kind == "local_shell_call" else None)
            if not isinstance(name, str) or not name:
                raise fail(f"{where}.name", "must be a non-empty string")
            ns = item.get("namespace")
            name = (ns if isinstance(ns, str) else "") + name
            raw_args = item.get("input") if kind == "custom_tool_call" else item.get("arguments")
            if kind == "local_shell_call":
                raw_args = item.get("action")
            args = arguments_of(raw_args, f"{where}.arguments")
            b.call(ToolCall(name=name, arguments=args, id=_call_id(item, where)))
        elif kind in _OUTPUT_ITEMS:
            b.tool_output(_call_id(item, where), parts_text(item.get("output"), f"{where}.output"))
        elif kind in _SKIPPED_ITEMS:
            continue
        else:
            raise fail(f"{where}.type", f"unsupported input item type {kind!r}")


def parse_responses_request(
    body: Any,
    *,
    max_context: int | None = None,
    unseal: Callable[[str], str | None] = lambda _s: None,
) -> ResponsesRequest:
    """Validate and convert a `/v1/responses` body; `unseal` opens reasoning seals."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise RequestError(f"{key} is not supported; replay full input instead")
    tools = parse_tools(body.get("tools"))
    schemas, choice = offered(tools.schemas, body)

    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise fail("reasoning", "must be an object")
    reasoning = reasoning or {}
    effort, summary = reasoning.get("effort"), reasoning.get("summary")
    controls: dict[str, Any] = {"model": body.get("model")}
    if effort is not None:
        if not isinstance(effort, str):
            raise fail("reasoning.effort", "must be a string")
        controls["reasoning_effort"] = "none" if effort in _NO_THINKING_EFFORTS else effort
    thinking, think_max, _ = thinking_controls(controls, max_context)

    b = Builder()
    instructions = body.get("instructions")
    if instructions is not None:
        b.instruction(parts_text(instructions, "instructions"))
    _input(body.get("input"), b, unseal)

    max_tokens = number(body, "max_output_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise fail("max_output_tokens", "must be >= 1")
    key = body.get("prompt_cache_key")
    req = MessagesRequest(
        conversation=Conversation(b.finish(schemas), thinking=thinking, think_max=think_max),
        model=model_of(body),
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        temperature=number(body, "temperature", float),
        top_p=number(body, "top_p", float),
        tool_choice=choice,
        user_id=key[:256] if isinstance(key, str) and key else None,
    )
    echo = {
        "tools": body.get("tools") if isinstance(body.get("tools"), list) else [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "instructions": instructions if isinstance(instructions, str) else None,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "reasoning": {"effort": effort, "summary": summary},
        "max_output_tokens": max_tokens,
    }
    return ResponsesRequest(
        request=req,
        summary=summary in ("auto", "concise", "detailed"),
        namespaced=tools.namespaced,
        cache_key=req.user_id,
        echo=echo,
    )
