"""`ds4jax serve` with no model flags serves the trained demo, and its tool loop over HTTP
continues the live state (issue 9's HTTP bar), driven by the official anthropic SDK — also
with six agents at once, each in its own resident session (issue 13)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest

from ds4jax.demo.corpus import TOOLS
from tests.serve.conftest import DEMO_SERVE_ARGS, ServeProcess, take_served

LIVE_LINE = "anthropic live continuation match=tool-output-ids"


@pytest.fixture(scope="module")
def demo_served() -> Iterator[ServeProcess]:
    server = take_served("demo_served") or ServeProcess(*DEMO_SERVE_ARGS, model=())
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_default_model_runs_the_tool_loop_live(demo_served: ServeProcess) -> None:
    assert "the trained demo" in demo_served.stderr and "RANDOM" not in demo_served.stderr
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
    assert u2.cache_read_input_tokens == u1.input_tokens + u1.output_tokens
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
        out.append((second.usage.cache_read_input_tokens, u1.input_tokens + u1.output_tokens,
                    result, text))  # fmt: skip
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
    # The answer reports the tool result it was given. (Whether the call copied the operands
    # right is the demo's accuracy, issue 18's business: it moved with the CPU's numerics.)
    assert sum(result in text for *_, result, text in loops) >= 17, loops
    h = health()
    assert h["sessions"] == 6 and h["sessions_in_use"] == 6
    assert h["hits"]["anthropic-tool-output"] - before == 18
    assert h["state_bytes"] <= h["state_budget_bytes"]
