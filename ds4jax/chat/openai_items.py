"""What the OpenAI protocols (Responses, Chat Completions) share on the way in: the tools
they declare, the text of their content parts, and the assembly of a flat item list into
the `Conversation` every protocol becomes.

Renderings chosen to match the Anthropic side (docs/clients.md, the OpenAI protocols):

* `system` / `developer` messages before the first user or assistant turn join the system
  prompt (after `instructions`) with `\\n\\n`; later ones become the official
  `latest_reminder` turn, as an Anthropic `system` message inside `messages` does.
* Images, audio and files in a message are refused (400, `bodies.openai`); in a tool's
  output they render as the official encoder renders unsupported blocks:
  `[Unsupported input_image]`.
* Consecutive assistant items (reasoning, text, calls) are one assistant turn; a reasoning
  item, or text after calls, opens the next one. Tool outputs are tool_result blocks of the
  user turn that follows, as in V4.
* Function tools render as `{name, description, parameters}`. A Responses `namespace`
  is flattened (`namespace + name`, ds4's rule) and restored on output. Hosted tools
  (`web_search`, `file_search`, …) the server cannot run are left out of the prompt; tool
  types nobody defined are refused.

The bodies arrive validated (`bodies.openai`): this is translation, with no checks in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.bodies.openai import (
    ChatTool,
    FunctionChoice,
    ModeChoice,
    Namespace,
    ResponsesFunction,
    Sampling,
)
from ds4jax.chat.conversation import Message, ToolCall, ToolSchema, UserBlock


def arguments_of(raw: str | dict[str, Any] | None) -> Any:
    """Call arguments as sent: a JSON string (decoded when it is an object, else kept as the
    one string parameter the official encoder falls back to) or an object."""
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class Tools:
    schemas: list[ToolSchema] = field(default_factory=list)
    #: flattened name → (namespace, name): Responses output names a call by both
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, name: str, description: str | None, parameters: Any, namespace: str = "") -> None:
        if namespace:
            self.namespaced[namespace + name] = (namespace, name)
        params = _EMPTY_PARAMETERS if parameters is None else parameters
        self.schemas.append(
            ToolSchema(name=namespace + name, description=description, parameters=params)
        )


@dataclass
class Builder:
    """Turns protocol items, in order, into the conversation's messages."""

    system: list[str] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    _turn: Message | None = None  # the assistant turn being assembled

    def instruction(self, text: str) -> None:
        self._close()
        if self.messages:
            self.messages.append(Message("latest_reminder", content=text))
        elif text:
            self.system.append(text)

    def user_text(self, text: str) -> None:
        self._close()
        self.messages.append(Message("user", blocks=[UserBlock("text", text)]))

    def tool_output(self, call_id: str, text: str) -> None:
        self._close()
        self.messages.append(Message("user", blocks=[UserBlock("tool_result", text, call_id)]))

    def reasoning(self, text: str) -> None:
        turn = self._open(fresh=self._turn is not None)
        turn.reasoning = (turn.reasoning or "") + text

    def assistant_text(self, text: str) -> None:
        turn = self._open(fresh=self._turn is not None and bool(self._turn.tool_calls))
        turn.content += text

    def call(self, call: ToolCall) -> None:
        self._open(fresh=False).tool_calls.append(call)

    def _open(self, fresh: bool) -> Message:
        if fresh:
            self._close()
        if self._turn is None:
            self._turn = Message("assistant")
        return self._turn

    def _close(self) -> None:
        if self._turn is not None:
            self.messages.append(self._turn)
            self._turn = None

    def finish(self, tools: list[ToolSchema]) -> list[Message]:
        self._close()
        out = list(self.messages)
        system = "\n\n".join(self.system)
        if system or tools:
            out.insert(0, Message("system", content=system, tools=tools))
        if out[-1].role == "assistant":
            out[-1].prefill = True
        return out


def tools_of(raw: list[Any] | None) -> Tools:
    """Function tools in either API's validated shape, Responses namespaces flattened,
    hosted tools left out."""
    tools = Tools()
    for t in raw or []:
        if isinstance(t, ChatTool):
            tools.add(t.function.name, t.function.description, t.function.parameters)
        elif isinstance(t, ResponsesFunction):
            tools.add(t.name, t.description, t.parameters)
        elif isinstance(t, Namespace):
            for fn in t.tools:
                if isinstance(fn, ResponsesFunction):
                    tools.add(fn.name, fn.description, fn.parameters, namespace=t.name)
    return tools


def offered(tools: list[ToolSchema], body: Sampling) -> tuple[list[ToolSchema], Any]:
    """(the tools the prompt declares, the engine's tool_choice) from `tool_choice` and
    `parallel_tool_calls`: `none` hides the tools, as on the Anthropic side."""
    choice = body.tool_choice
    mode = choice.type if isinstance(choice, ModeChoice) else choice
    if mode == "none" or not tools:
        return [], None
    engine: dict[str, Any] | None = None
    if mode == "required":
        engine = {"type": "any"}
    elif isinstance(choice, FunctionChoice):
        engine = {"type": "tool", "name": choice.tool}
    if body.parallel_tool_calls is False:
        engine = {**(engine or {"type": "auto"}), "disable_parallel_tool_use": True}
    return tools, engine
