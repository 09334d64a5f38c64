"""Responses and Chat Completions bodies → the neutral conversation, without a model; and
the reasoning seal."""

from __future__ import annotations

import pytest

from ds4jax.chat.anthropic import RequestError
from ds4jax.chat.chat_completions import parse_chat_request
from ds4jax.chat.render import render_text
from ds4jax.chat.responses import parse_responses_request
from ds4jax.continuation.reasoning_seal import KEY_FILE, ReasoningSeal

FN = {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}
CODEX_TOOLS = [
    FN,
    {"type": "namespace", "name": "multi_agent_v1.",
     "tools": [{"type": "function", "name": "spawn_agent", "description": "spawn",
                "parameters": {"type": "object"}}]},
    {"type": "web_search"},
]  # fmt: skip


def test_codex_shaped_body_renders_like_the_anthropic_one() -> None:
    body = {
        "model": "deepseek-v4-flash",
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "base prompt"}]},
            {"type": "message", "role": "developer", "content": "permissions"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
             "arguments": '{"cmd":"ls"}', "status": "completed"},
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_1",
             "output": "a.txt"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"x": 1},
    }  # fmt: skip
    r = parse_responses_request(body)
    conv = r.request.conversation
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "user"]
    assert conv.messages[0].content == "base prompt\n\npermissions"
    names = [t.name for t in conv.messages[0].tools]
    assert names == ["exec_command", "multi_agent_v1.spawn_agent"]  # web_search left out
    assert r.namespaced == {"multi_agent_v1.spawn_agent": ("multi_agent_v1.", "spawn_agent")}
    a = conv.messages[2]
    assert a.reasoning == "think" and a.tool_calls[0].arguments == {"cmd": "ls"}
    assert conv.messages[3].blocks[0].tool_use_id == "call_1"
    assert r.summary and r.cache_key == "thread-1" and r.request.stream
    assert r.request.max_tokens is None and conv.thinking

    anthropic_text = render_text(conv)
    assert "<tool_result>a.txt</tool_result>" in anthropic_text
    assert anthropic_text.endswith("<｜Assistant｜><think>")


def test_reasoning_item_prefers_an_authentic_seal() -> None:
    seal = ReasoningSeal.fresh()
    item = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}],
            "encrypted_content": seal.seal("the exact reasoning")}  # fmt: skip
    body = {"input": [{"role": "user", "content": "q"}, item, {"role": "assistant",
                                                               "content": "a"}]}  # fmt: skip
    conv = parse_responses_request(body, unseal=seal.open).request.conversation
    assert conv.messages[-1].reasoning == "the exact reasoning"
    other = ReasoningSeal.fresh()  # a stale key: the summary stands in
    conv = parse_responses_request(body, unseal=other.open).request.conversation
    assert conv.messages[-1].reasoning == "short"


def test_seal_round_trip_and_forgeries(tmp_path) -> None:
    a = ReasoningSeal.in_dir(tmp_path)
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    b = ReasoningSeal.in_dir(tmp_path)  # the same key after a restart
    sealed = a.seal("réflexion ✓")
    assert b.open(sealed) == "réflexion ✓"
    assert ReasoningSeal.fresh().open(sealed) is None
    for bad in (sealed[:-2] + "xx", "ds4jax.r1.!!!", "", "gAAAA-openai-blob", sealed[:20]):
        assert a.open(bad) is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": []}, "input: List should have at least 1 item after validation, not 0"),
        ({"input": "x", "previous_response_id": "r"},
         "previous_response_id is not supported; replay full input instead"),
        ({"input": "x", "conversation": {"id": "c"}},
         "conversation is not supported; replay full input instead"),
        ({"input": [{"type": "item_reference", "id": "x"}]},
         "input[0].type: unsupported input item type 'item_reference'"),
        ({"input": "x", "tools": [FN], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name: no tool named 'nope'"),
        ({"input": [{"role": "tool", "content": "x"}]},
         "input[0].role: Input should be 'user', 'system', 'developer' or 'assistant'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0]: input_image input is not supported: DeepSeek V4 reads text only"),
        ({"input": "x", "tools": [{"type": "browser"}]},
         "tools[0].type: unsupported tool type 'browser'"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id: must be a non-empty string"),
    ],
)  # fmt: skip
def test_responses_refusals(body: dict, message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_responses_request(body)
    assert info.value.message == message and info.value.status == 400


def test_responses_controls() -> None:
    r = parse_responses_request({"input": "x", "tools": [FN], "tool_choice": "required",
                                 "parallel_tool_calls": False, "reasoning": {"effort": "none"},
                                 "max_output_tokens": 7})  # fmt: skip
    req = r.request
    assert req.tool_choice == {"type": "any", "disable_parallel_tool_use": True}
    assert not req.conversation.thinking and req.max_tokens == 7 and not r.summary
    none = parse_responses_request({"input": "x", "tools": [FN], "tool_choice": "none"}).request
    assert none.tool_choice is None and not none.conversation.messages[0].tools


def test_chat_request() -> None:
    body = {
        "model": "deepseek-v4-flash",
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None, "reasoning_content": "r",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "2"},
            {"role": "system", "content": "late"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "max_completion_tokens": 9, "stop": "END", "seed": 3, "think": False,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    c = parse_chat_request(body)
    conv = c.request.conversation
    assert [m.role for m in conv.messages] == [
        "system", "user", "assistant", "user", "latest_reminder"]  # fmt: skip
    assert conv.messages[1].blocks[0].text == "hi\n\nthere"
    assert conv.messages[2].tool_calls[0].arguments == {"a": 1}
    assert c.include_usage and c.request.max_tokens == 9 and c.request.stop_sequences == ["END"]
    assert not conv.thinking
    with pytest.raises(RequestError, match=r"^messages: List should have at least 1 item"):
        parse_chat_request({"messages": []})
