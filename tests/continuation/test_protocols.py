"""The Responses (and Chat Completions) decision is the Anthropic one with different
evidence: the same conversation sent through each protocol renders the same prompt, reads
the same tail of tool results (`call_id`s instead of `tool_use_id`s), and routes to the same
session and source over any pool of live frontiers; refusals differ only in wording.
Pure: no model, a token per character."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.chat_completions import parse_chat_request
from ds4jax.chat.conversation import Conversation
from ds4jax.chat.render import render
from ds4jax.chat.responses import parse_responses_request
from ds4jax.chat.segments import join, normalize
from ds4jax.continuation.evidence import UnknownToolResult, tool_tail, validate_tool_results
from ds4jax.continuation.pool import Pool, route
from ds4jax.continuation.types import (
    LiveFrontier,
    Rejection,
    RequestView,
    ThinkingBinding,
    ToolBinding,
    live_gone_message,
    unknown_id_message,
)
from ds4jax.kvstore.store import NoStore

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}
words = st.text("abc xyz", min_size=1, max_size=6)


@st.composite
def conversations(draw: Any) -> list[tuple]:
    """Abstract turns: ("user", text) | ("assistant", reasoning, text, [(id, cmd)]) |
    ("results", [(id, output)]): a tool loop, maybe ending in results (the live path)."""
    turns: list[tuple] = [("user", draw(words))]
    n = 0
    for _ in range(draw(st.integers(0, 3))):
        calls = []
        for _ in range(draw(st.integers(0, 2))):
            n += 1
            calls.append((f"id{n}", draw(words)))
        turns.append(("assistant", draw(st.one_of(st.none(), words)), draw(words), calls))
        if calls:
            results = [(cid, draw(words)) for cid, _ in calls]
            turns.append(("results", draw(st.permutations(results))))
        else:  # (two assistant turns in a row would be one in the Responses item list)
            turns.append(("user", draw(words)))
    if draw(st.booleans()):  # a request answering ids no replayed call backs
        turns.append(("results", [(draw(st.sampled_from(["id1", "idX"])), "out")]))
    return turns


def anthropic_body(turns: list[tuple], thinking: bool) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    for t in turns:
        if t[0] == "user":
            msgs.append({"role": "user", "content": t[1]})
        elif t[0] == "assistant":
            blocks: list[dict[str, Any]] = []
            if t[1] is not None:
                blocks.append({"type": "thinking", "thinking": t[1], "signature": ""})
            blocks.append({"type": "text", "text": t[2]})
            blocks += [{"type": "tool_use", "id": cid, "name": "sh", "input": {"cmd": c}}
                       for cid, c in t[3]]  # fmt: skip
            msgs.append({"role": "assistant", "content": blocks})
        else:
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": cid, "content": out} for cid, out in t[1]
            ]})  # fmt: skip
    tools = [{"name": "sh", "input_schema": SCHEMA}]
    return {"system": "sys", "tools": tools, "messages": msgs, "max_tokens": 5,
            "thinking": {"type": "enabled" if thinking else "disabled"}}  # fmt: skip


def responses_body(turns: list[tuple], thinking: bool) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for t in turns:
        if t[0] == "user":
            items.append({"type": "message", "role": "user", "content": t[1]})
        elif t[0] == "assistant":
            if t[1] is not None:
                items.append(
                    {
                        "type": "reasoning",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": t[1]}],
                    }
                )
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": t[2]}],
                }
            )
            items += [{"type": "function_call", "call_id": cid, "name": "sh",
                       "arguments": json.dumps({"cmd": c})} for cid, c in t[3]]  # fmt: skip
        else:
            items += [{"type": "function_call_output", "call_id": cid, "output": out}
                      for cid, out in t[1]]  # fmt: skip
    return {"instructions": "sys", "input": items,
            "tools": [{"type": "function", "name": "sh", "parameters": SCHEMA}],
            "reasoning": {"effort": "high" if thinking else "none"}}  # fmt: skip


def chat_body(turns: list[tuple], thinking: bool) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for t in turns:
        if t[0] == "user":
            msgs.append({"role": "user", "content": t[1]})
        elif t[0] == "assistant":
            m: dict[str, Any] = {"role": "assistant", "content": t[2]}
            if t[1] is not None:
                m["reasoning_content"] = t[1]
            if t[3]:
                m["tool_calls"] = [
                    {
                        "id": cid,
                        "type": "function",
                        "function": {"name": "sh", "arguments": json.dumps({"cmd": c})},
                    }
                    for cid, c in t[3]
                ]
            msgs.append(m)
        else:
            msgs += [{"role": "tool", "tool_call_id": cid, "content": out} for cid, out in t[1]]
    return {
        "messages": msgs,
        "think": thinking,
        "tools": [{"type": "function", "function": {"name": "sh", "parameters": SCHEMA}}],
    }


def evidence(conv: Conversation, api: str, live_ids: frozenset[str]) -> RequestView | str:
    try:
        requires_live = validate_tool_results(conv, live_ids, api)
    except UnknownToolResult as err:
        return str(err)
    segments = normalize(render(conv))
    ids, tail = tool_tail(conv)
    return RequestView(segments, tuple(map(ord, join(segments))), ids, tail, requires_live, api)


@settings(max_examples=60, deadline=None)
@given(conversations(), st.booleans(), st.data())
def test_three_protocols_one_machine(turns: list[tuple], thinking: bool, data: Any) -> None:
    convs = {
        "anthropic": parse_messages_request(anthropic_body(turns, thinking)).conversation,
        "responses": parse_responses_request(responses_body(turns, thinking)).request.conversation,
        "chat": parse_chat_request(chat_body(turns, thinking)).request.conversation,
    }
    texts = {api: join(render(c)) for api, c in convs.items()}
    assert texts["responses"] == texts["anthropic"] == texts["chat"]

    # a pool whose sessions hold prefixes of this prompt, some waiting on tool ids
    text = texts["anthropic"]
    pool = Pool.create(3, state_nbytes=1)
    all_ids = sorted({cid for t in turns if t[0] == "results" for cid, _ in t[1]} | {"idX"})
    for s in pool.sessions:
        if data.draw(st.booleans()):
            cut = data.draw(st.integers(1, len(text)))
            s.live = LiveFrontier(object(), tuple(map(ord, text[:cut])), normalize([]))
            s.used = pool.tick()
            ids = data.draw(st.sets(st.sampled_from(all_ids), max_size=2))
            if ids:
                s.bindings.tool = ToolBinding(frozenset(ids), s.live.pos)
            if data.draw(st.booleans()):
                s.bindings.thinking = ThinkingBinding(normalize(render(convs["chat"]))[:2], cut)

    outcomes = {}
    for api, conv in convs.items():
        view = evidence(conv, api, pool.live_tool_ids())
        if isinstance(view, str):
            outcomes[api] = ("400", view)
            continue
        r = route(view, pool, NoStore())
        if isinstance(r, Rejection):
            outcomes[api] = (r.status, r.message)
        else:
            outcomes[api] = (r.slot, r.decision.source, r.decision.cached, r.decision.suffix_tokens)
    a = outcomes["anthropic"]
    event(str(a[0]) if a[0] in ("400", 409) else a[1].value)  # every path is reached
    for api in ("responses", "chat"):
        o = outcomes[api]
        if a[0] == "400":  # the same unknown id, in the protocol's words
            tid = a[1].split("tool_use_id ")[1].split(";")[0]
            assert o == ("400", unknown_id_message(tid, api))
        elif a[0] == 409:
            assert o == (409, live_gone_message(api))
        else:
            assert o == a
