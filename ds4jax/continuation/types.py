"""Values the continuation decision works on. No JAX here: the decision is pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ds4jax.chat.kinds import Api
from ds4jax.chat.segments import Segment


class CacheSource(Enum):
    """Where the reused part of a prompt came from, in the order they are tried."""

    LIVE_TOOL = "anthropic-tool-output"
    THINKING_VISIBLE = "thinking-visible"
    TOKEN_PREFIX = "memory-token"
    TEXT_PREFIX = "memory-text"
    FORK = "fork-point"
    DISK = "disk-text"
    COLD = "none"


ORDER = [
    CacheSource.LIVE_TOOL,
    CacheSource.THINKING_VISIBLE,
    CacheSource.TOKEN_PREFIX,
    CacheSource.TEXT_PREFIX,
    CacheSource.FORK,
    CacheSource.DISK,
    CacheSource.COLD,
]

#: Per protocol (`RequestView.api`): how its errors name it, its tool ids and its history.
#: The Anthropic and Responses wordings are ds4's, to the byte.
APIS = {
    Api.ANTHROPIC: ("Anthropic", "tool_use_id", "messages"),
    Api.RESPONSES: ("Responses", "call_id", "input"),
    Api.CHAT: ("Chat Completions", "tool_call_id", "messages"),
}


def live_gone_message(api: str = Api.ANTHROPIC) -> str:
    name, _, history = APIS[api]
    return (
        f"{name} continuation state is not available; retry by replaying the full {history} history"
    )


def unknown_id_message(tool_use_id: str, api: str = Api.ANTHROPIC) -> str:
    name, id_name, history = APIS[api]
    return (
        f"{name} continuation state is not available for {id_name} {tool_use_id}; "
        f"retry by replaying the full {history} history"
    )


LIVE_GONE_MESSAGE = live_gone_message(Api.ANTHROPIC)


def source_label(source: CacheSource, api: str = Api.ANTHROPIC) -> str:
    """The name a decision is counted and logged under: the protocol-specific live paths are
    told apart (`responses-tool-output`, `chat-visible`, …), as ds4's trace does."""
    if source == CacheSource.LIVE_TOOL:
        return f"{api}-tool-output"
    if source == CacheSource.THINKING_VISIBLE and api != Api.ANTHROPIC:
        return f"{api}-visible"
    return source.value


@dataclass(frozen=True)
class LiveFrontier:
    """The sampled truth: a state pytree, the tokens evaluated into it and their text as
    segments. Immutable; a new turn makes a new one."""

    state: Any  # DecodeState (opaque here)
    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def pos(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ToolBinding:
    """The live frontier ends right after a sampled tool-call block with these ids."""

    ids: frozenset[str]
    pos: int


@dataclass(frozen=True)
class ThinkingBinding:
    """After a tool-less thinking turn: the transcript a client replays once the official
    format drops the reasoning (up to the assistant content, EOS excluded), for a live state
    that still holds the reasoning."""

    visible: tuple[Segment, ...]
    pos: int


@dataclass(frozen=True)
class RequestView:
    """What the decision needs from a request, protocol-neutral."""

    segments: tuple[Segment, ...]  # the full render, normalized
    tokens: tuple[int, ...]  # its full tokenization
    tail_ids: tuple[str, ...] = ()  # ids of the trailing tool_result run
    tail: tuple[Segment, ...] | None = None  # render of that run, after the assistant's EOS
    requires_live: bool = False  # some tool_result id has no replayed tool_use
    api: str = Api.ANTHROPIC  # the protocol: the wording of its errors (`APIS`)


@dataclass(frozen=True)
class Decision:
    source: CacheSource
    base: tuple[int, ...]  # tokens already in the base state
    suffix_segments: tuple[Segment, ...] | None = None  # to tokenize on its own, or
    suffix_tokens: tuple[int, ...] | None = None  # already tokenized (token-prefix path)
    disk: Any = None  # the DiskHit for CacheSource.DISK

    @property
    def cached(self) -> int:
        return len(self.base)


@dataclass(frozen=True)
class Rejection:
    status: int
    message: str
    error_type: str = "invalid_request_error"


@dataclass
class Bindings:
    tool: ToolBinding | None = None
    thinking: ThinkingBinding | None = None
    extra: dict[str, Any] = field(default_factory=dict)
