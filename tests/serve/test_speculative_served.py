"""`ds4jax serve --speculative mtp` on the trained demo (issue 29), over real sockets with the
official SDKs: the tool loops of all three APIs come out as from the server without
speculation (content and usage; the tool turns continue live), a streamed reply is the
non-streamed one, and /metrics and the stats line show the drafts, most of them kept."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import anthropic
import openai

from ds4jax.demo.corpus import TOOLS, run_tool
from tests.serve.conftest import ServeProcess
from tests.serve.test_multihost import tool_loop


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))  # fmt: skip


def chat_loop(url: str) -> list[Any]:
    """A Chat Completions tool loop (get_weather), greedy: each turn's message and usage."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}}
             for t in TOOLS]  # fmt: skip
    msgs: list = [{"role": "user", "content": "What's the weather in Oslo?"}]
    kw = {"model": "deepseek-v4-flash", "tools": tools, "max_tokens": 200, "temperature": 0.0}
    one = client.chat.completions.create(messages=msgs, **kw)
    call = one.choices[0].message.tool_calls[0]
    msgs += [one.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id,
              "content": run_tool(call.function.name, {"city": "Oslo"})}]  # fmt: skip
    two = client.chat.completions.create(messages=msgs, **kw)
    return [(call.function.name, call.function.arguments, one.usage.completion_tokens),
            (two.choices[0].message.content, two.usage.prompt_tokens,
             two.usage.prompt_tokens_details.cached_tokens)]  # fmt: skip


def responses_turn(url: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="deepseek-v4-flash", input="Hello, who are you?",
                                store=False, max_output_tokens=120, temperature=0.0)  # fmt: skip
    return r.output_text, r.usage.output_tokens


def test_speculative_serving_equals_plain_serving(spec_served: ServeProcess,
                                                  demo_served: ServeProcess) -> None:  # fmt: skip
    assert "speculative (MTP) in steps of up to 2 rows" in spec_served.stderr
    drafts0 = metric(spec_served.url, "ds4jax:speculative_drafts_total")
    for question in ("What is 123 plus 456?", "What's the weather in Lima?"):
        got = tool_loop(spec_served.url, question)
        want = tool_loop(demo_served.url, question)
        assert [{**t, "usage": t["usage"][:2]} for t in got] == [
            {**t, "usage": t["usage"][:2]} for t in want
        ]
        assert got[1]["usage"][2] == sum(got[0]["usage"][:2])  # the tool turn was live
    assert chat_loop(spec_served.url) == chat_loop(demo_served.url)
    assert responses_turn(spec_served.url) == responses_turn(demo_served.url)
    drafts = metric(spec_served.url, "ds4jax:speculative_drafts_total") - drafts0
    kept = metric(spec_served.url, "ds4jax:speculative_drafts_accepted_total")
    assert drafts > 50 and kept > 0.6 * drafts, (drafts, kept)
    deadline = time.monotonic() + 5
    while "drafts kept" not in spec_served.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "drafts kept" in spec_served.stderr


def test_a_streamed_speculative_reply_is_the_whole_one(spec_served: ServeProcess) -> None:
    client = anthropic.Anthropic(base_url=spec_served.url, api_key="unused", max_retries=0)
    kw = {"model": "deepseek-v4-flash", "max_tokens": 200, "tools": TOOLS,
          "messages": [{"role": "user", "content": "What is 7 plus 8?"}],
          "extra_body": {"temperature": 0.0}}  # fmt: skip
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        deltas = sum(1 for ev in stream if ev.type == "content_block_delta")
        final = stream.get_final_message()
    strip = lambda m: [b.model_dump(exclude={"id"}, exclude_none=True) for b in m.content]  # noqa: E731
    assert strip(final) == strip(whole) and deltas > 3
    assert final.usage.output_tokens == whole.usage.output_tokens
    hot = client.messages.create(**{**kw, "extra_body": {"temperature": 1.0}})
    assert hot.stop_reason in ("tool_use", "end_turn", "max_tokens") and hot.content
