"""`ds4jax serve` with no model flags serves the trained demo, and its tool loop over HTTP
continues the live state (issue 9's HTTP bar), driven by the official anthropic SDK — also
with six agents at once, each in its own resident session (issue 13)."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai

from ds4jax.demo.corpus import TOOLS, run_tool
from tests.serve.conftest import ServeProcess

LIVE_LINE = "anthropic live continuation match=tool-output-ids"


def test_default_model_runs_the_tool_loop_live(demo_served: ServeProcess) -> None:
    assert "the trained demo" in demo_served.stderr and "RANDOM" not in demo_served.stderr
    assert "in pages (" in demo_served.stderr  # the demo server keeps paged frontiers
    client = anthropic.Anthropic(base_url=demo_served.url, api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": "What is 123 plus 456?"}]
    kw = {"model": "deepseek-v4-flash", "max_tokens": 200, "tools": TOOLS}
    first = client.messages.create(messages=messages, **kw)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(calls) == 1, first.content
    assert calls[0].name == "add" and calls[0].input == {"a": 123, "b": 456}

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id, "content": "579"}
        ]},
    ]  # fmt: skip
    second = client.messages.create(messages=messages, **kw)
    text = "".join(b.text for b in second.content if b.type == "text")
    assert "579" in text and second.stop_reason == "end_turn"
    u1, u2 = first.usage, second.usage
    # the whole call turn (its prompt, from cache or not, and its output) was live
    prompt1 = u1.input_tokens + u1.cache_read_input_tokens
    assert u2.cache_read_input_tokens == prompt1 + u1.output_tokens
    deadline = time.monotonic() + 5
    while LIVE_LINE not in demo_served.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    assert LIVE_LINE in demo_served.stderr


def agent(url: str, n: int) -> list[tuple[int, int, str, str]]:
    """One agent's three `add` loops (the demo model was trained on one loop per
    conversation, so each loop is a new one); per loop (cache_read of the tool-result turn,
    input + output of the call turn, the tool result sent, the answer)."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kw = {"model": "deepseek-v4-flash", "max_tokens": 200, "tools": TOOLS}
    out = []
    for k in range(3):
        a, b = 10 * n + k + 1, 7 * n + 3
        messages: list = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        first = client.messages.create(messages=messages, **kw)
        calls = [c for c in first.content if c.type == "tool_use"]
        assert len(calls) == 1, first.content
        blocks = [c.model_dump(exclude_none=True) for c in first.content]
        result = str(sum(calls[0].input.values()))
        messages += [
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": result}
            ]},
        ]  # fmt: skip
        second = client.messages.create(messages=messages, **kw)
        text = "".join(c.text for c in second.content if c.type == "text")
        u1 = first.usage
        call_turn = u1.input_tokens + u1.cache_read_input_tokens + u1.output_tokens
        out.append((second.usage.cache_read_input_tokens, call_turn, result, text))
    return out


def test_six_concurrent_agents_each_continue_live(demo_served: ServeProcess) -> None:
    def health() -> dict:
        with urllib.request.urlopen(demo_served.url + "/health") as r:
            return json.load(r)

    before = health()["hits"]["anthropic-tool-output"]
    with ThreadPoolExecutor(6) as pool:
        loops = [loop for out in pool.map(lambda n: agent(demo_served.url, n), range(6))
                 for loop in out]  # fmt: skip
    assert len(loops) == 18
    for cache_read, call_turn, _, _ in loops:  # every tool-result turn continued live
        assert cache_read == call_turn
    # Every loop ends in an answer. Its accuracy is not asserted here: which requests share
    # a batched step depends on timing, the step's float rounding on the batch size, and
    # the small demo model's greedy choice flips on near-ties (a CI run scored 14/18 on the
    # operands, another 16/18 on echoing the result, a local one 18/18). The demo's accuracy
    # is measured one request at a time (test_default_model_runs_the_tool_loop_live, the
    # demo tests).
    assert all(text.strip() for *_, text in loops), loops
    h = health()
    assert h["sessions"] == 6 and h["sessions_in_use"] == 6
    assert h["hits"]["anthropic-tool-output"] - before == 18
    assert h["state_bytes"] <= h["state_budget_bytes"]


def test_demo_answers_its_two_tools_through_the_openai_apis(demo_served: ServeProcess) -> None:
    """Over the socket with the official openai SDK: `add` through Responses (Codex's way:
    store false, full replay, reasoning items sent back), `get_weather` through a streamed
    Chat Completions loop; each tool turn continues the live state by call id."""
    client = openai.OpenAI(base_url=demo_served.url + "/v1", api_key="unused", max_retries=0)
    fns = [{"type": "function", "name": t["name"], "description": t["description"],
            "parameters": t["input_schema"]} for t in TOOLS]  # fmt: skip
    inp: list = [{"role": "user", "content": "What is 123 plus 456?"}]
    kw = {"model": "deepseek-v4-flash", "tools": fns, "store": False, "max_output_tokens": 200}
    first = client.responses.create(input=inp, **kw)
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add", first.output
    assert json.loads(calls[0].arguments) == {"a": 123, "b": 456}
    back = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "579"}
    inp += [*(i.model_dump(exclude_none=True) for i in first.output), back]
    second = client.responses.create(input=inp, **kw)
    assert "579" in second.output_text and second.status == "completed"
    reused = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens == reused

    chat_tools = [{"type": "function", "function": {k: v for k, v in f.items() if k != "type"}}
                  for f in fns]  # fmt: skip
    msgs: list = [{"role": "user", "content": "What's the weather in Paris?"}]
    one = client.chat.completions.create(model="deepseek-v4-flash", messages=msgs,
                                         tools=chat_tools, max_tokens=200)  # fmt: skip
    call = one.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"}  # fmt: skip
    report = run_tool("get_weather", {"city": "Paris"})
    msgs += [one.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": report}]  # fmt: skip
    chunks = list(client.chat.completions.create(
        model="deepseek-v4-flash", messages=msgs, tools=chat_tools, max_tokens=200,
        stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert report in text, text
    reused = one.usage.prompt_tokens + one.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == reused
    deadline = time.monotonic() + 5
    lines = ("responses live continuation match=tool-output-ids ids=1",
             "chat live continuation match=tool-output-ids ids=1")  # fmt: skip
    while not all(x in demo_served.stderr for x in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(x in demo_served.stderr for x in lines)


def test_demo_makes_two_calls_in_one_turn_and_takes_a_follow_up(
    demo_served: ServeProcess,
) -> None:
    """Issue 18 over HTTP: two calls in one assistant turn, answered by two tool_results
    that continue the live state (`ids=2` in the log), then a follow-up round that calls
    again — docs/demo-model.md's example, greedy (the quality bars are measured greedy)."""
    client = anthropic.Anthropic(base_url=demo_served.url, api_key="unused", max_retries=0)
    kw = {"model": "deepseek-v4-flash", "max_tokens": 200, "tools": TOOLS,
          "extra_body": {"temperature": 0}}  # fmt: skip
    messages: list = [{"role": "user", "content": "What's the weather in Paris and in Oslo?"}]
    first = client.messages.create(messages=messages, **kw)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert sorted(c.input["city"] for c in calls) == ["Oslo", "Paris"], first.content
    assert len({c.id for c in calls}) == 2 and first.stop_reason == "tool_use"
    results = {c.id: run_tool(c.name, c.input) for c in calls}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": i, "content": r} for i, r in results.items()
        ]},
    ]  # fmt: skip
    second = client.messages.create(messages=messages, **kw)
    text = "".join(b.text for b in second.content if b.type == "text")
    assert all(r in text for r in results.values()), text
    u1 = first.usage
    assert second.usage.cache_read_input_tokens == (
        u1.input_tokens + u1.cache_read_input_tokens + u1.output_tokens
    )
    deadline = time.monotonic() + 5
    while f"{LIVE_LINE} ids=2" not in demo_served.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"{LIVE_LINE} ids=2" in demo_served.stderr

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in second.content]},
        {"role": "user", "content": "And in Tokyo?"},
    ]
    third = client.messages.create(messages=messages, **kw)
    calls = [b for b in third.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("get_weather", {"city": "Tokyo"})], third.content
