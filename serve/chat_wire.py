"""OpenAI Chat Completions shapes: the `chat.completion` object and the
`chat.completion.chunk` stream (a role chunk, `reasoning_content` / `content` deltas,
`tool_calls` deltas — header, then argument fragments — a finish chunk, an optional usage
chunk, `data: [DONE]`). Pure functions of engine results and events.

`logprobs` (asked with `logprobs: true`, `top_logprobs: k ≤ 20`): one entry for every token
the model produced in the turn — its reasoning and tool-call tokens included, since the
engine samples them all from the same distribution — with the log-probability of the
model's raw distribution (before temperature and filters). A stream carries each token's
entry on the chunk that follows it.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.kinds import Finish
from ds4jax.chat.turn import TextDelta, ThinkingDelta, ToolInputDelta, ToolUseStart
from ds4jax.decoding import Result, TokenLogprob, ToolCallStarted
from serve.protocol import openai_type
from serve.responses_wire import KEEPALIVE, arguments_json

FINISH = {
    Finish.END_TURN: "stop",
    Finish.STOP_SEQUENCE: "stop",
    Finish.CANCELLED: "stop",
    Finish.MAX_TOKENS: "length",
    Finish.TOOL_USE: "tool_calls",
}


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage(result: Result) -> dict[str, Any]:
    prompt = result.cached + result.prefilled
    return {
        "prompt_tokens": prompt,
        "completion_tokens": result.output_tokens,
        "total_tokens": prompt + result.output_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached},
        "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
    }


def logprob_entry(t: TokenLogprob) -> dict[str, Any]:
    """One token's entry of `logprobs.content`."""
    top = [{"token": text, "logprob": lp, "bytes": list(raw)} for _, text, raw, lp in t.top]
    return {"token": t.text, "logprob": t.logprob, "bytes": list(t.bytes), "top_logprobs": top}


def logprobs_of(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [logprob_entry(t) for t in entries], "refusal": None}


def final_completion(cid: str, model: str, result: Result, created: int) -> dict[str, Any]:
    m = result.message
    message: dict[str, Any] = {"role": "assistant", "content": m.content or None}
    if m.reasoning is not None:
        message["reasoning_content"] = m.reasoning
    calls = [
        {"id": tid, "type": "function",
         "function": {"name": c.name, "arguments": arguments_json(c.arguments)}}
        for c, tid in zip(m.tool_calls, result.tool_ids, strict=False)
    ]  # fmt: skip
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": FINISH[result.finish],
              "logprobs": logprobs_of(result.logprobs)}  # fmt: skip
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(result),
    }


def data(obj: dict[str, Any] | str) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


DONE = data("[DONE]")


@dataclass
class ChatStream:
    cid: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    call_ids: dict[int, str] = field(default_factory=dict)
    call_slot: dict[int, int] = field(default_factory=dict)  # call index → tool_calls index
    #: token entries not yet sent: they ride on the next chunk
    pending: list[TokenLogprob] = field(default_factory=list)
    keepalive: bytes = KEEPALIVE

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        logprobs = logprobs_of(self.pending) if self.pending else None
        self.pending = []
        chunk = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                              "logprobs": logprobs}]}  # fmt: skip
        if self.include_usage:  # OpenAI's: every chunk but the last says `usage: null`
            chunk["usage"] = None
        return data(chunk)

    def start(self, queued: bool = False, prompt_tokens: int = 0) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def decided(self, cached: int, prefilled: int) -> list[bytes]:
        return []  # the usage is the final chunk's

    def feed(self, ev: Any) -> list[bytes]:
        if isinstance(ev, TokenLogprob):
            self.pending.append(ev)
        elif isinstance(ev, ThinkingDelta) and ev.text:
            return [self._chunk({"reasoning_content": ev.text})]
        elif isinstance(ev, TextDelta) and ev.text:
            return [self._chunk({"content": ev.text})]
        elif isinstance(ev, ToolCallStarted):
            self.call_ids[ev.index] = ev.id
        elif isinstance(ev, ToolUseStart):
            slot = self.call_slot.setdefault(ev.index, len(self.call_slot))
            head = {"index": slot, "id": self.call_ids.get(ev.index, ""), "type": "function",
                    "function": {"name": ev.name, "arguments": ""}}  # fmt: skip
            return [self._chunk({"tool_calls": [head]})]
        elif isinstance(ev, ToolInputDelta) and ev.partial_json and ev.index in self.call_slot:
            frag = {"index": self.call_slot[ev.index], "function": {"arguments": ev.partial_json}}
            return [self._chunk({"tool_calls": [frag]})]
        return []

    def finish(self, result: Result) -> list[bytes]:
        out = [self._chunk({}, FINISH[result.finish])]
        if self.include_usage:
            out.append(data({"id": self.cid, "object": "chat.completion.chunk",
                             "created": self.created, "model": self.model, "choices": [],
                             "usage": usage(result)}))  # fmt: skip
        return [*out, DONE]

    def fail(self, message: str, error_type: str = "server_error",
             code: str | None = None) -> list[bytes]:  # fmt: skip
        kind = openai_type(error_type)
        return [data({"error": {"message": message, "type": kind, "code": code}}), DONE]
