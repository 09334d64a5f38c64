"""Anthropic Messages request bodies → `Conversation` + generation settings.

Pure and protocol-specific: the HTTP shim and the CLI (`ds4jax render`, `count-tokens`)
share it, so what `/v1/messages/count_tokens` counts is what `/v1/messages` prefills.
Bad input raises `RequestError`, which carries the Anthropic error type and status.

Renderings chosen where the official V4 encoder has nothing (documented in the README):

* `system` blocks are joined with `\\n\\n`; a block starting with
  `x-anthropic-billing-header` is dropped (Claude Code changes its nonce every request,
  which would defeat every prefix cache).
* A `system` message inside `messages` becomes the official `latest_reminder` turn.
  Roles `ctx` and `msg` (sent by some Claude Code versions) mean `user`.
* Tools `{name, description, input_schema}` render as `{name, description, parameters}`;
  `tool_choice: none` hides them.
* A tool result with `is_error: true` renders its text prefixed with `Error: `.
* Images, and documents without a text source, render as the official encoder renders
  unsupported blocks: `[Unsupported image]`, `[Unsupported document]`. A document with a
  text source (or content blocks) renders as its text.
* `thinking` / `redacted_thinking` blocks of an assistant turn are its reasoning
  (concatenated); its text blocks are concatenated; `tool_use` blocks are its calls.
* A final assistant turn is a prefill: the model continues it (no EOS).
* Thinking is on unless `thinking.type` is `disabled`, the effort is `none`, or the model
  alias `deepseek-chat` is used without an explicit control; `adaptive` means on.
  Effort `max` is Think-Max, granted only when the context is at least
  `THINK_MAX_MIN_CONTEXT` tokens (as ds4 does); other efforts are normal thinking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.conversation import Conversation, Message, ToolCall, ToolSchema, UserBlock
from ds4jax.chat.dsml_parse import ParsedCall, ParsedMessage, ParsedText
from ds4jax.continuation.tool_memory import new_tool_id

THINK_MAX_MIN_CONTEXT = 393216
_EFFORTS = {"max", "xhigh", "high", "medium", "low", "minimal", "none"}
_TOOL_CHOICES = {"auto", "any", "tool", "none"}
_BILLING_PREFIX = "x-anthropic-billing-header"


class RequestError(ValueError):
    """A client error, reported as `{"type":"error","error":{"type":…,"message":…}}`."""

    def __init__(
        self, message: str, *, status: int = 400, error_type: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}


@dataclass
class MessagesRequest:
    conversation: Conversation
    model: str
    max_tokens: int | None
    stream: bool = False
    stop_sequences: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tool_choice: dict[str, Any] | None = None
    thinking_budget: int | None = None
    #: `metadata.user_id` (Claude Code sends one per user and session): a routing tie-break
    user_id: str | None = None


def _fail(where: str, what: str) -> RequestError:
    return RequestError(f"{where}: {what}")


def _text_of_blocks(blocks: Any, where: str, *, unsupported_ok: bool = True) -> str:
    """A string, or a list of blocks of which text blocks count, joined with `\\n\\n`."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _fail(where, "must be a string or a list of content blocks")
    parts: list[str] = []
    for i, b in enumerate(blocks):
        if isinstance(b, str):
            parts.append(b)
            continue
        if not isinstance(b, dict):
            raise _fail(f"{where}[{i}]", "must be a content block object")
        parts.append(_block_text(b, f"{where}[{i}]"))
    return "\n\n".join(parts)


def _block_text(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if kind == "text":
        text = block.get("text", "")
        if not isinstance(text, str):
            raise _fail(f"{where}.text", "must be a string")
        return text
    if kind == "document":
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") == "text":
            data = source.get("data", "")
            if isinstance(data, str):
                return data
        if isinstance(source, dict) and source.get("type") == "content":
            return _text_of_blocks(source.get("content"), f"{where}.source.content")
        return "[Unsupported document]"
    if not isinstance(kind, str):
        raise _fail(f"{where}.type", "missing")
    return f"[Unsupported {kind}]"


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise _fail("system", "must be a string or a list of text blocks")
    parts: list[str] = []
    for i, b in enumerate(system):
        text = b if isinstance(b, str) else None
        if isinstance(b, dict):
            if b.get("type", "text") != "text":
                raise _fail(f"system[{i}]", "only text blocks are supported")
            text = b.get("text")
        if not isinstance(text, str):
            raise _fail(f"system[{i}]", "must be a text block")
        if text.startswith(_BILLING_PREFIX):
            continue
        parts.append(text)
    return "\n\n".join(parts)


def _tools(tools: Any) -> list[ToolSchema]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _fail("tools", "must be a list")
    out: list[ToolSchema] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _fail(f"tools[{i}]", "must be an object")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(f"tools[{i}].name", "must be a non-empty string")
        if name in seen:
            raise _fail(f"tools[{i}].name", f"duplicate tool name {name!r}")
        seen.add(name)
        if t.get("type", "custom") != "custom" and "input_schema" not in t:
            raise _fail(f"tools[{i}]", f"server tool type {t.get('type')!r} is not supported")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _fail(f"tools[{i}].input_schema", "must be a JSON schema object")
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _fail(f"tools[{i}].description", "must be a string")
        out.append(ToolSchema(name=name, description=desc, parameters=schema))
    return out


def _tool_choice(choice: Any, tools: list[ToolSchema]) -> dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(kind, str) or kind not in _TOOL_CHOICES:
        raise _fail("tool_choice", "must be an object with type auto, any, tool or none")
    name = choice.get("name")
    if kind == "tool" and (not isinstance(name, str) or name not in {t.name for t in tools}):
        raise _fail("tool_choice.name", f"no tool named {name!r}")
    dpt = choice.get("disable_parallel_tool_use")
    if dpt is not None and not isinstance(dpt, bool):
        raise _fail("tool_choice.disable_parallel_tool_use", "must be a boolean")
    return choice


def _user_message(content: Any, where: str) -> Message:
    if isinstance(content, str):
        return Message("user", blocks=[UserBlock("text", content)])
    if not isinstance(content, list):
        raise _fail(where, "must be a string or a list of content blocks")
    blocks: list[UserBlock] = []
    for i, b in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(b, dict):
            raise _fail(at, "must be a content block object")
        if b.get("type") == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise _fail(f"{at}.tool_use_id", "must be a non-empty string")
            text = _text_of_blocks(b.get("content"), f"{at}.content")
            if b.get("is_error"):
                text = "Error: " + text
            blocks.append(UserBlock("tool_result", text, tid))
        else:
            blocks.append(UserBlock("text", _block_text(b, at)))
    return Message("user", blocks=blocks)


def _assistant_message(content: Any, where: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content=content)
    if not isinstance(content, list):
        raise _fail(where, "must be a string or a list of content blocks")
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for i, b in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(b, dict):
            raise _fail(at, "must be a content block object")
        kind = b.get("type")
        if kind == "text":
            text.append(_block_text(b, at))
        elif kind in ("thinking", "redacted_thinking"):
            value = b.get("thinking" if kind == "thinking" else "data", "")
            if not isinstance(value, str):
                raise _fail(at, f"{kind} content must be a string")
            reasoning.append(value)
        elif kind == "tool_use":
            tid, name = b.get("id"), b.get("name")
            if not isinstance(tid, str) or not tid:
                raise _fail(f"{at}.id", "must be a non-empty string")
            if not isinstance(name, str) or not name:
                raise _fail(f"{at}.name", "must be a non-empty string")
            calls.append(ToolCall(name=name, arguments=b.get("input", {}), id=tid))
        else:
            raise _fail(f"{at}.type", f"unsupported assistant content block {kind!r}")
    return Message(
        "assistant",
        content="".join(text),
        reasoning="".join(reasoning) if reasoning else None,
        tool_calls=calls,
    )


def thinking_controls(
    body: dict[str, Any], max_context: int | None
) -> tuple[bool, bool, int | None]:
    """(thinking on, Think-Max, budget_tokens)."""
    thinking, explicit, budget = True, False, None
    control = body.get("thinking")
    if isinstance(control, bool):
        thinking, explicit = control, True
    elif isinstance(control, dict):
        kind = control.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _fail("thinking.type", "must be enabled, disabled or adaptive")
        thinking, explicit = kind != "disabled", True
        if thinking and control.get("budget_tokens") is not None:
            budget = control["budget_tokens"]
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise _fail("thinking.budget_tokens", "must be a non-negative integer")
    elif control is not None:
        raise _fail("thinking", "must be an object")
    effort = None
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("effort") is not None:
        effort = config["effort"]
    elif body.get("reasoning_effort") is not None:
        effort = body["reasoning_effort"]
    if effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORTS:
            raise _fail("output_config.effort", f"unknown effort {effort!r}")
        explicit = True
        if effort == "none":
            thinking = False
    if not explicit:
        model = body.get("model")
        if model == "deepseek-chat":
            thinking = False
    think_max = thinking and effort == "max"
    if think_max and max_context is not None and max_context < THINK_MAX_MIN_CONTEXT:
        think_max = False
    return thinking, think_max, budget


_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, None),
    "max_tokens": (None, None),
}


def number(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float) if kind is float else int)
    if not ok or isinstance(value, bool):
        raise _fail(key, f"must be a{'n integer' if kind is int else ' number'}")
    if kind is float:
        try:
            value = float(value)
        except OverflowError as err:
            raise _fail(key, "is out of range") from err
        if not math.isfinite(value):
            raise _fail(key, "must be finite")
    lo, hi = _RANGES.get(key, (None, None))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _fail(key, f"must be between {lo} and {hi}" if hi is not None else f"must be >= {lo}")
    return value


def parse_messages_request(
    body: Any, *, max_context: int | None = None, require_max_tokens: bool = False
) -> MessagesRequest:
    """Validate and convert a `/v1/messages` (or `count_tokens`) body.

    `max_context` is the server's context size (it gates Think-Max); None means "as
    requested". `count_tokens` bodies have no `max_tokens`, hence `require_max_tokens`."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _fail("messages", "must be a non-empty list")
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if tool_choice is not None and tool_choice["type"] == "none":
        tools = []
    thinking, think_max, budget = thinking_controls(body, max_context)

    messages: list[Message] = []
    system = _system_text(body.get("system"))
    if system or tools:
        messages.append(Message("system", content=system, tools=tools))
    for i, m in enumerate(raw_messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _fail(where, "must be an object")
        role = m.get("role")
        content = m.get("content", "")
        if role in ("user", "ctx", "msg"):
            messages.append(_user_message(content, f"{where}.content"))
        elif role == "assistant":
            messages.append(_assistant_message(content, f"{where}.content"))
        elif role == "system":
            text = _text_of_blocks(content, f"{where}.content")
            messages.append(Message("latest_reminder", content=text))
        else:
            raise _fail(f"{where}.role", f"unknown role {role!r}")
    if messages[-1].role == "assistant":
        messages[-1].prefill = True

    max_tokens = number(body, "max_tokens", int)
    if max_tokens is None and require_max_tokens:
        raise _fail("max_tokens", "is required")
    if max_tokens is not None and max_tokens < 0:
        raise _fail("max_tokens", "must be >= 0")
    stops = stop_strings(body, "stop_sequences")
    model = model_of(body)
    return MessagesRequest(
        conversation=Conversation(messages, thinking=thinking, think_max=think_max),
        model=model,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        stop_sequences=stops,
        temperature=number(body, "temperature", float),
        top_p=number(body, "top_p", float),
        top_k=number(body, "top_k", int),
        tool_choice=tool_choice,
        thinking_budget=budget,
        user_id=_user_id(body.get("metadata")),
    )


def stop_strings(body: dict[str, Any], key: str) -> list[str]:
    """A string or a list of strings (the empty ones dropped)."""
    stops = body.get(key) or []
    if isinstance(stops, str):
        stops = [stops]
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _fail(key, "must be a string or a list of strings")
    return [s for s in stops if s]


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model", "deepseek-v4-flash")
    if not isinstance(model, str):
        raise _fail("model", "must be a string")
    return model


def _user_id(metadata: Any) -> str | None:
    """`metadata` is accepted and otherwise ignored; a string `user_id` is kept as a hint."""
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        return metadata["user_id"][:256] or None
    return None


def response_content(
    message: ParsedMessage, tool_ids: Sequence[str], signature: str = ""
) -> list[dict[str, Any]]:
    """The Anthropic content blocks of a sampled assistant turn, in sampled order: what the
    server returns, and so what a client sends back in its next request. Calls beyond
    `tool_ids` (an incomplete turn) get fresh ids."""
    content: list[dict[str, Any]] = []
    if message.reasoning:
        content.append({"type": "thinking", "thinking": message.reasoning, "signature": signature})
    ids = iter(tool_ids)
    for block in message.blocks:
        if isinstance(block, ParsedText):
            if block.text:
                content.append({"type": "text", "text": block.text})
        elif isinstance(block, ParsedCall):
            tid = next(ids, None) or new_tool_id()
            content.append(
                {"type": "tool_use", "id": tid, "name": block.name, "input": block.arguments}
            )
    return content
