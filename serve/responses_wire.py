"""OpenAI Responses shapes: the response object, its output items, and the SSE event
sequence Codex and the openai SDK accept (`response.created` … `response.completed`).

Pure functions of engine results and events. Items come in sampled order: the reasoning
item (`rs_`), the message (`msg_`), then one `function_call` (`fc_`, with the server's
`call_` id) per call. The reasoning item carries the exact reasoning sealed in
`encrypted_content` (`continuation.reasoning_seal`); its text is the item's `summary` when
the request asked for one, else its `content`. `usage.input_tokens` is the whole prompt,
`input_tokens_details.cached_tokens` the part reused from a stored state.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.kinds import Finish
from ds4jax.chat.responses import ResponsesRequest
from ds4jax.chat.turn import TextDelta, ThinkingDelta, ToolInputDelta, ToolUseStart, ToolUseStop
from ds4jax.decoding import Result, ToolCallStarted


def arguments_json(arguments: Any) -> str:
    """A call's arguments as the compact JSON its streamed fragments concatenate to."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def usage(result: Result) -> dict[str, Any]:
    cached, prompt, output = result.cached, result.prompt_tokens, result.output_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
        "total_tokens": prompt + output,
    }


def response_object(
    rid: str, req: ResponsesRequest, status: str, output: list[dict[str, Any]],
    use: dict[str, Any] | None, created: int, error: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    echo = req.echo
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": req.request.model,
        "output": output,
        "usage": use,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo.get("instructions"),
        "metadata": echo.get("metadata", {}),
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools", []),
        "temperature": req.request.temperature,
        "top_p": req.request.top_p,
        "max_output_tokens": echo.get("max_output_tokens"),
        "reasoning": echo.get("reasoning"),
        "previous_response_id": None,
        "store": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
    }


def status_of(result: Result) -> str:
    return "incomplete" if result.finish == Finish.MAX_TOKENS else "completed"


@dataclass
class Items:
    """Builds the output items, from the final result or event by event."""

    req: ResponsesRequest
    seal: Callable[[str], str]
    items: list[dict[str, Any]] = field(default_factory=list)

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        part = [{"type": "summary_text" if self.req.summary else "reasoning_text", "text": text}]
        item: dict[str, Any] = {"id": new_id("rs_"), "type": "reasoning", "status": status,
                                "summary": part if self.req.summary else [],
                                "content": None if self.req.summary else part}  # fmt: skip
        if status == "completed":
            item["encrypted_content"] = self.seal(text)
        return item

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": status,
                "content": parts if status == "completed" else []}  # fmt: skip

    def call(self, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        item = {"id": new_id("fc_"), "type": "function_call", "status": status,
                "call_id": call_id, "name": name, "arguments": arguments}  # fmt: skip
        if name in self.req.namespaced:
            item["namespace"], item["name"] = self.req.namespaced[name]
        return item

    def from_result(self, result: Result) -> list[dict[str, Any]]:
        m = result.message
        out = []
        if m.reasoning:
            out.append(self.reasoning(m.reasoning))
        # a message where there is text, or nothing else to answer with (as the stream has)
        if m.content or not (m.reasoning or m.tool_calls):
            out.append(self.message(m.content))
        for call, cid in zip(m.tool_calls, result.tool_ids, strict=False):
            # a call cut short (max_output_tokens inside it) has arguments closed so they
            # parse, but it is no call to run: `incomplete`, as the stream's item says
            status = "completed" if call.complete else "incomplete"
            out.append(self.call(cid, call.name, arguments_json(call.arguments), status))
        return out


def final_response(
    rid: str, req: ResponsesRequest, result: Result, seal: Callable[[str], str], created: int
) -> dict[str, Any]:
    output = Items(req, seal).from_result(result)
    use = usage(result)
    return response_object(rid, req, status_of(result), output, use, created)


def sse(data: dict[str, Any]) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


KEEPALIVE = b": keepalive\n\n"  # an SSE comment: the Responses stream has no ping event


@dataclass
class ResponsesStream:
    """Engine events → Responses SSE events, with `sequence_number`s; the finished items
    are what `response.completed` carries, so the stream and its final object agree."""

    rid: str
    req: ResponsesRequest
    seal: Callable[[str], str]
    created: int = field(default_factory=lambda: int(time.time()))
    seq: int = 0
    done_items: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the item being streamed
    text: str = ""  # its text so far (reasoning, message text or call arguments)
    call_ids: dict[int, str] = field(default_factory=dict)
    keepalive: bytes = KEEPALIVE

    def _ev(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **data})

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.done_items)}

    def start(self, queued: bool = False, prompt_tokens: int = 0) -> list[bytes]:
        obj = response_object(self.rid, self.req, "in_progress", [], None, self.created)
        return [self._ev("response.created", response=obj),
                self._ev("response.in_progress", response=obj)]  # fmt: skip

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.open, self.text = item, ""
        out.append(self._ev("response.output_item.added", output_index=len(self.done_items),
                            item=item))  # fmt: skip
        if item["type"] == "reasoning":
            if self.req.summary:
                out.append(
                    self._ev(
                        "response.reasoning_summary_part.added",
                        **self._where(),
                        summary_index=0,
                        part={"type": "summary_text", "text": ""},
                    )
                )
            else:
                out.append(
                    self._ev(
                        "response.content_part.added",
                        **self._where(),
                        content_index=0,
                        part={"type": "reasoning_text", "text": ""},
                    )
                )
        elif item["type"] == "message":
            out.append(self._ev("response.content_part.added", **self._where(), content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [],
                                      "logprobs": []}))  # fmt: skip
        return out

    def _delta(self, text: str) -> list[bytes]:
        self.text += text
        kind = self.open["type"]
        if kind == "reasoning" and self.req.summary:
            return [self._ev("response.reasoning_summary_text.delta", **self._where(),
                             summary_index=0, delta=text)]  # fmt: skip
        if kind == "reasoning":
            return [self._ev("response.reasoning_text.delta", **self._where(), content_index=0,
                             delta=text)]  # fmt: skip
        if kind == "message":
            return [self._ev("response.output_text.delta", **self._where(), content_index=0,
                             delta=text, logprobs=[])]  # fmt: skip
        return [self._ev("response.function_call_arguments.delta", **self._where(), delta=text)]

    def _close(self, call_status: str = "completed") -> list[bytes]:
        """Ends the open item; a function call's status is `call_status` (`incomplete`: cut
        short, its arguments closed so they parse, not to be run)."""
        item, text = self.open, self.text
        if item is None:
            return []
        out, where = [], self._where()
        if item["type"] == "reasoning":
            done = Items(self.req, self.seal).reasoning(text)
            part = {"type": "summary_text" if self.req.summary else "reasoning_text", "text": text}
            if self.req.summary:
                out.append(
                    self._ev(
                        "response.reasoning_summary_text.done", **where, summary_index=0, text=text
                    )
                )
                out.append(self._ev("response.reasoning_summary_part.done", **where,
                                    summary_index=0, part=part))  # fmt: skip
            else:
                out.append(
                    self._ev("response.reasoning_text.done", **where, content_index=0, text=text)
                )
                out.append(self._ev("response.content_part.done", **where, content_index=0,
                                    part=part))  # fmt: skip
        elif item["type"] == "message":
            done = Items(self.req, self.seal).message(text)
            out.append(self._ev("response.output_text.done", **where, content_index=0,
                                text=text, logprobs=[]))  # fmt: skip
            out.append(self._ev("response.content_part.done", **where, content_index=0,
                                part=done["content"][0]))  # fmt: skip
        else:
            done = {**item, "status": call_status, "arguments": text}
            out.append(self._ev("response.function_call_arguments.done", **where, arguments=text))
        done["id"] = item["id"]
        out.append(self._ev("response.output_item.done", output_index=len(self.done_items),
                            item=done))  # fmt: skip
        self.done_items.append(done)
        self.open, self.text = None, ""
        return out

    def feed(self, ev: Any) -> list[bytes]:
        out: list[bytes] = []
        items = Items(self.req, self.seal)
        if isinstance(ev, ThinkingDelta) and ev.text:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._add(items.reasoning("", "in_progress"))
            out += self._delta(ev.text)
        elif isinstance(ev, TextDelta) and ev.text:
            if self.open is None or self.open["type"] != "message":
                out += self._add(items.message("", "in_progress"))
            out += self._delta(ev.text)
        elif isinstance(ev, ToolCallStarted):
            self.call_ids[ev.index] = ev.id
        elif isinstance(ev, ToolUseStart):
            cid = self.call_ids.get(ev.index) or new_id("call_")
            out += self._add(items.call(cid, ev.name, "", "in_progress"))
        elif isinstance(ev, ToolInputDelta) and self.open is not None:
            if self.open["type"] == "function_call" and ev.partial_json:
                out += self._delta(ev.partial_json)
        elif isinstance(ev, ToolUseStop):
            if self.open is not None and self.open["type"] == "function_call":
                out += self._close("completed" if ev.complete else "incomplete")
        return out

    def finish(self, result: Result) -> list[bytes]:
        out = self._close()
        if not self.done_items:  # an empty turn still answers with a message
            out += self._add(Items(self.req, self.seal).message("", "in_progress"))
            out += self._close()
        status = status_of(result)
        use = usage(result)
        obj = response_object(self.rid, self.req, status, self.done_items, use, self.created)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*out, self._ev(kind, response=obj)]

    def decided(self, cached: int, prefilled: int) -> list[bytes]:
        return []  # the usage is in the final object only

    def fail(self, message: str, error_type: str = "server_error",
             code: str | None = None) -> list[bytes]:  # fmt: skip
        err = {"code": code or "server_error", "message": message}
        obj = response_object(self.rid, self.req, "failed", self.done_items, None, self.created,
                              error=err)  # fmt: skip
        return [self._ev("response.failed", response=obj)]
