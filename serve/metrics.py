"""`GET /metrics`: what the server did, in the Prometheus names and shapes operators already
read from vLLM (`vllm:*` → `ds4jax:*`, label `model_name`, counters ending `_total`, token
counts as counters, never a hit-rate gauge) — plus the one thing only ds4jax knows: which
continuation path each request took (`continuation_total{source}`).

Three kinds of figure, each counted in one place:
- per request and per token, on the engine's thread as it happens (`ServerMetrics` is the
  worker's `Observer`): tokens, continuation sources, latencies from the job's timeline;
- errors answered, by HTTP status, in the app (`rejected`): every error response and every
  error event of a stream that had already started — each failed request exactly once;
- state held right now, read at scrape time (`_Snapshot`): queue, sessions, fork points,
  batch rows, state and disk bytes, disk checkpoints written and loaded.

A multi-process group serves HTTP from process 0 only, whose worker sees every request of
the group: its figures are the group's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ds4jax.chat.kinds import Api, Finish
from ds4jax.continuation.types import CacheSource, Decision
from ds4jax.decoding import Result
from ds4jax.engine.requests import Cancelled

# `*_created` samples double every series and no dashboard reads them (vLLM drops them too)
prometheus_client.disable_created_metrics()

PREFIX = "ds4jax:"

#: the `source` label of `continuation_total`: one value per decision the engine makes
SOURCE_LABELS = {
    CacheSource.LIVE_TOOL: "live_tool_ids",
    CacheSource.THINKING_VISIBLE: "live_visible",
    CacheSource.TOKEN_PREFIX: "live_tokens",
    CacheSource.TEXT_PREFIX: "live_text",
    CacheSource.FORK: "fork_point",
    CacheSource.DISK: "disk",
    CacheSource.COLD: "cold",
}
#: the `api` label: the engine's protocol names as operators know the endpoints
API_LABELS = {Api.ANTHROPIC: "messages", Api.RESPONSES: "responses", Api.CHAT: "chat"}
FINISH_REASONS = tuple(Finish)

# vLLM's buckets, with finer ones at the low end: a tiny model on a CPU answers in ms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def token_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to the context (vLLM's series for token counts)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class ServerMetrics:
    """The app's registry (one per app: tests stay hermetic) and the worker's observer."""

    def __init__(self, worker: Any, model_name: str, info: dict[str, str]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, m = self.registry, ["model_name"]
        engine = worker.engine

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*m, *labels], registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            family = Histogram(PREFIX + name, doc, m, buckets=buckets, registry=reg)
            return family.labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of routed requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.cached_tokens = counter(
            "cached_prompt_tokens", "Prompt tokens reused from a stored state (live, fork, disk)."
        )
        self.prefilled_tokens = counter(
            "prefilled_prompt_tokens", "Prompt tokens computed (prefilled)."
        )
        self.requests = counter("requests", "Requests finished, by API and finish reason.",
                                ("api", "finish_reason"))  # fmt: skip
        self.continuation = counter(
            "continuation", "Routing decisions, by the continuation path taken.", ("source",)
        )
        self.rejections = counter("rejected_requests", "Error answers, by HTTP status.",
                                  ("status",))  # fmt: skip
        self.restores = counter("state_restores", "Requests whose base state came back from "
                                "a memory tier before continuing, by tier.", ("tier",))  # fmt: skip
        self.restores.labels(model_name, "host")
        for c in (self.prompt_tokens, self.generation_tokens, self.cached_tokens,
                  self.prefilled_tokens):  # fmt: skip
            c.labels(model_name)
        for source in SOURCE_LABELS.values():  # every path shows, at 0 until taken
            self.continuation.labels(model_name, source)
        for api in API_LABELS.values():
            for reason in FINISH_REASONS:
                self.requests.labels(model_name, api, reason)

        tokens = token_buckets(max(engine.max_len, 16))
        self.ttft = histogram("time_to_first_token_seconds",
                              "From the request's arrival to its first content event.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram(
            "inter_token_latency_seconds", "Between consecutive tokens of a reply.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds",
                             "From the request's arrival to its end.", E2E_BUCKETS)  # fmt: skip
        self.queue_time = histogram("request_queue_time_seconds",
                                    "From queued to routed (its prefill begins).",
                                    E2E_BUCKETS)  # fmt: skip
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "From routed to the prompt's end.", E2E_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "From the first token to the last.", E2E_BUCKETS
        )
        self.request_prompt = histogram(
            "request_prompt_tokens", "Prompt tokens per request (reused + prefilled).", tokens
        )
        self.request_prefilled = histogram(
            "request_prefilled_tokens",
            "Prompt tokens computed per request (a live tool turn: its suffix).",
            tokens,
        )
        self.request_generation = histogram(
            "request_generation_tokens", "Tokens generated per request.", tokens
        )
        Info(PREFIX + "model_config", "The served model and how it is served.", m,
             registry=reg).labels(model_name).info(info)  # fmt: skip
        reg.register(_Snapshot(worker, model_name))

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)

    def rejected(self, status: int) -> None:
        self.rejections.labels(self.model_name, str(status)).inc()

    # -------------------------------------------------------------- the worker's Observer

    def decided(self, job: Any, decision: Decision, prefill: int) -> None:
        m = self.model_name
        self.continuation.labels(m, SOURCE_LABELS[decision.source]).inc()
        self.prompt_tokens.labels(m).inc(decision.cached + prefill)
        self.cached_tokens.labels(m).inc(decision.cached)
        self.prefilled_tokens.labels(m).inc(prefill)

    def token(self, job: Any, gap: float | None) -> None:
        self.generation_tokens.labels(self.model_name).inc()
        if gap is not None:
            self.itl.observe(gap)

    def finished(self, job: Any, result: Any) -> None:
        """A request's end: its histograms once, if the engine served it (a refused one is
        counted by `rejected`, in the app)."""
        if isinstance(result, Exception):
            if isinstance(result, Cancelled):  # its client left while it was queued
                self.requests.labels(self.model_name, _api(job), Finish.CANCELLED).inc()
            return
        assert isinstance(result, Result)
        self.requests.labels(self.model_name, _api(job), result.finish).inc()
        if result.restored:
            self.restores.labels(self.model_name, result.restored).inc()
        self.e2e.observe(job.finished - job.arrived)
        if job.first_event is not None:
            self.ttft.observe(job.first_event - job.arrived)
        if job.decided is not None and job.submitted is not None:
            self.queue_time.observe(max(0.0, job.decided - job.submitted))
        self.prefill_time.observe(result.prefill_seconds)
        if job.first_token is not None and job.last_token is not None:
            self.decode_time.observe(job.last_token - job.first_token)
        self.request_prompt.observe(result.prompt_tokens)
        self.request_prefilled.observe(result.prefilled)
        self.request_generation.observe(result.output_tokens)


def _api(job: Any) -> str:
    return API_LABELS.get(job.prepared.api, job.prepared.api)


class _Snapshot:
    """Gauges (and the disk store's and the scheduler's own counters) read when scraped:
    what the engine holds now, never a copy that could go stale."""

    def __init__(self, worker: Any, model_name: str) -> None:
        self.worker = worker
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        worker = self.worker
        engine = worker.engine
        stats = engine.stats()
        store = engine.store
        budget = stats["state_budget_bytes"]
        waiting = worker.waiting
        values = {
            "requests_running": max(0, worker.depth - waiting),
            "requests_waiting": waiting,
            "sessions_resident": stats["sessions_in_use"],
            "sessions": stats["sessions"],
            "fork_points": stats["fork_points"],
            "batch_rows_active": engine.rows_active,
            "batch_rows": engine.max_batch,
            "state_bytes": stats["state_bytes"],
            "state_bytes_limit": math.inf if budget is None else budget,
            "disk_checkpoint_bytes": _disk_bytes(store),
        }
        counts = {
            "disk_checkpoint_saves": getattr(store, "saved", 0),
            "disk_checkpoint_restores": getattr(store, "restored", 0),
            "disk_checkpoint_save_failures": getattr(store, "failed", 0),
            "mixed_steps": engine.mixed_steps,
            "mixed_step_prompt_tokens": engine.mixed_prompt_tokens,
            "decode_bursts": engine.bursts,
        }
        yield from self._families(values, counts)
        yield from self._shard_families(engine)
        yield from self._spec_families(engine)

    def describe(self) -> list[Metric]:  # the registry need not collect to learn the names
        return [*self._families(), *self._shard_families(None), *self._spec_families(None)]

    def _spec_families(self, engine: Any) -> Iterator[Metric]:
        """Speculative decoding (`--speculative mtp`, issue 29): steps, and drafts proposed
        and kept by draft position (1: the token after the row's next; the block drafts
        one). No samples without speculation."""
        spec = None if engine is None else engine.spec
        c = CounterMetricFamily(PREFIX + "speculative_steps", SPEC_STEPS, labels=["model_name"])
        if spec is not None:
            c.add_metric([self.model_name], spec.counts.steps)
        yield c
        for name, doc in SPEC_DRAFTS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "position"])
            if spec is not None:
                n = spec.counts.proposed if name == "speculative_drafts" else spec.counts.accepted
                c.add_metric([self.model_name, "1"], n)
            yield c

    def _shard_families(self, engine: Any) -> Iterator[Metric]:
        """The page pool per data shard (issue 28): pages and device bytes each shard's
        block holds, and prompts moved to another shard than their base's. One shard, the
        whole pool, without a data axis; no samples without a page pool."""
        pages = None if engine is None else engine.pages
        for name, doc in SHARD_GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "shard"])
            if pages is not None:
                pool = pages.pool
                for shard in range(pool.shards):
                    used = pool.block - 1 - pool.free_in(shard)
                    value = used if name == "page_shard_pages_used" else used * pages.page_nbytes
                    g.add_metric([self.model_name, str(shard)], value)
            yield g
        c = CounterMetricFamily(PREFIX + "page_shard_moves", SHARD_MOVES, labels=["model_name"])
        if engine is not None:
            c.add_metric([self.model_name], engine.shard_moves)
        yield c

    def _families(
        self, values: dict[str, float] | None = None, counts: dict[str, int] | None = None
    ) -> Iterator[Metric]:
        for name, doc in GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            if values is not None:
                g.add_metric([self.model_name], values[name])
            yield g
        for name, doc in STORE_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            if counts is not None:
                c.add_metric([self.model_name], counts[name])
            yield c


def _disk_bytes(store: Any) -> int:
    total = getattr(store, "total_bytes", None)
    return total() if callable(total) else 0


GAUGES = {
    "requests_running": "Requests handed to the engine: prefilling or decoding.",
    "requests_waiting": "Requests not started: queued, or waiting for a batch row.",
    "sessions_resident": "Sessions holding a live frontier.",
    "sessions": "Session slots (--sessions).",
    "fork_points": "Retained prompt-end states a request can fork from.",
    "batch_rows_active": "Rows of the decode batch serving a request.",
    "batch_rows": "Rows of the decode batch (--max-batch).",
    "state_bytes": "Device bytes held by retained states (sessions, fork points).",
    "state_bytes_limit": "The state budget in bytes.",
    "disk_checkpoint_bytes": "Bytes of disk checkpoints in --kv-disk-dir.",
}
STORE_COUNTERS = {
    "disk_checkpoint_saves": "Disk checkpoints written.",
    "disk_checkpoint_restores": "Disk checkpoints loaded into a session.",
    "disk_checkpoint_save_failures": "Disk checkpoint saves that failed (disk full, "
    "permissions; the log says why): serving goes on without them.",
    "mixed_steps": "Decode steps a prompt's chunk rode in (--stall-bound).",
    "mixed_step_prompt_tokens": "Prompt tokens evaluated inside decode steps (--stall-bound).",
    "decode_bursts": "Decode programs that took up to --burst tokens per row (the rows only "
    "sampled, nothing waited or prefilled).",
}
SHARD_GAUGES = {
    "page_shard_pages_used": "Pages held in each data shard's block of the page pool "
    "(serve --paged on a mesh with a data axis; shard 0 is the whole pool otherwise).",
    "page_shard_bytes": "Device bytes of the pages each data shard's block holds: what each "
    "of that shard's devices holds of the retained states' pages.",
}
SPEC_STEPS = "Speculative decode steps (--speculative mtp)."
SPEC_DRAFTS = {
    "speculative_drafts": "Drafts the MTP block proposed and a step verified.",
    "speculative_drafts_accepted": "Drafts kept: the model drew the drafted token.",
}
SHARD_MOVES = "Prompts kept on another data shard than their base's (its pages written again)."
