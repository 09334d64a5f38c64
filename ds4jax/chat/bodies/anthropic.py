"""The Anthropic Messages request body (`POST /v1/messages`, `…/count_tokens`), declared
once: what `/openapi.json` publishes and what every request is validated against before any
engine work. `ds4jax.chat.anthropic` turns a validated body into the engine's request.

Refused by name (400): images, binary documents (PDF) and unknown block types in a user
turn, server tools, unknown tool_choice or thinking types. Accepted and ignored: `metadata`
beyond `user_id`, `service_tier`, `container`, `cache_control` and any field not listed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from ds4jax.chat.bodies.common import (
    NO_TOOL_TO_FORCE,
    Body,
    MaxTokens,
    NonEmpty,
    Other,
    Strings,
    Temperature,
    ToolName,
    TopK,
    TopP,
    either,
    integer,
    refused,
    text_or,
    typed,
    unique_names,
)
from ds4jax.chat.errors import field_error

Effort = Literal["max", "xhigh", "high", "medium", "low", "minimal", "none"]


class TextBlock(Body):
    type: Literal["text"]
    text: str


TextContent = typed({"text": TextBlock}, "must be a text block")


class TextSource(Body):
    type: Literal["text"]
    data: str = ""


class ContentSource(Body):
    type: Literal["content"]
    content: text_or(TextContent, "must be a string or a list of text blocks")  # type: ignore[valid-type]


class DocumentBlock(Body):
    """A document whose source is text (or text blocks): it renders as that text."""

    type: Literal["document"]
    source: typed({"text": TextSource, "content": ContentSource}, "must be a text source")  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        source = value.get("source") if isinstance(value, dict) else None
        if isinstance(value, dict) and not isinstance(source, dict):
            raise PydanticCustomError(
                "source",
                'a document needs a source object ({"type": "text", …}), not {got}',
                {"got": "nothing" if source is None else type(source).__name__},
            )
        kind = source.get("type") if isinstance(source, dict) else None
        if kind not in ("text", "content"):
            raise PydanticCustomError(
                "unsupported",
                "a document with a {kind} source is not supported: DeepSeek V4 reads text "
                "only (send its text as a text source)",
                {"kind": repr(kind)},
            )
        return value


class ResultDocument(Body):
    """A document in a tool's output: its text when it has a text source, else the
    official `[Unsupported document]` placeholder."""

    type: Literal["document"]
    source: typed({"text": TextSource, "content": ContentSource}, "must be an object",
        other=Other,
    ) = None  # type: ignore[valid-type]  # fmt: skip


#: what a tool's output may hold: text, documents, and anything else as a placeholder
ResultPart = typed({"text": TextBlock, "document": ResultDocument}, "must be a content block",
    other=Other,
)  # fmt: skip


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    #: a string, or blocks of which text (and text documents) count; an image or other part
    #: of a tool's output renders as the official `[Unsupported image]` placeholder
    content: text_or(ResultPart, "must be a string or a list of content blocks") | None = None  # type: ignore[valid-type]
    is_error: bool | None = None


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any] = Field(default_factory=dict)


UserBlock = typed(
    {
        "text": TextBlock,
        "document": DocumentBlock,
        "tool_result": ToolResultBlock,
        "image": refused("image input"),
    },
    "must be a content block of type text, document or tool_result",
)
AssistantBlock = typed(
    {
        "text": TextBlock,
        "thinking": ThinkingBlock,
        "redacted_thinking": RedactedThinkingBlock,
        "tool_use": ToolUseBlock,
    },
    "must be an assistant content block of type text, thinking, redacted_thinking or tool_use",
)


class UserMessage(Body):
    #: `ctx` and `msg` (sent by some Claude Code versions) mean `user`
    role: Literal["user", "ctx", "msg"]
    content: text_or(UserBlock, "must be a string or a list of content blocks")  # type: ignore[valid-type]


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: text_or(AssistantBlock, "must be a string or a list of content blocks")  # type: ignore[valid-type]


class SystemMessage(Body):
    """A system message inside `messages`: the official `latest_reminder` turn."""

    role: Literal["system"]
    content: text_or(TextContent, "must be a string or a list of text blocks")  # type: ignore[valid-type]


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else None
    return {"ctx": "user", "msg": "user"}.get(role, role) if isinstance(role, str) else None


Message = either(
    _role,
    {"user": UserMessage, "assistant": AssistantMessage, "system": SystemMessage},
    "must be a message object with role user, assistant or system",
    field="role",
)


class Tool(Body):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise PydanticCustomError(
                "unsupported",
                "server tool type {kind} is not supported: declare it as a client tool with "
                "an input_schema",
                {"kind": repr(kind)},
            )
        return value


class ToolChoiceAuto(Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Body):
    type: Literal["none"]


class ToolChoiceTool(Body):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


ToolChoice = typed({"auto": ToolChoiceAuto, "any": ToolChoiceAny, "none": ToolChoiceNone,
     "tool": ToolChoiceTool},
    "must be an object with type auto, any, tool or none",
)  # fmt: skip


class ThinkingConfig(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: integer(ge=0) | None = None  # type: ignore[valid-type]


class OutputConfig(Body):
    effort: Effort | None = None


class Metadata(Body):
    #: kept as a routing tie-break (Claude Code sends one per user and session)
    user_id: str | None = None


def _flag_or_object(value: Any) -> str | None:
    return "flag" if isinstance(value, bool) else "config" if isinstance(value, dict) else None


Thinking = either(
    _flag_or_object, {"flag": bool, "config": ThinkingConfig},
    "must be an object with type enabled, disabled or adaptive",
)  # fmt: skip


class MessagesBody(Body):
    """`POST /v1/messages`."""

    model: str = "deepseek-v4-flash"
    messages: list[Message] = Field(min_length=1)  # type: ignore[valid-type]
    system: text_or(TextContent, "must be a string or a list of text blocks") | None = None  # type: ignore[valid-type]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # type: ignore[valid-type]
    thinking: Thinking | None = None  # type: ignore[valid-type]
    output_config: OutputConfig | None = None
    #: ds4's spelling of `output_config.effort`
    reasoning_effort: Effort | None = None
    max_tokens: MaxTokens
    stream: bool = False
    stop_sequences: Strings | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _names(self) -> MessagesBody:
        seen = unique_names((f"tools[{i}].name", t.name) for i, t in enumerate(self.tools or []))
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceTool) and choice.name not in seen:
            raise field_error("tool_choice.name", f"no tool named {choice.name!r}")
        if isinstance(choice, ToolChoiceAny) and not seen:
            raise field_error("tool_choice", NO_TOOL_TO_FORCE)
        return self


class CountTokensBody(MessagesBody):
    """`POST /v1/messages/count_tokens`: what `/v1/messages` takes, `max_tokens` optional
    (the sampling fields are accepted and play no part in the count)."""

    max_tokens: MaxTokens | None = None  # type: ignore[assignment]
