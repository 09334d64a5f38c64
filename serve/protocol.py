"""Anthropic Messages response shapes: the final Message, the SSE event sequence, errors.

Pure functions of engine results and events, so the wire format is tested without a model.
Field meanings follow Anthropic: `usage.input_tokens` = tokens prefilled for this request,
`cache_read_input_tokens` = tokens reused from a stored state (their sum is the prompt
length), `cache_creation_input_tokens` = 0 (nothing is billed as a write here).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.anthropic import response_content
from ds4jax.chat.ids import new_tool_id
from ds4jax.chat.kinds import Finish
from ds4jax.chat.turn import TextDelta, ThinkingDelta, ToolInputDelta, ToolUseStart, ToolUseStop
from ds4jax.engine import Result, ToolCallStarted

SIGNATURE = "ds4jax"  # thinking blocks need a signature; clients send it back unchanged

STOP_REASONS = {
    Finish.END_TURN: "end_turn",
    Finish.MAX_TOKENS: "max_tokens",
    Finish.STOP_SEQUENCE: "stop_sequence",
    Finish.TOOL_USE: "tool_use",
    Finish.CANCELLED: "end_turn",
}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def error_body(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def openai_type(error_type: str) -> str:
    """An error type in OpenAI's words: a failure of ours is its `server_error`."""
    return "server_error" if error_type == "api_error" else error_type


def usage(cached: int, prefilled: int, output: int) -> dict[str, int]:
    return {
        "input_tokens": prefilled,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def final_message(msg_id: str, model: str, result: Result) -> dict[str, Any]:
    """The non-streaming Message: thinking, then text and tool_use blocks in sampled order."""
    content = response_content(result.message, result.tool_ids, SIGNATURE)
    if not any(b["type"] in ("text", "tool_use") for b in content):
        content.append({"type": "text", "text": ""})
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS[result.finish],
        "stop_sequence": result.stop_sequence,
        "usage": usage(result.cached, result.prefilled, result.output_tokens),
    }


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


@dataclass
class StreamProjector:
    """Engine events → Anthropic SSE frames, with block indices in start order."""

    index: int = -1
    open_kind: str | None = None
    any_visible: bool = False
    tool_index: dict[int, int] = field(default_factory=dict)  # call index → block index
    pending_ids: dict[int, str] = field(default_factory=dict)

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self.index += 1
        self.open_kind = block["type"]
        out.append(
            sse(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )
        return out

    def _stop(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open_kind = None
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def feed(self, ev: Any) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(ev, ThinkingDelta):
            if not ev.text:
                return out
            if self.open_kind != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, TextDelta):
            if not ev.text:
                return out
            if self.open_kind != "text":
                out += self._start({"type": "text", "text": ""})
            self.any_visible = True
            out.append(self._delta({"type": "text_delta", "text": ev.text}))
        elif isinstance(ev, ToolCallStarted):
            self.pending_ids[ev.index] = ev.id
        elif isinstance(ev, ToolUseStart):
            tid = self.pending_ids.get(ev.index) or new_tool_id()
            out += self._start({"type": "tool_use", "id": tid, "name": ev.name, "input": {}})
            self.tool_index[ev.index] = self.index
            self.any_visible = True
        elif isinstance(ev, ToolInputDelta):
            if self.tool_index.get(ev.index) == self.index and self.open_kind == "tool_use":
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": ev.partial_json})
                )
        elif isinstance(ev, ToolUseStop):
            if self.tool_index.get(ev.index) == self.index:
                out += self._stop()
        return out

    def finish(self) -> list[bytes]:
        out = self._stop()
        if not self.any_visible:  # clients expect at least one text or tool_use block
            out += self._start({"type": "text", "text": ""})
            out += self._stop()
        return out


def message_start(msg_id: str, model: str, cached: int, prefilled: int) -> bytes:
    return sse(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": msg_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage(cached, prefilled, 0),
            },
        },
    )


def message_end(result: Result) -> list[bytes]:
    return [
        sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": STOP_REASONS[result.finish],
                    "stop_sequence": result.stop_sequence,
                },
                "usage": usage(result.cached, result.prefilled, result.output_tokens),
            },
        ),
        sse("message_stop", {"type": "message_stop"}),
    ]


PING = sse("ping", {"type": "ping"})


def error_event(error_type: str, message: str) -> bytes:
    return sse("error", error_body(error_type, message))


@dataclass
class AnthropicStream:
    """The Anthropic wire writer of the one stream loop (`serve.app`): `message_start` as
    soon as the usage is known — at the decision, or at once (provisional: the whole prompt)
    for a request still queued — then the projected content blocks, `message_delta` and
    `message_stop`; a failure is an `error` event."""

    msg_id: str
    model: str
    keepalive: bytes = PING
    projector: StreamProjector = field(default_factory=StreamProjector)
    started: bool = False

    def _open(self, cached: int, prefilled: int) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [message_start(self.msg_id, self.model, cached, prefilled)]

    def start(self, queued: bool, prompt_tokens: int) -> list[bytes]:
        return self._open(0, prompt_tokens) if queued else []

    def decided(self, cached: int, prefilled: int) -> list[bytes]:
        return self._open(cached, prefilled)

    def feed(self, ev: Any) -> list[bytes]:
        return self.projector.feed(ev)

    def finish(self, result: Result) -> list[bytes]:
        opened = self._open(result.cached, result.prefilled)
        return [*opened, *self.projector.finish(), *message_end(result)]

    def fail(self, message: str, error_type: str, code: str | None = None) -> list[bytes]:
        return [error_event(error_type, message)]
