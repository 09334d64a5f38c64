"""What a conversation says about continuation, before any model work: which tool_result ids
it answers, whether it can be served without the live state, the render of its trailing
tool-result turn, and exact replay of remembered tool-call bytes.

Protocol-neutral: it reads the `Conversation` every protocol is converted into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

from ds4jax.chat.conversation import Conversation, Message
from ds4jax.chat.dsml_parse import parse_generated
from ds4jax.chat.kinds import Api
from ds4jax.chat.render import render
from ds4jax.chat.segments import Segment, normalize, strip_prefix
from ds4jax.continuation.types import unknown_id_message


class UnknownToolResult(ValueError):
    """A tool_result id that is neither live nor backed by a replayed tool_use (400)."""

    def __init__(self, tool_use_id: str, api: str = Api.ANTHROPIC) -> None:
        super().__init__(unknown_id_message(tool_use_id, api))
        self.tool_use_id = tool_use_id


def _result_ids(m: Message) -> list[str]:
    return [b.tool_use_id for b in m.blocks if b.kind == "tool_result" and b.tool_use_id]


def validate_tool_results(
    conv: Conversation, live_ids: Collection[str], api: str = Api.ANTHROPIC
) -> bool:
    """Check every tool_result in the history; returns whether the request requires the live
    state (some id is known only live, with no replayed tool_use before it)."""
    seen_calls: set[str] = set()
    requires_live = False
    for m in conv.messages:
        if m.role == "assistant":
            seen_calls.update(c.id for c in m.tool_calls if c.id)
        elif m.role == "user":
            for tid in _result_ids(m):
                if tid in seen_calls:
                    continue
                if tid not in live_ids:
                    raise UnknownToolResult(tid, api)
                requires_live = True
    return requires_live


def _tail_start(conv: Conversation) -> int | None:
    """Start of the trailing run of user / latest_reminder turns holding tool results, right
    after an assistant turn — or after only the system turn: a tool-result-only request,
    which exists only to continue the live state."""
    i = len(conv.messages)
    while i > 0 and conv.messages[i - 1].role in ("user", "latest_reminder"):
        i -= 1
    if i == len(conv.messages):
        return None
    if i > 0 and conv.messages[i - 1].role not in ("assistant", "system"):
        return None
    if not any(_result_ids(m) for m in conv.messages[i:] if m.role == "user"):
        return None
    # the run answers a tool call: its first user turn opens with the results (the API's
    # own rule); a question before them is another conversation's turn, not this run's
    first = next((m for m in conv.messages[i:] if m.role == "user"), None)
    if first is not None and (not first.blocks or first.blocks[0].kind != "tool_result"):
        return None
    return i


def tool_tail(conv: Conversation) -> tuple[tuple[str, ...], tuple[Segment, ...] | None]:
    """(ids of the trailing tool_result run, its render after the preceding assistant turn's
    EOS). The render is None when the conversation does not end in such a run, or when the
    history before it does not render as a prefix of the whole (the official format only
    changes earlier turns when the last user turn moves without declared tools)."""
    start = _tail_start(conv)
    if start is None:
        return (), None
    ids: list[str] = []
    for m in conv.messages[start:]:
        if m.role == "user":
            ids += [t for t in _result_ids(m) if t not in ids]
    head_msgs = list(conv.messages[:start])
    if head_msgs:
        head_msgs[-1] = dataclasses.replace(head_msgs[-1], prefill=False)
    head = normalize(render(dataclasses.replace(conv, messages=head_msgs)))
    full = normalize(render(conv))
    return tuple(ids), strip_prefix(full, head)


def attach_tool_memory(conv: Conversation, block_for: Callable[[list[str]], str | None]) -> int:
    """Replace the canonical rendering of replayed tool calls by the sampled bytes wherever
    every id of the turn maps to one remembered block; returns how many turns were."""
    n = 0
    for i, m in enumerate(conv.messages):
        if m.role != "assistant" or not m.tool_calls or m.raw_tool_calls is not None:
            continue
        ids = [c.id for c in m.tool_calls if c.id]
        if len(ids) != len(m.tool_calls):
            continue
        block = block_for(ids)
        # the sampled bytes stand for the replayed calls whatever their arguments say (the
        # sampled state is the truth), if they call the same tools: another client replaying
        # an id with a call to another tool keeps its own rendering
        if block is not None and _same_tools(block, m.tool_calls):
            conv.messages[i] = dataclasses.replace(m, raw_tool_calls=block)
            n += 1
    return n


def _same_tools(block: str, calls: list[Any]) -> bool:
    """Whether a remembered DSML block invokes these replayed calls' tools, in order."""
    sampled = parse_generated(block, thinking=False).tool_calls
    return [c.name for c in sampled] == [c.name for c in calls]
