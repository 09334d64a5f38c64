"""`ds4jax serve` with no model flags serves the trained demo, and its tool loop over HTTP
continues the live state (issue 9's HTTP bar), driven by the official anthropic SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anthropic
import pytest

from ds4jax.demo.corpus import TOOLS
from tests.serve.conftest import ServeProcess, take_served

LIVE_LINE = "anthropic live continuation match=tool-output-ids"


@pytest.fixture(scope="module")
def demo_served() -> Iterator[ServeProcess]:
    server = take_served("demo_served") or ServeProcess(model=())
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
