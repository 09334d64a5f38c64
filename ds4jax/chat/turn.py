"""What a generated assistant turn is made of: the events the streaming DSML parser emits
(reasoning, text, tool calls opening, growing and closing) and the parsed message they fold
into. The vocabulary between the parser (`dsml_parse`), the engine's rows (`decoding`) and the
wire writers (`serve/`), apart from the parser's 500 lines of state machine.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ThinkingDelta:
    text: str


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolUseStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolInputDelta:
    index: int
    partial_json: str


@dataclass(frozen=True)
class ToolUseStop:
    index: int
    #: False when the call was cut short (malformed block or text ended inside it): the JSON was
    #: closed so it parses, but the call must not be executed.
    complete: bool = True


Event = ThinkingDelta | TextDelta | ToolUseStart | ToolInputDelta | ToolUseStop


@dataclass(frozen=True)
class ParsedText:
    text: str


@dataclass
class ParsedCall:
    name: str
    arguments: dict[str, Any]
    complete: bool = True


@dataclass
class ParsedMessage:
    reasoning: str | None
    blocks: list[ParsedText | ParsedCall] = field(default_factory=list)
    raw_dsml: str | None = None
    error: str | None = None

    @property
    def content(self) -> str:
        return "".join(b.text for b in self.blocks if isinstance(b, ParsedText))

    @property
    def tool_calls(self) -> list[ParsedCall]:
        return [b for b in self.blocks if isinstance(b, ParsedCall)]


def collect_events(events: Iterable[Event], *, thinking: bool = False) -> ParsedMessage:
    """Fold a finished parser's events; `raw_dsml` and `error` are left None (the parser has
    them). `thinking` makes the reasoning "" rather than None when no reasoning text came."""
    reasoning: list[str] = []
    saw_reasoning = thinking
    blocks: list[ParsedText | ParsedCall] = []
    text: list[str] = []
    calls: dict[int, tuple[str, list[str]]] = {}

    def flush_text() -> None:
        if joined := "".join(text):
            blocks.append(ParsedText(joined))
        text.clear()

    for ev in events:
        if isinstance(ev, ThinkingDelta):
            reasoning.append(ev.text)
            saw_reasoning = True
        elif isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, ToolUseStart):
            flush_text()
            calls[ev.index] = (ev.name, [])
        elif isinstance(ev, ToolInputDelta):
            calls[ev.index][1].append(ev.partial_json)
        elif isinstance(ev, ToolUseStop):
            name, parts = calls.pop(ev.index)
            blocks.append(ParsedCall(name, json.loads("".join(parts)), ev.complete))
    flush_text()
    return ParsedMessage("".join(reasoning) if saw_reasoning else None, blocks)
