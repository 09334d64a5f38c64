"""The protocol-neutral conversation the renderer consumes.

Anthropic requests (and, later, other protocols) are converted into this shape first, so the
prompt format is written once. It mirrors the message model of DeepSeek's official V4
encoder (`encoding_dsv4.py`): system / developer / user / assistant / latest_reminder roles,
user turns as ordered blocks (text and tool results), assistant turns as reasoning + content
+ tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "developer", "user", "assistant", "latest_reminder"]


@dataclass(frozen=True)
class ToolSchema:
    """A tool as the official tools block shows it: `{name, description, parameters}`."""

    name: str
    parameters: Any
    description: str | None = None

    def as_official(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return out


@dataclass(frozen=True)
class ToolCall:
    name: str
    #: A JSON object in the client's key order; anything else renders as one `arguments`
    #: string parameter, as the official encoder does for unparsable arguments.
    arguments: Any
    id: str | None = None


@dataclass(frozen=True)
class UserBlock:
    kind: Literal["text", "tool_result"]
    text: str
    tool_use_id: str | None = None


@dataclass
class Message:
    role: Role
    #: system / developer / latest_reminder / assistant text. User turns use `blocks`.
    content: str = ""
    blocks: list[UserBlock] = field(default_factory=list)
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    #: Only on a system (or developer) message: the tools block is appended to it.
    tools: list[ToolSchema] = field(default_factory=list)
    #: An assistant turn the model should continue (Anthropic "prefill"): rendered
    #: without its closing EOS, as the official encoder's `wo_eos`.
    prefill: bool = False
    #: The exact DSML block the model sampled for these calls (tool memory), rendered
    #: instead of the canonical form of `tool_calls`.
    raw_tool_calls: str | None = None


@dataclass
class Conversation:
    messages: list[Message]
    thinking: bool = True
    #: Think-Max: prepends the official "Reasoning Effort: Absolute maximum…" text.
    think_max: bool = False

    @property
    def tool_use_ids(self) -> list[str]:
        return [c.id for m in self.messages for c in m.tool_calls if c.id]
