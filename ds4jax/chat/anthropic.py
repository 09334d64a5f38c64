"""Anthropic Messages request bodies → `Conversation` + generation settings.

Pure and protocol-specific: the HTTP shim and the CLI (`ds4jax render`, `count-tokens`)
share it, so what `/v1/messages/count_tokens` counts is what `/v1/messages` prefills.
The body is validated first, in one place, against `bodies.anthropic.MessagesBody` (the
schema `/openapi.json` publishes; bad input raises `RequestError` naming the field's JSON
path); what follows is translation with no checks left in it.

Renderings chosen where the official V4 encoder has nothing (documented in docs/clients.md):

* `system` blocks are joined with `\\n\\n`; a block starting with
  `x-anthropic-billing-header` is dropped (Claude Code changes its nonce every request,
  which would defeat every prefix cache).
* A `system` message inside `messages` becomes the official `latest_reminder` turn.
  Roles `ctx` and `msg` (sent by some Claude Code versions) mean `user`.
* Tools `{name, description, input_schema}` render as `{name, description, parameters}`;
  `tool_choice: none` hides them.
* A tool result with `is_error: true` renders its text prefixed with `Error: `.
* Images and documents without a text source are refused (400) in a user turn: the model
  reads text only, and a client must not believe it saw them. Inside a tool's output they
  render as the official encoder renders unsupported blocks (`[Unsupported image]`,
  `[Unsupported document]`): the tool's output is the agent's, and the model is told. A
  document with a text source (or content blocks) renders as its text.
* `thinking` blocks of an assistant turn are its reasoning (concatenated); a
  `redacted_thinking` block is dropped (its `data` is another model's encrypted reasoning,
  which ds4 ignores too; rendered, it was base64 put before the model as its own thoughts);
  its text blocks are concatenated; `tool_use` blocks are its calls.
* A final assistant turn is a prefill: the model continues it (no EOS), as text — its
  reasoning is closed before it — so the reply has no thinking block whatever `thinking`
  says (`engine.prepare`).
* Thinking is on unless `thinking.type` is `disabled`, the effort is `none`, or the model
  alias `deepseek-chat` is used without an explicit control; `adaptive` means on.
  Effort `max` is Think-Max, granted only when the context is at least
  `THINK_MAX_MIN_CONTEXT` tokens (as ds4 does); other efforts are normal thinking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.bodies.anthropic import (
    AssistantMessage,
    ContentSource,
    CountTokensBody,
    DocumentBlock,
    MessagesBody,
    RedactedThinkingBlock,
    ResultDocument,
    TextBlock,
    TextSource,
    ThinkingBlock,
    ThinkingConfig,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
)
from ds4jax.chat.bodies.common import validate
from ds4jax.chat.bodies.openai import RefusalPart, TextPart
from ds4jax.chat.conversation import Conversation, Message, ToolCall, ToolSchema, UserBlock
from ds4jax.chat.errors import RequestError
from ds4jax.chat.ids import new_tool_id
from ds4jax.chat.turn import ParsedCall, ParsedMessage, ParsedText

__all__ = ["MessagesRequest", "RequestError", "parse_messages_request", "response_content"]

THINK_MAX_MIN_CONTEXT = 393216
_BILLING_PREFIX = "x-anthropic-billing-header"


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
    #: log-probabilities asked for (Chat Completions' `top_logprobs`; None: not asked)
    logprobs: int | None = None
    #: the sampler's seed (Chat Completions' `seed`)
    seed: int | None = None
    #: the body's name for `max_tokens`, for errors about it
    max_tokens_field: str = "max_tokens"


def text_of(content: Any) -> str:
    """A string, null, or validated blocks or parts (of any API) whose text counts, joined
    with `\\n\\n`; a part of another type is the official placeholder, `[Unsupported image]`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n\n".join(_block_text(b) for b in content)


def _block_text(block: Any) -> str:
    if isinstance(block, TextBlock | TextPart):
        return block.text
    if isinstance(block, RefusalPart):
        return block.refusal
    if isinstance(block, DocumentBlock | ResultDocument):
        source = block.source
        if isinstance(source, TextSource):
            return source.data
        if isinstance(source, ContentSource):
            return text_of(source.content)
        return "[Unsupported document]"
    return f"[Unsupported {block.type}]"


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    texts = [b.text for b in system or [] if not b.text.startswith(_BILLING_PREFIX)]
    return "\n\n".join(texts)


def _user_message(content: Any) -> Message:
    if isinstance(content, str):
        return Message("user", blocks=[UserBlock("text", content)])
    blocks: list[UserBlock] = []
    for b in content:
        if isinstance(b, ToolResultBlock):
            text = ("Error: " if b.is_error else "") + text_of(b.content)
            blocks.append(UserBlock("tool_result", text, b.tool_use_id))
        else:
            blocks.append(UserBlock("text", _block_text(b)))
    return Message("user", blocks=blocks)


def _assistant_message(content: Any) -> Message:
    if isinstance(content, str):
        return Message("assistant", content=content)
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for b in content:
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, RedactedThinkingBlock):
            pass  # another model's encrypted reasoning: base64 noise to this one (ds4 too)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(name=b.name, arguments=b.input, id=b.id))
    return Message(
        "assistant",
        content="".join(text),
        reasoning="".join(reasoning) if reasoning else None,
        tool_calls=calls,
    )


def thinking_controls(
    thinking: bool | ThinkingConfig | None,
    effort: str | None,
    model: str | None,
    max_context: int | None,
) -> tuple[bool, bool, int | None]:
    """(thinking on, Think-Max, budget_tokens) from validated controls."""
    on, explicit, budget = True, False, None
    if isinstance(thinking, bool):
        on, explicit = thinking, True
    elif thinking is not None:
        on, explicit = thinking.type != "disabled", True
        budget = thinking.budget_tokens if on else None
    if effort is not None:
        explicit = True
        on = on and effort != "none"
    if not explicit and model == "deepseek-chat":
        on = False
    think_max = on and effort == "max"
    if think_max and max_context is not None and max_context < THINK_MAX_MIN_CONTEXT:
        think_max = False
    return on, think_max, budget


def parse_messages_request(
    body: Any,
    *,
    max_context: int | None = None,
    require_max_tokens: bool = False,
    checked: bool = False,
) -> MessagesRequest:
    """Validate and convert a `/v1/messages` (or `count_tokens`) body.

    `max_context` is the server's context size (it gates Think-Max); None means "as
    requested". `count_tokens` bodies have no `max_tokens`, hence `require_max_tokens`.
    `checked`: `validate`'s."""
    model = MessagesBody if require_max_tokens else CountTokensBody
    return messages_request(validate(model, body, checked=checked), max_context)


def messages_request(b: MessagesBody, max_context: int | None = None) -> MessagesRequest:
    """A validated Messages body as the engine's request."""
    tools = [ToolSchema(name=t.name, description=t.description, parameters=t.input_schema)
             for t in b.tools or []]  # fmt: skip
    choice = b.tool_choice.model_dump(exclude_none=True) if b.tool_choice else None
    if choice is not None and choice["type"] == "none":
        tools = []
    effort = b.output_config.effort if b.output_config else None
    effort = effort if effort is not None else b.reasoning_effort
    thinking, think_max, budget = thinking_controls(b.thinking, effort, b.model, max_context)

    messages: list[Message] = []
    system = _system_text(b.system)
    if system or tools:
        messages.append(Message("system", content=system, tools=tools))
    for m in b.messages:
        if isinstance(m, UserMessage):
            messages.append(_user_message(m.content))
        elif isinstance(m, AssistantMessage):
            messages.append(_assistant_message(m.content))
        else:
            messages.append(Message("latest_reminder", content=text_of(m.content)))
    if messages[-1].role == "assistant":
        messages[-1].prefill = True
    user_id = b.metadata.user_id if b.metadata else None
    return MessagesRequest(
        conversation=Conversation(messages, thinking=thinking, think_max=think_max),
        model=b.model,
        max_tokens=b.max_tokens,
        stream=b.stream,
        stop_sequences=stop_strings(b.stop_sequences),
        temperature=b.temperature,
        top_p=b.top_p,
        top_k=b.top_k,
        tool_choice=choice,
        thinking_budget=budget,
        user_id=user_id[:256] or None if user_id else None,
    )


def stop_strings(stops: str | list[str] | None) -> list[str]:
    """A string or a list of strings, the empty ones dropped."""
    stops = [stops] if isinstance(stops, str) else stops or []
    return [s for s in stops if s]


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
