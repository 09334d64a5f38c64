"""The names the layers pass each other, as types: which protocol a request spoke and how a
turn ended. `StrEnum`s, so a value is its wire string in logs, metrics labels and JSON."""

from __future__ import annotations

from enum import StrEnum


class Api(StrEnum):
    """The protocol a request spoke: it words the errors, prefixes the tool ids (`toolu_` /
    `call_`) and labels the metrics."""

    ANTHROPIC = "anthropic"
    RESPONSES = "responses"
    CHAT = "chat"


class Finish(StrEnum):
    """How a turn ended, in Anthropic's stop-reason words; each API maps them to its own
    (`serve.protocol.STOP_REASONS`, `serve.chat_wire.FINISH`, Responses' status)."""

    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    STOP_SEQUENCE = "stop_sequence"
    TOOL_USE = "tool_use"
    CANCELLED = "cancelled"
