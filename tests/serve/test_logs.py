"""The log an operator reads (issue 25): a line per request with its timings, a stats line
while there is work and none when idle, and library chatter kept below INFO."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest

from ds4jax.engine import Engine
from serve import logs
from serve.main import trace_hook
from serve.worker import EngineWorker
from tests.serve.conftest import BASE, MODEL, NO_THINK, ServeProcess, force, make_app, user


def test_no_stats_line_when_idle_and_a_line_of_the_interval_otherwise() -> None:
    idle = logs.Tally(sources=(("cold", 3.0), ("live_tool_ids", 5.0)), sessions=2, slots=4)
    assert logs.stats_line(idle, idle, 10.0) is None
    busy = logs.Tally(
        prompt=1000.0, prefilled=100.0, cached=900.0, generation=50.0,
        sources=(("cold", 4.0), ("live_tool_ids", 7.0)), running=1, waiting=2, sessions=3,
        slots=4, state_bytes=3 * 2**20, state_limit=8 * 2**20,
    )  # fmt: skip
    line = logs.stats_line(idle, busy, 10.0)
    assert line is not None
    for part in ("prompt 100.0 tok/s (prefilled 10.0)", "generation 5.0 tok/s", "running 1",
                 "waiting 2", "sessions 3/4", "state 3.0/8.0 MiB",
                 "reused 90.0% of prompt tokens", "paths cold=1 live_tool_ids=2"):  # fmt: skip
        assert part in line, (part, line)
    # a request still running, no token counted in the interval: still a line
    assert logs.stats_line(busy, busy, 10.0) is not None
    assert "drafts" not in line  # no speculation, no word of it
    spec = logs.Tally(**{**busy.__dict__, "drafts": 40.0, "drafts_kept": 30.0})
    assert logs.stats_line(busy, spec, 10.0).endswith(", drafts kept 30/40 (75%)")


@pytest.mark.anyio
async def test_the_request_line_and_the_stats_of_a_real_request(
    engine: Engine, worker: EngineWorker, tmp_path: Path
) -> None:
    """The log line, the stats line and `--trace`'s record of one request, all naming its
    path alike (the trace said `none` for what the others call `cold`)."""
    app = make_app(worker)
    lines: list[str] = []
    trace = trace_hook(str(tmp_path / "trace.jsonl"), engine.tokenizer)

    def hook(job: Any, result: Any) -> None:
        lines.append(logs.request_line(job, result))
        trace(job, result)

    worker.hooks.append(hook)
    before = logs.Tally.read(app.metrics)
    try:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE)
        async with anthropic.AsyncAnthropic(base_url=BASE, http_client=http, api_key="k",
                                            max_retries=0) as client:  # fmt: skip
            msg = await client.messages.create(
                model=MODEL, max_tokens=8, messages=user("hi"), thinking=NO_THINK,
                extra_body=force("Hi there."),
            )  # fmt: skip
    finally:
        worker.hooks.remove(hook)
    (line,) = lines
    u = msg.usage
    assert line.startswith("request api=messages session=0 source=cold finish=end_turn: ")
    assert f"prompt {u.input_tokens} tokens (cached 0)" in line
    assert f"prefill {u.input_tokens} tokens " in line
    assert f"| eval {u.output_tokens} tokens " in line and "| total " in line
    stats = logs.stats_line(before, logs.Tally.read(app.metrics), 10.0)
    assert stats is not None and "paths cold=1" in stats
    (rec,) = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert rec["source"] == "cold" and rec["finish"] == "end_turn"
    assert rec["prompt_tokens"] == u.input_tokens and rec["output_tokens"] == u.output_tokens
    assert f"generation {u.output_tokens / 10:.1f} tok/s" in stats


def test_library_chatter_stays_below_info(caplog: pytest.LogCaptureFixture) -> None:
    logs.configure("INFO")
    caplog.set_level(logging.INFO)
    absl, probe = logging.getLogger("absl"), logging.getLogger("jax._src.xla_bridge")
    try:
        absl.warning("No jax.Array in TypeHandlerRegistry: ArrayMetadata persistence is disabled.")
        absl.warning("[process=0][thread=x] Skipping merge of OCDBT checkpoints: No subdirs")
        absl.info("[process=0] [sync] Finished save in 0.01 seconds")
        probe.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
        absl.warning("a warning nobody has seen before")
        assert [r.getMessage() for r in caplog.records] == ["a warning nobody has seen before"]
        caplog.clear()
        caplog.set_level(logging.DEBUG)  # --log-level debug: everything, as DEBUG
        absl.warning("[process=0][thread=x] Skipping merge of OCDBT checkpoints: No subdirs")
        assert [r.levelname for r in caplog.records] == ["DEBUG"]
    finally:
        for name in logs.CHATTY:
            for f in [f for f in logging.getLogger(name).filters if isinstance(f, logs._Demote)]:
                logging.getLogger(name).removeFilter(f)


def test_the_served_demo_logs_requests_and_stats_and_no_library_chatter(
    demo_served: ServeProcess,
) -> None:
    client = anthropic.Anthropic(base_url=demo_served.url, api_key="unused", max_retries=0)
    client.messages.create(model=MODEL, max_tokens=40, messages=user("Hello!"))
    deadline = time.monotonic() + 10
    while "ds4jax.serve: stats: " not in demo_served.stderr and time.monotonic() < deadline:
        time.sleep(0.1)
    err = demo_served.stderr
    assert "ds4jax.serve: request api=messages " in err and "ds4jax.serve: stats: " in err
    assert "absl" not in err and "Unable to initialize backend" not in err
    assert err.count("Running on http://") == 1


def test_the_documented_path_names_are_the_labels_the_server_uses() -> None:
    """docs/operating.md maps each decision name (`CacheSource`: the decision log line,
    /health's hits) to its label (/metrics, the request line, the trace): one table, read
    against `SOURCE_LABELS`."""
    import re

    from serve.metrics import SOURCE_LABELS

    doc = (Path(__file__).parents[2] / "docs" / "operating.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^  \| `([a-z-]+)` \| `([a-z_]+)` \|$", doc, re.M))
    assert rows == {k.value: v for k, v in SOURCE_LABELS.items()}
