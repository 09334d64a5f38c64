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

from ds4jax.chat.anthropic import MessagesRequest, text_of, thinking_controls
from ds4jax.chat.bodies.common import validate
from ds4jax.chat.bodies.openai import (
    CallOutputItem,
    CustomToolCallItem,
    FunctionCallItem,
    InputMessage,
    LocalShellCallItem,
    ReasoningItem,
    ResponsesBody,
)
from ds4jax.chat.conversation import Conversation, ToolCall
from ds4jax.chat.openai_items import Builder, arguments_of, offered, tools_of

log = logging.getLogger("ds4jax.serve")

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


def _reasoning_text(item: ReasoningItem, where: str, unseal: Callable[[str], str | None]) -> str:
    if item.encrypted_content:
        text = unseal(item.encrypted_content)
        if text is not None:
            return text
        log.warning("responses: %s.encrypted_content does not authenticate; ignored", where)
    if item.content:
        return text_of(item.content)
    return text_of(item.summary) if item.summary else ""


def _input(raw: str | list[Any], b: Builder, unseal: Callable[[str], str | None]) -> None:
    if isinstance(raw, str):
        b.user_text(raw)
        return
    for i, item in enumerate(raw):
        if isinstance(item, InputMessage):
            text = text_of(item.content)
            if item.role in ("system", "developer"):
                b.instruction(text)
            elif item.role == "user":
                b.user_text(text)
            else:
                b.assistant_text(text)
        elif isinstance(item, ReasoningItem):
            b.reasoning(_reasoning_text(item, f"input[{i}]", unseal))
        elif isinstance(item, FunctionCallItem):
            name, args = (item.namespace or "") + item.name, item.arguments
            b.call(ToolCall(name=name, arguments=arguments_of(args), id=item.the_id))
        elif isinstance(item, CustomToolCallItem):
            b.call(ToolCall(name=item.name, arguments=arguments_of(item.input), id=item.the_id))
        elif isinstance(item, LocalShellCallItem):
            b.call(ToolCall(name=item.name, arguments=item.action or {}, id=item.the_id))
        elif isinstance(item, CallOutputItem):
            b.tool_output(item.the_id, text_of(item.output))


def parse_responses_request(
    body: Any,
    *,
    max_context: int | None = None,
    unseal: Callable[[str], str | None] = lambda _s: None,
    checked: bool = False,
) -> ResponsesRequest:
    """Validate (`bodies.openai.ResponsesBody`) and convert a `/v1/responses` body;
    `unseal` opens reasoning seals; `checked`: `validate`'s."""
    return responses_request(validate(ResponsesBody, body, checked=checked), max_context, unseal)


def responses_request(
    r: ResponsesBody,
    max_context: int | None = None,
    unseal: Callable[[str], str | None] = lambda _s: None,
) -> ResponsesRequest:
    tools = tools_of(r.tools)
    schemas, choice = offered(tools.schemas, r)
    effort = r.reasoning.effort if r.reasoning else None
    summary = r.reasoning.summary if r.reasoning else None
    if effort in _NO_THINKING_EFFORTS:
        effort = "none"
    thinking, think_max, _ = thinking_controls(None, effort, r.model, max_context)

    b = Builder()
    if r.instructions is not None:
        b.instruction(text_of(r.instructions))
    _input(r.input, b, unseal)

    key = r.prompt_cache_key
    req = MessagesRequest(
        conversation=Conversation(b.finish(schemas), thinking=thinking, think_max=think_max),
        model=r.model,
        max_tokens=r.max_output_tokens,
        max_tokens_field="max_output_tokens",
        stream=r.stream,
        temperature=r.temperature,
        top_p=r.top_p,
        tool_choice=choice,
        user_id=key[:256] if key else None,
    )
    dumped = r.model_dump(mode="json", include={"tools", "tool_choice"}, exclude_none=True)
    echo = {
        "tools": dumped.get("tools") or [],
        "tool_choice": dumped.get("tool_choice") or "auto",
        "parallel_tool_calls": r.parallel_tool_calls is not False,
        "instructions": r.instructions if isinstance(r.instructions, str) else None,
        "metadata": r.metadata or {},
        "reasoning": {"effort": r.reasoning.effort if r.reasoning else None,
                      "summary": summary},
        "max_output_tokens": r.max_output_tokens,
    }  # fmt: skip
    return ResponsesRequest(
        request=req,
        summary=summary is not None,
        namespaced=tools.namespaced,
        cache_key=req.user_id,
        echo=echo,
    )
