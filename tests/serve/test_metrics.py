"""`GET /metrics` (issue 25): Prometheus text, scraped and parsed with prometheus_client's
own parser, whose figures match what the responses said — in-process on the tiny engine
(teacher-forced turns), and over a socket against `ds4jax serve` with the trained demo,
which really calls its tools."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx2
import pytest

from ds4jax.demo.corpus import TOOLS as DEMO_TOOLS
from ds4jax.demo.corpus import run_tool
from ds4jax.engine import Engine
from serve.app import ServerConfig
from serve.worker import EngineWorker
from tests.serve.conftest import (
    BASE,
    MODEL,
    NO_THINK,
    ServeProcess,
    force,
    make_app,
    user,
)
from tests.serve.metrics_scrape import Scrape, scrape

#: the issue's list: every one must be exported
REQUIRED = [
    "prompt_tokens_total", "generation_tokens_total", "cached_prompt_tokens_total",
    "prefilled_prompt_tokens_total", "requests_total", "continuation_total",
    "rejected_requests_total", "disk_checkpoint_saves_total", "disk_checkpoint_restores_total",
    "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
    "request_prompt_tokens_bucket", "request_prefilled_tokens_bucket", "requests_running",
    "requests_waiting", "sessions_resident", "fork_points", "batch_rows_active", "state_bytes",
    "state_bytes_limit", "disk_checkpoint_bytes", "model_config_info", "state_restores_total",
    "mixed_steps_total", "mixed_step_prompt_tokens_total",
]  # fmt: skip
SOURCES = ["live_tool_ids", "live_visible", "live_tokens", "live_text", "fork_point", "disk",
           "cold"]  # fmt: skip
P = "ds4jax:"


@pytest.mark.anyio
async def test_metrics_sit_behind_the_api_key_and_name_everything(
    engine: Engine, worker: EngineWorker
) -> None:
    app = make_app(worker, ServerConfig(api_key="k", info={"config": "tiny", "weights": "f32"}))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/health")).status_code == 200  # stays open
        r = await c.get("/metrics", headers={"x-api-key": "k"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = Scrape.parse(r.text)
    missing = [n for n in REQUIRED if P + n not in m.names()]
    assert not missing, missing
    for source in SOURCES:  # every path is a series from the start, at 0
        assert (P + "continuation_total", frozenset({("model_name", MODEL), ("source", source)})
                ) in m.samples  # fmt: skip
    assert m.get(P + "rejected_requests_total", status="401") == 1  # the scrape refused
    info = next(ls for (n, ls) in m.samples if n == P + "model_config_info")
    assert {("config", "tiny"), ("weights", "f32"), ("context", "2048")} <= info
    assert m.get(P + "sessions") == 1 and m.get(P + "batch_rows") == engine.max_batch
    assert m.get(P + "state_bytes_limit") == float("inf")  # the shared engine has no budget
    assert not [n for n in m.names() if n.endswith("_created")]
    # the operators' page documents every family the server exports
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
    undocumented = [f for f in m.families if f"`{f}" not in doc]
    assert not undocumented, undocumented


@pytest.mark.anyio
async def test_figures_match_the_usage_the_responses_report(
    engine: Engine, worker: EngineWorker
) -> None:
    app = make_app(worker)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE)
    client = anthropic.AsyncAnthropic(base_url=BASE, http_client=http, api_key="k",
                                      max_retries=0)  # fmt: skip
    text = lambda: Scrape.parse(app.metrics.render().decode())  # noqa: E731
    before = text()
    kw = dict(model=MODEL, max_tokens=16, thinking=NO_THINK)
    one = await client.messages.create(messages=user("hi"), **kw, extra_body=force("Hello."))
    history = [*user("hi"), {"role": "assistant", "content": "Hello."}, *user("and?")]
    two = await client.messages.create(messages=history, **kw, extra_body=force("More."))
    chunks = []
    async with client.messages.stream(messages=user("a stream"), **kw,
                                      extra_body=force("Streamed text.")) as s:  # fmt: skip
        async for ev in s:
            chunks.append(ev)
        three = await s.get_final_message()
    bad = await http.post("/v1/messages", json={"model": MODEL, "max_tokens": 4,
                                                "messages": []})  # fmt: skip
    await http.aclose()
    assert bad.status_code == 400
    after = text()
    replies = [one, two, three]
    d = lambda name, **kw: after.delta(before, P + name, **kw)  # noqa: E731
    assert two.usage.cache_read_input_tokens > 0  # continued: the live token prefix
    assert d("continuation_total", source="cold") == 2
    assert d("continuation_total", source="live_tokens") == 1
    assert d("continuation_total") == 3
    usage = [r.usage for r in replies]
    cached = sum(u.cache_read_input_tokens for u in usage)
    prefilled = sum(u.input_tokens for u in usage)
    assert d("cached_prompt_tokens_total") == cached
    assert d("prefilled_prompt_tokens_total") == prefilled
    assert d("prompt_tokens_total") == cached + prefilled
    assert d("request_prefilled_tokens_sum") == prefilled
    assert d("request_prompt_tokens_sum") == cached + prefilled
    assert d("generation_tokens_total") == sum(u.output_tokens for u in usage)
    assert d("requests_total", api="messages", finish_reason="end_turn") == 3
    assert d("rejected_requests_total", status="400") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prompt_tokens"):  # fmt: skip
        assert d(h + "_count") == 3, h
    # one gap between each pair of consecutive tokens of a reply
    assert d("inter_token_latency_seconds_count") == sum(u.output_tokens - 1 for u in usage)
    assert d("time_to_first_token_seconds_sum") < d("e2e_request_latency_seconds_sum")
    assert after.get(P + "requests_running") == 0 and after.get(P + "requests_waiting") == 0


# ---------------------------------------------------------------------- `ds4jax serve`


def test_a_tool_loop_shows_as_exactly_its_sources(demo_served: ServeProcess) -> None:
    """A cold first turn, the live tool turn, then a retry of the first turn, which forks
    from its prompt-end state: three decisions, three sources, and the token counters equal
    the usage the three responses reported."""
    client = anthropic.Anthropic(base_url=demo_served.url, api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 200, "tools": DEMO_TOOLS,
          "extra_body": {"temperature": 0}}  # fmt: skip
    before = scrape(demo_served.url)
    messages: list = [{"role": "user", "content": "What is 321 plus 12?"}]
    first = client.messages.create(messages=messages, **kw)
    (call,) = [b for b in first.content if b.type == "tool_use"]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": run_tool(call.name, call.input)}]},
    ]  # fmt: skip
    second = client.messages.create(messages=messages, **kw)
    retry = client.messages.create(messages=messages[:1], **kw)
    after = scrape(demo_served.url)
    d = lambda name, **kw: after.delta(before, P + name, **kw)  # noqa: E731
    assert {s: d("continuation_total", source=s) for s in SOURCES} == {
        "live_tool_ids": 1, "live_visible": 0, "live_tokens": 0, "live_text": 0,
        "fork_point": 1, "disk": 0, "cold": 1}  # fmt: skip
    replies = [first, second, retry]
    assert retry.usage.input_tokens == 0  # the whole prompt came from the fork point
    assert d("cached_prompt_tokens_total") == sum(r.usage.cache_read_input_tokens for r in replies)
    assert d("request_prefilled_tokens_sum") == sum(r.usage.input_tokens for r in replies)
    assert d("request_prefilled_tokens_count") == 3
    # the live tool turn computed only its suffix: at most the 64-token bucket holds it
    assert d("request_prefilled_tokens_bucket", le="50.0") >= 2  # the tool turn, the retry
    assert d("requests_total", api="messages", finish_reason="tool_use") == 2
    assert d("requests_total", api="messages", finish_reason="end_turn") == 1


def test_six_concurrent_streaming_agents_are_each_counted_once(
    demo_served: ServeProcess,
) -> None:
    """Six agents stream a tool loop each at once (twelve streamed requests in batched
    steps): every histogram counts twelve, the token counters equal the usage the streams
    reported, nothing answered 5xx."""

    def agent(n: int) -> list[anthropic.types.Message]:
        client = anthropic.Anthropic(base_url=demo_served.url, api_key="unused", max_retries=0)
        kw = {"model": MODEL, "max_tokens": 200, "tools": DEMO_TOOLS}
        messages: list = [{"role": "user", "content": f"What is {n + 20} plus {3 * n + 1}?"}]
        out = []
        for _ in range(2):
            with client.messages.stream(messages=messages, **kw) as s:
                for _ev in s:
                    pass
                msg = s.get_final_message()
            out.append(msg)
            calls = [b for b in msg.content if b.type == "tool_use"]
            if not calls:
                break
            messages += [
                {"role": "assistant",
                 "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": c.id,
                     "content": run_tool(c.name, c.input)} for c in calls]},
            ]  # fmt: skip
        return out

    before = scrape(demo_served.url)
    with ThreadPoolExecutor(6) as pool:
        replies = [m for out in pool.map(agent, range(6)) for m in out]
    after = scrape(demo_served.url)
    n = len(replies)
    assert n >= 6
    d = lambda name, **kw: after.delta(before, P + name, **kw)  # noqa: E731
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_prompt_tokens", "request_prefilled_tokens",
              "request_generation_tokens"):  # fmt: skip
        assert d(h + "_count") == n, h
    assert d("requests_total") == n and d("continuation_total") == n
    assert d("generation_tokens_total") == sum(m.usage.output_tokens for m in replies)
    prompt = sum(m.usage.input_tokens + m.usage.cache_read_input_tokens for m in replies)
    assert d("prompt_tokens_total") == prompt
    assert d("request_prompt_tokens_sum") == prompt
    assert not [k for k, v in after.samples.items() if k[0] == P + "rejected_requests_total"
                and dict(k[1])["status"].startswith("5") and v]  # fmt: skip
    assert after.get(P + "requests_running") == 0 and after.get(P + "batch_rows_active") == 0
    assert after.get(P + "sessions_resident") == 6


def test_a_request_continued_from_the_host_tier_is_counted_by_tier(worker: EngineWorker) -> None:
    """`state_restores_total{tier}`: the engine marks a result whose base came back from host
    RAM (`Result.restored`, tests/continuation/test_host_tier.py); the observer counts it."""
    from types import SimpleNamespace

    from ds4jax.continuation.types import CacheSource
    from ds4jax.decoding import Result
    from serve.metrics import ServerMetrics

    metrics = ServerMetrics(worker, MODEL, {})
    job = SimpleNamespace(prepared=SimpleNamespace(api="anthropic"), finished=2.0, arrived=1.0,
                          first_event=None, decided=None, submitted=None, first_token=None,
                          last_token=None)  # fmt: skip
    result = Result(CacheSource.LIVE_TOOL, 10, 2, 1, "end_turn", None, [], restored="host")
    before = Scrape.parse(metrics.render().decode()).get(P + "state_restores_total", tier="host")
    metrics.finished(job, result)
    metrics.finished(job, Result(CacheSource.LIVE_TOOL, 10, 2, 1, "end_turn", None, []))
    after = Scrape.parse(metrics.render().decode()).get(P + "state_restores_total", tier="host")
    assert (before, after) == (0, 1)
