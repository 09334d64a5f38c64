"""Validation and mapping of Anthropic Messages bodies: bad input is a clear 400."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4jax.chat.anthropic import RequestError, parse_messages_request

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ([], "request body"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": USER, "tools": [{"name": "t"}]}, "tools[0].input_schema"),
        ({"messages": USER, "tools": {"name": "t"}}, "tools"),
        ({"messages": USER, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"messages": USER, "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"messages": USER, "output_config": {"effort": "banana"}}, "effort"),
        ({"messages": USER, "max_tokens": "10"}, "max_tokens"),
        ({"messages": USER, "max_tokens": -1}, "max_tokens"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "tool_use_id",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "x"}]}]},
            "messages[0].content[0].id",
        ),
    ],
)
def test_bad_requests_name_the_offending_field(body: Any, where: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_messages_request(body)
    assert where in info.value.message
    err = info.value.body()
    assert err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert info.value.status == 400


def test_thinking_controls() -> None:
    def mode(**kw: Any) -> tuple[bool, bool]:
        conv = parse_messages_request({"messages": USER, **kw}).conversation
        return conv.thinking, conv.think_max

    assert mode() == (True, False)
    assert mode(thinking={"type": "disabled", "budget_tokens": 1024}) == (False, False)
    assert mode(thinking={"type": "adaptive"}) == (True, False)
    assert mode(thinking=True) == (True, False)
    assert mode(output_config={"effort": "max", "other": True}) == (True, True)
    assert mode(output_config={"effort": "xhigh"}) == (True, False)
    assert mode(output_config={"effort": "none"}) == (False, False)
    assert mode(model="deepseek-chat") == (False, False)
    assert mode(model="deepseek-chat", thinking={"type": "enabled"}) == (True, False)
    req = parse_messages_request(
        {"messages": USER, "thinking": {"type": "enabled", "budget_tokens": 64}}
    )
    assert req.thinking_budget == 64


def test_claude_code_shapes_are_accepted() -> None:
    body = {
        "model": "claude-sonnet",
        "max_tokens": 32000,
        "stream": True,
        "metadata": {"user_id": '{"session": "x"}'},
        "context_management": {"edits": [{"type": "clear_thinking"}]},
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "tools": [
            {
                "name": "Bash",
                "description": "run",
                "input_schema": {"type": "object"},
                "cache_control": {"type": "ephemeral"},
            }
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stop_sequences": ["END", ""],
    }
    req = parse_messages_request(body)
    assert req.stream and req.max_tokens == 32000 and req.stop_sequences == ["END"]
    assert req.conversation.messages[0].tools[0].as_official() == {
        "name": "Bash",
        "description": "run",
        "parameters": {"type": "object"},
    }


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["messages", "system", "tools", "tool_choice", "thinking", "max_tokens", "model"]
        ),
        json_values,
    )
)
def test_arbitrary_json_is_accepted_or_rejected_cleanly(body: dict) -> None:
    try:
        parse_messages_request(body)
    except RequestError:
        pass


blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "document"])},
    optional={
        "text": json_values,
        "id": json_values,
        "name": json_values,
        "input": json_values,
        "tool_use_id": json_values,
        "content": json_values | st.lists(st.fixed_dictionaries({"type": st.just("text")})),
        "thinking": json_values,
        "is_error": st.booleans(),
        "source": json_values,
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "ctx", "tool"])},
        optional={"content": st.text(max_size=5) | st.lists(blocks, max_size=3) | json_values},
    ),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_arbitrary_message_structures_render_or_are_rejected_cleanly(msgs: list) -> None:
    from ds4jax.chat.render import render_text

    try:
        req = parse_messages_request({"messages": msgs})
    except RequestError:
        return
    assert render_text(req.conversation).startswith("<｜begin▁of▁sentence｜>")
