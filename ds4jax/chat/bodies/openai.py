"""The OpenAI request bodies — Chat Completions (`POST /v1/chat/completions`) and
Responses (`POST /v1/responses`, what Codex CLI sends) — declared once: what
`/openapi.json` publishes and what every request is validated against before any engine
work. `ds4jax.chat.chat_completions` and `ds4jax.chat.responses` translate them.

Refused by name (400), where ignoring would mislead: image, audio and file inputs in a
message, `n` > 1, penalties and `logit_bias` other than neutral, structured output formats,
audio output, unknown tool and item types, Chat's deprecated `functions` / `function_call`
(and an assistant message's `function_call`), `previous_response_id` / `conversation` (the
server keeps no response objects), Responses `top_logprobs`. Accepted and ignored
(documented in docs/clients.md): `metadata` (a string map; Responses echoes it), `store`,
`service_tier`, `user`, `include`, `truncation`, `client_metadata` and any field not
listed. Hosted tools of the Responses API
(`web_search`, `file_search`, …) are left out of the prompt: Codex declares them by default.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from ds4jax.chat.bodies.anthropic import Effort, Thinking
from ds4jax.chat.bodies.common import (
    BAD_TAG,
    NO_TOOL_TO_FORCE,
    Body,
    Int,
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
    unknown,
)
from ds4jax.chat.errors import RequestError, field_error

#: the text-bearing part types of either API (a `refusal` part's text is its `refusal`)
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class TextPart(Body):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str


class RefusalPart(Body):
    type: Literal["refusal"]
    refusal: str


_TEXT = {kind: TextPart for kind in TEXT_PARTS} | {"refusal": RefusalPart}
_MEDIA = {
    kind: refused(f"{kind} input")
    for kind in ("image_url", "input_image", "input_audio", "input_file", "file")
}
#: a message's own parts: text; media refused
Part = typed(_TEXT | _MEDIA, "must be a text content part")
#: a tool's output: text; anything else is the official placeholder (`[Unsupported x]`)
OutputPart = typed(_TEXT, "must be a content part with a type", other=Other)


def _json_or_object(value: Any) -> str | None:
    return "json" if isinstance(value, str) else "object" if isinstance(value, dict) else None


#: call arguments: a JSON string (as the APIs send them) or an object
Arguments = either(
    _json_or_object, {"json": str, "object": dict[str, Any]}, "must be a JSON string"
)
Schema = dict[str, Any]
MessageContent = text_or(Part, "must be a string or a list of content parts")
OutputContent = text_or(OutputPart, "must be a string or a list of content parts")


class Named(Body):
    name: str


class FunctionChoice(Body):
    """`{"type": "function", "name": …}` (Responses) or `{…, "function": {"name": …}}` (Chat)."""

    type: Literal["function"]
    name: str | None = None
    function: Named | None = None

    @property
    def tool(self) -> str | None:
        return self.function.name if self.function is not None else self.name


class ModeChoice(Body):
    type: Literal["auto", "none", "required"]


def _choice_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "mode"
    kind = value.get("type") if isinstance(value, dict) else None
    return "function" if kind == "function" else "object" if isinstance(kind, str) else None


ToolChoice = either(
    _choice_kind,
    {"mode": Literal["none", "auto", "required"], "function": FunctionChoice,
     "object": ModeChoice},
    "must be none, auto, required or a function",
)  # fmt: skip


class Sampling(Body):
    """What both OpenAI APIs share."""

    model: str = "deepseek-v4-flash"
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tool_choice: ToolChoice | None = None  # type: ignore[valid-type]
    parallel_tool_calls: bool | None = None
    #: a routing tie-break (Codex: the thread id), like Anthropic's `metadata.user_id`
    prompt_cache_key: str | None = None
    #: OpenAI's string map, echoed by Responses (so checked: a NaN or a list echoed back
    #: is a reply the client cannot read)
    metadata: dict[str, str] | None = None

    def _named_tool(self, names: set[str]) -> None:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice) and choice.tool is None:
            raise field_error("tool_choice", "a function choice names its tool")
        if isinstance(choice, FunctionChoice) and choice.tool not in names:
            raise field_error("tool_choice.name", f"no tool named {choice.tool!r}")
        required = choice == "required" or getattr(choice, "type", None) == "required"
        if required and not names:
            raise field_error("tool_choice", NO_TOOL_TO_FORCE)


# ---------------------------------------------------------------------- Chat Completions


class FunctionCall(Body):
    name: NonEmpty
    arguments: Arguments | None = None  # type: ignore[valid-type]


class ToolCallParam(Body):
    id: NonEmpty
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatInstruction(Body):
    role: Literal["system", "developer"]
    content: MessageContent  # type: ignore[valid-type]


class ChatUser(Body):
    role: Literal["user"]
    content: MessageContent  # type: ignore[valid-type]


class ChatAssistant(Body):
    role: Literal["assistant"]
    content: MessageContent | None = None  # type: ignore[valid-type]
    #: DeepSeek's field for the turn's reasoning
    reasoning_content: str | None = None
    tool_calls: list[ToolCallParam] | None = None


class ChatToolOutput(Body):
    role: Literal["tool", "function"]
    tool_call_id: NonEmpty
    content: OutputContent  # type: ignore[valid-type]


def _chat_role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else None
    if not isinstance(role, str):  # a list or an object: no role (a 400 naming it)
        return None
    return {"developer": "system", "function": "tool"}.get(role, role)


ChatMessage = either(
    _chat_role,
    {"system": ChatInstruction, "user": ChatUser, "assistant": ChatAssistant,
     "tool": ChatToolOutput},
    "must be a message with role system, developer, user, assistant or tool",
    field="role",
)  # fmt: skip


class FunctionDef(Body):
    name: ToolName
    description: str | None = None
    parameters: Schema | None = None
    strict: bool | None = None


class ChatTool(Body):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(Body):
    include_usage: bool | None = None


class ResponseFormat(Body):
    type: Literal["text"]


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class ChatBody(Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)  # type: ignore[valid-type]
    tools: list[typed({"function": ChatTool}, "must be a tool of type function")] | None = None  # type: ignore[valid-type]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: Strings | None = None  # type: ignore[valid-type]
    stream_options: StreamOptions | None = None
    #: not an OpenAI field (vLLM's, ds4's): the sampler's top-k
    top_k: TopK | None = None
    seed: Int | None = None
    n: Literal[1] | None = None
    logprobs: bool | None = None
    top_logprobs: integer(ge=0, le=20) | None = None  # type: ignore[valid-type]
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[Literal["text"]] | None = None
    user: str | None = None
    thinking: Thinking | None = None  # type: ignore[valid-type]
    reasoning_effort: Effort | None = None
    #: ds4's boolean thinking switch
    think: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, value: Any) -> Any:
        """The deprecated `functions` / `function_call` are refused by name: ignored, the
        model would never see the tools the client declared."""
        if not isinstance(value, dict):
            return value
        legacy = [("functions", "tools", value), ("function_call", "tool_choice", value)]
        messages = value.get("messages")
        for i, m in enumerate(messages if isinstance(messages, list) else []):
            legacy.append((f"messages[{i}].function_call", "tool_calls", m))
        for where, now, holder in legacy:
            key = where.rsplit(".", 1)[-1]
            if isinstance(holder, dict) and holder.get(key) is not None:
                raise field_error(where, "").with_message(
                    f"{where} (deprecated) is not supported; send {now} instead"
                )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatBody:
        names = unique_names((f"tools[{i}].function.name", t.function.name)
                             for i, t in enumerate(self.tools or []))  # fmt: skip
        self._named_tool(names)
        if all(isinstance(m, ChatInstruction) for m in self.messages):
            raise RequestError("messages: the conversation has no user or assistant turn",
                               param="messages")  # fmt: skip
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key):
                raise field_error(key, "is not supported (only 0)")
        if self.logit_bias:
            raise field_error("logit_bias", "is not supported (only {})")
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "is only allowed with stream: true")
        for key in ("audio", "web_search_options"):
            if (self.model_extra or {}).get(key) is not None:
                raise field_error(key, "is not supported")
        return self


# ---------------------------------------------------------------------- Responses


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent  # type: ignore[valid-type]


class ReasoningItem(Body):
    """Rendered as its turn's reasoning: the text its seal carries when the seal opens, else
    its `content`, else its `summary`."""

    type: Literal["reasoning"]
    encrypted_content: str | None = None
    content: list[OutputPart] | None = None  # type: ignore[valid-type]
    summary: list[OutputPart] | None = None  # type: ignore[valid-type]


class _Call(Body):
    call_id: NonEmpty | None = None
    id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _has_id(cls, value: Any) -> Any:
        if isinstance(value, dict) and not (value.get("call_id") or value.get("id")):
            raise PydanticCustomError(BAD_TAG + "call_id", "must be a non-empty string")
        return value

    @property
    def the_id(self) -> str:
        return self.call_id or self.id or ""


class FunctionCallItem(_Call):
    type: Literal["function_call"]
    name: NonEmpty
    arguments: Arguments | None = None  # type: ignore[valid-type]
    #: Codex's namespaced tools: the call's name is `namespace + name` in the prompt
    namespace: str | None = None


class CustomToolCallItem(_Call):
    type: Literal["custom_tool_call"]
    name: NonEmpty
    input: Arguments | None = None  # type: ignore[valid-type]


class LocalShellCallItem(_Call):
    type: Literal["local_shell_call"]
    name: NonEmpty = "local_shell"
    action: dict[str, Any] | None = None


class CallOutputItem(_Call):
    type: Literal["function_call_output", "custom_tool_call_output", "local_shell_call_output"]
    output: OutputContent | None = None  # type: ignore[valid-type]


class SkippedItem(Body):
    """Hosted tools' work or client-side compaction: nothing to render."""

    type: Literal["web_search_call", "file_search_call", "compaction", "context_compaction"]


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message" if "role" in value else None)
    return kind if isinstance(kind, str) else None


_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
_SKIPPED = ("web_search_call", "file_search_call", "compaction", "context_compaction")
Item = either(
    _item_kind,
    {"message": InputMessage, "reasoning": ReasoningItem, "function_call": FunctionCallItem,
     "custom_tool_call": CustomToolCallItem, "local_shell_call": LocalShellCallItem,
     **{k: CallOutputItem for k in _OUTPUTS}, **{k: SkippedItem for k in _SKIPPED}},
    "must be an input item object",
    other=unknown("input item type"),
    field="type",
)  # fmt: skip


class ResponsesFunction(FunctionDef):
    """Responses declares a function flat: `{"type": "function", "name": …}`."""

    type: Literal["function"]


class Namespace(Body):
    """Codex's tool namespace: its functions' names are `name + function name`."""

    type: Literal["namespace"]
    name: ToolName
    tools: list[typed({"function": ResponsesFunction}, "must be a tool", other=Other)]  # type: ignore[valid-type]


#: built-in tools the server cannot run: left out of the prompt (Codex sends `web_search`)
HOSTED_TOOLS = (
    "web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
    "computer_use_preview", "mcp", "local_shell", "custom",
)  # fmt: skip


class HostedTool(Body):
    type: str


ResponsesTool = typed(
    {"function": ResponsesFunction, "namespace": Namespace}
    | {kind: HostedTool for kind in HOSTED_TOOLS},
    "must be a tool of type function, namespace or a hosted tool",
    default="function",
    other=unknown("tool type"),
)


class Reasoning(Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(Body):
    type: Literal["text"]


class TextOptions(Body):
    format: TextFormat | None = None


def _input_kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "items" if isinstance(value, list) else None


class ResponsesBody(Sampling):
    """`POST /v1/responses`."""

    input: either(  # type: ignore[valid-type]
        _input_kind,
        {"text": str, "items": Annotated[list[Item], Field(min_length=1)]},  # type: ignore[valid-type]
        "must be a string or a list of input items",
    )
    instructions: MessageContent | None = None  # type: ignore[valid-type]
    tools: list[ResponsesTool] | None = None  # type: ignore[valid-type]
    reasoning: Reasoning | None = None
    max_output_tokens: MaxTokens | None = None
    text: TextOptions | None = None
    previous_response_id: None = None
    conversation: None = None
    top_logprobs: Literal[0] | None = None

    @model_validator(mode="before")
    @classmethod
    def _replayed(cls, value: Any) -> Any:
        for key in ("previous_response_id", "conversation"):
            if isinstance(value, dict) and value.get(key) is not None:
                raise field_error(key, "").with_message(
                    f"{key} is not supported; replay full input instead"
                )
        return value

    def _functions(self) -> Iterator[tuple[str, str]]:
        """(JSON path of its name, the name the prompt gives it) of each function tool."""
        for i, tool in enumerate(self.tools or []):
            if isinstance(tool, ResponsesFunction):
                yield f"tools[{i}].name", tool.name
            elif isinstance(tool, Namespace):
                for j, fn in enumerate(tool.tools):
                    if isinstance(fn, ResponsesFunction):
                        yield f"tools[{i}].tools[{j}].name", tool.name + fn.name

    @model_validator(mode="after")
    def _names(self) -> ResponsesBody:
        names = unique_names(self._functions())
        self._named_tool(names)
        items = [] if isinstance(self.input, str) else self.input
        if items and all(
            isinstance(i, SkippedItem)
            or (isinstance(i, InputMessage) and i.role in ("system", "developer"))
            for i in items
        ):
            raise RequestError("input: the conversation has no user or assistant turn",
                               param="input")  # fmt: skip
        return self
