"""What `/metrics` costs, side by side in one run (issue 25).

* **Decode overhead.** Streams decode through the server's own worker (`serve.worker`, jobs
  posting to a live asyncio loop, the batched step) with the app's `ServerMetrics` watching
  the jobs and without it, alternated round by round (on, off, off, on, …); reported:
  aggregate decode tokens/s of each (median of the rounds) and their ratio. The jobs'
  timeline is kept either way (it is part of the worker); what is compared is the observer:
  counters, histograms per token.
  Round-to-round noise on 2 cores is several percent, so the observer's own time per token
  and per request is also timed apart (`worker._tell` in a loop) and set against a token's.
* **Scrape cost.** `render()` of the registry (every family, the gauges read from the engine
  under its lock) with 8 sessions resident: median and max milliseconds over repeated
  scrapes, and the bytes of one scrape.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import threading
import time
from datetime import datetime
from typing import Any

from bench.report import write_json

STREAMS = 8


def _worker() -> Any:
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.model.params import init_params
    from serve.worker import EngineWorker

    cfg = load_config("tiny")
    engine = Engine(cfg, init_params(cfg, 0), V4Tokenizer(), max_len=2048, sessions=STREAMS,
                    fork_points=True, max_batch=STREAMS)  # fmt: skip
    engine.warm_up()
    worker = EngineWorker(engine, max_queue=64)
    worker.start()
    return worker


def _observer_cost(worker: Any, job: Any, result: Any, n: int) -> dict[str, float]:
    """Microseconds the worker spends telling its observers, per token and per request (a
    decision and an end): the part of a step the metrics add, timed apart from the step's
    own noise."""
    from ds4jax.continuation.types import CacheSource, Decision

    decision = Decision(CacheSource.COLD, ())
    t = time.perf_counter()
    for _ in range(n):
        worker._tell("token", job, 0.002)
    token_us = 1e6 * (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n // 10):
        worker._tell("decided", job, decision, 16)
        worker._tell("finished", job, result)
    request_us = 1e6 * (time.perf_counter() - t) / (n // 10)
    return {"token_us": round(token_us, 3), "request_us": round(request_us, 2)}


def _round(worker: Any, loop: asyncio.AbstractEventLoop, streams: int, tokens: int) -> float:
    """Decode tokens/s of `streams` requests of `tokens` greedy tokens each, from the first
    token of any to the last of all."""
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.engine import SamplingParams
    from serve.worker import Job

    engine = worker.engine
    engine.reset()
    jobs = []
    for i in range(streams):
        body = {"messages": [{"role": "user", "content": f"Stream {i}: keep talking."}],
                "thinking": {"type": "disabled"}}  # fmt: skip
        prepared = engine.prepare_request(parse_messages_request(body), max_tokens=tokens,
                                          sampling=SamplingParams(temperature=0.0))  # fmt: skip
        jobs.append(Job(prepared, loop))
    for job in jobs:
        worker.submit(job)
    deadline = time.monotonic() + 300
    while not all(j.finished for j in jobs):
        assert time.monotonic() < deadline, "the bench's streams never finished"
        time.sleep(0.002)
    first = min(j.first_token for j in jobs)
    last = max(j.last_token for j in jobs)
    return sum(j.tokens for j in jobs) / (last - first)


def main(quick: bool = False) -> dict[str, Any]:
    from serve.metrics import ServerMetrics

    loop = asyncio.new_event_loop()  # the jobs' events land here, as on a server
    threading.Thread(target=loop.run_forever, daemon=True).start()
    worker = _worker()
    rounds, tokens = (2, 32) if quick else (10, 128)
    _round(worker, loop, STREAMS, 8)  # every program compiled before timing
    on: list[float] = []
    off: list[float] = []
    metrics = None
    print(f"-- decode of {STREAMS} streams x {tokens} tokens (tiny), metrics on / off "
          f"alternated (ABBA), {rounds} rounds each", flush=True)  # fmt: skip
    for r in range(2 * rounds):
        watching = r % 4 in (0, 3)  # on, off, off, on, …: a drift in time cancels out
        if watching:
            metrics = ServerMetrics(worker, "bench", {})
            worker.watch(metrics)
        else:
            metrics = None  # the worker holds observers weakly: this one is gone
            gc.collect()
        (on if watching else off).append(_round(worker, loop, STREAMS, tokens))
    on_tps, off_tps = statistics.median(on), statistics.median(off)
    print(f"   metrics on {on_tps:.1f} tok/s, off {off_tps:.1f} tok/s: on/off "
          f"{on_tps / off_tps:.4f}", flush=True)  # fmt: skip

    metrics = ServerMetrics(worker, "bench", {})
    worker.watch(metrics)
    ended: list[tuple[Any, Any]] = []
    worker.hooks.append(lambda job, result: ended.append((job, result)))
    _round(worker, loop, STREAMS, 16)  # 8 sessions resident, every histogram filled
    cost = _observer_cost(worker, *ended[0], 20_000 if quick else 200_000)
    share = cost["token_us"] * 1e-6 * off_tps  # of each token's wall time at the off rate
    print(f"   the observer itself: {cost['token_us']:.2f} us per token, "
          f"{cost['request_us']:.1f} us per request = {share:.3%} of a token at "
          f"{off_tps:.0f} tok/s", flush=True)  # fmt: skip
    stats = worker.engine.stats()
    n = 20 if quick else 200
    times = []
    for _ in range(n):
        t = time.perf_counter()
        text = metrics.render()
        times.append(1e3 * (time.perf_counter() - t))
    scrape = {"sessions_resident": stats["sessions_in_use"], "fork_points": stats["fork_points"],
              "scrapes": n, "median_ms": round(statistics.median(times), 3),
              "max_ms": round(max(times), 3), "bytes": len(text)}  # fmt: skip
    print(f"-- scrape with {scrape['sessions_resident']} sessions resident: median "
          f"{scrape['median_ms']} ms, max {scrape['max_ms']} ms, {len(text)} bytes",
          flush=True)  # fmt: skip
    worker.stop()
    loop.call_soon_threadsafe(loop.stop)
    decode = {"streams": STREAMS, "tokens_each": tokens, "rounds": rounds, **cost,
              "observer_share_of_token": round(share, 6),
              "metrics_on_tok_s": [round(x, 2) for x in on],
              "metrics_off_tok_s": [round(x, 2) for x in off],
              "on_median_tok_s": round(on_tps, 2), "off_median_tok_s": round(off_tps, 2),
              "on_over_off": round(on_tps / off_tps, 4)}  # fmt: skip
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick,
           "decode": decode, "scrape": scrape}  # fmt: skip
    write_json("metrics", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
