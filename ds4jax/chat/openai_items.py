"""What the OpenAI protocols (Responses, Chat Completions) share on the way in: the tools
they declare, the text of their content parts, and the assembly of a flat item list into
the `Conversation` every protocol becomes.

Renderings chosen to match the Anthropic side (README, "OpenAI protocols"):

* `system` / `developer` messages before the first user or assistant turn join the system
  prompt (after `instructions`) with `\\n\\n`; later ones become the official
  `latest_reminder` turn, as an Anthropic `system` message inside `messages` does.
* Images and files render as the official encoder renders unsupported blocks:
  `[Unsupported input_image]`.
* Consecutive assistant items (reasoning, text, calls) are one assistant turn; a reasoning
  item, or text after calls, opens the next one. Tool outputs are tool_result blocks of the
  user turn that follows, as in V4.
* Function tools render as `{name, description, parameters}`. A Responses `namespace`
  is flattened (`namespace + name`, ds4's rule) and restored on output. Tools of other
  types (`web_search`, `file_search`, …) are hosted tools the server cannot run: they are
  left out of the prompt, not refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.anthropic import RequestError
from ds4jax.chat.conversation import Message, ToolCall, ToolSchema, UserBlock

TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"}


def fail(where: str, what: str) -> RequestError:
    return RequestError(f"{where}: {what}")


def parts_text(content: Any, where: str) -> str:
    """A string, null, or a list of typed parts whose text parts count (joined with `\\n\\n`,
    as Anthropic text blocks are); other parts render as unsupported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise fail(where, "must be a string or a list of content parts")
    out: list[str] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise fail(f"{where}[{i}]", "must be a content part with a type")
        if part["type"] in TEXT_PARTS:
            text = part.get("text", part.get("refusal", ""))
            if not isinstance(text, str):
                raise fail(f"{where}[{i}].text", "must be a string")
            out.append(text)
        else:
            out.append(f"[Unsupported {part['type']}]")
    return "\n\n".join(out)


def arguments_of(raw: Any, where: str) -> Any:
    """Call arguments as sent: a JSON string (decoded when it is an object, else kept as the
    one string parameter the official encoder falls back to) or an object."""
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise fail(where, "must be a JSON string")
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


@dataclass
class Tools:
    schemas: list[ToolSchema] = field(default_factory=list)
    #: flattened name → (namespace, name): Responses output names a call by both
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, fn: Any, where: str, namespace: str = "") -> None:
        if not isinstance(fn, dict):
            raise fail(where, "must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise fail(f"{where}.name", "must be a non-empty string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise fail(f"{where}.parameters", "must be a JSON schema object")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise fail(f"{where}.description", "must be a string")
        full = namespace + name
        if any(t.name == full for t in self.schemas):
            raise fail(f"{where}.name", f"duplicate tool name {full!r}")
        if namespace:
            self.namespaced[full] = (namespace, name)
        self.schemas.append(ToolSchema(name=full, description=desc, parameters=params))


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
        if not any(m.role in ("user", "assistant") for m in self.messages):
            raise RequestError("the conversation has no user or assistant turn")
        out = list(self.messages)
        system = "\n\n".join(self.system)
        if system or tools:
            out.insert(0, Message("system", content=system, tools=tools))
        if out[-1].role == "assistant":
            out[-1].prefill = True
        return out


def parse_tools(raw: Any) -> Tools:
    """Function tools in either protocol's shape (Chat's `{"type": "function", "function":
    {…}}`, Responses' flat one), Responses namespaces flattened; any other type is a hosted
    tool (`web_search`, …) the server cannot run: left out of the prompt."""
    tools = Tools()
    if raw is None:
        return tools
    if not isinstance(raw, list):
        raise fail("tools", "must be a list")
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise fail(where, "must be an object")
        if t.get("type", "function") == "function":
            fn = t.get("function")
            if isinstance(fn, dict):
                tools.add(fn, f"{where}.function")
            else:
                tools.add(t, where)
        elif t.get("type") == "namespace":
            ns, inner = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not isinstance(inner, list):
                raise fail(where, "a namespace needs a name and a list of tools")
            for j, fn in enumerate(inner):
                if isinstance(fn, dict) and fn.get("type", "function") == "function":
                    tools.add(fn, f"{where}.tools[{j}]", namespace=ns)
    return tools


def offered(tools: list[ToolSchema], body: dict[str, Any]) -> tuple[list[ToolSchema], Any]:
    """(the tools the prompt declares, the engine's tool_choice) from `tool_choice` and
    `parallel_tool_calls`: `none` hides the tools, as on the Anthropic side."""
    choice = tool_choice(body.get("tool_choice"), tools)
    if choice == "none" or not tools:
        return [], None
    if body.get("parallel_tool_calls") is False:
        choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
    return tools, choice


def tool_choice(choice: Any, tools: list[ToolSchema], where: str = "tool_choice") -> Any:
    """The OpenAI `tool_choice` as the engine's (Anthropic-shaped) one, or "none"."""
    if choice is None or choice == "auto":
        return None
    if choice == "none":
        return "none"
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = fn.get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise fail(f"{where}.name", f"no tool named {name!r}")
        return {"type": "tool", "name": name}
    if isinstance(choice, dict) and choice.get("type") in ("auto", "none"):
        return None if choice["type"] == "auto" else "none"
    raise fail(where, "must be none, auto, required or a function")
