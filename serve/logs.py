"""What `ds4jax serve` writes to its log, in the forms operators already read: one line per
request with llama.cpp's timings (prompt eval, eval, total), and every 10 s while there is
work a stats line like vLLM's — throughput, queue, sessions, state memory, the share of
prompt tokens reused and the continuation paths of the interval. Nothing when idle.

Library chatter stays below INFO unless `--log-level debug`: Orbax logs a dozen absl lines
per disk save (two of them warnings about features ds4jax does not use), and JAX logs its
failed TPU probe at start-up on every machine without a TPU.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from serve.metrics import API_LABELS, PREFIX, SOURCE_LABELS, ServerMetrics

log = logging.getLogger("ds4jax.serve")

#: known warnings that say nothing to an operator: demoted to DEBUG
NOISE = re.compile(
    r"No jax\.Array in TypeHandlerRegistry|Skipping merge of OCDBT checkpoints"
    r"|Failed to get flag value for|Unable to initialize backend"
)
#: loggers whose INFO lines are the libraries' own bookkeeping
CHATTY = ("absl", "jax._src.xla_bridge", "orbax")


class _Demote(logging.Filter):
    """Library INFO lines and the known warnings become DEBUG records: shown only when the
    root logger is at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or (
            record.levelno == logging.WARNING and NOISE.search(record.getMessage())
        ):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def configure(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr
    )
    demote = _Demote()
    for name in CHATTY:
        logging.getLogger(name).addFilter(demote)


def request_line(job: Any, result: Any) -> str:
    """One finished request, llama.cpp-style: `prompt eval time = … ms / N tokens (… tokens
    per second)` becomes `prompt N tokens (cached C) … ms`, and so on."""
    api = API_LABELS.get(job.prepared.api, job.prepared.api)
    total_ms = ((job.finished or job.arrived) - job.arrived) * 1e3
    if isinstance(result, Exception):
        return f"request api={api} failed after {total_ms:.1f} ms: {result}"
    prefill_ms = result.prefill_seconds * 1e3
    start = job.decided + result.prefill_seconds if job.decided is not None else job.arrived
    eval_ms = max(0.0, ((job.finished or start) - start) * 1e3)
    ttft = f"{(job.first_event - job.arrived) * 1e3:.1f} ms" if job.first_event else "-"
    head = (
        f"request api={api} session={result.session} "
        f"source={SOURCE_LABELS[result.source]} finish={result.finish}"
        + (f" restored={result.restored}" if result.restored else "")
    )
    prompt = f"prompt {result.prompt_tokens} tokens (cached {result.cached})"
    prefill = f"prefill {result.prefilled} tokens {prefill_ms:.1f} ms"
    out = f"eval {result.output_tokens} tokens {eval_ms:.1f} ms"
    return (
        f"{head}: {prompt}, {prefill}{_rate(result.prefilled, prefill_ms)} | "
        f"{out}{_rate(result.output_tokens, eval_ms)} | ttft {ttft} | total {total_ms:.1f} ms"
    )


def _rate(tokens: int, ms: float) -> str:
    return f" ({tokens / ms * 1e3:.1f} tok/s)" if tokens and ms > 0 else ""


@dataclass(frozen=True)
class Tally:
    """The counters and gauges a stats line compares between two reads."""

    prompt: float = 0.0
    prefilled: float = 0.0
    cached: float = 0.0
    generation: float = 0.0
    sources: tuple[tuple[str, float], ...] = ()
    running: float = 0.0
    waiting: float = 0.0
    sessions: float = 0.0
    slots: float = 0.0
    state_bytes: float = 0.0
    state_limit: float = 0.0
    drafts: float = 0.0
    drafts_kept: float = 0.0

    @classmethod
    def read(cls, metrics: ServerMetrics) -> Tally:
        # one collection of the registry (each `get_sample_value` would collect it all)
        model = metrics.model_name
        samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in metrics.registry.collect()
            for s in family.samples
        }

        def get(name: str, **labels: str) -> float:
            key = frozenset({"model_name": model, **labels}.items())
            return samples.get((PREFIX + name, key), 0.0)

        return cls(
            prompt=get("prompt_tokens_total"),
            prefilled=get("prefilled_prompt_tokens_total"),
            cached=get("cached_prompt_tokens_total"),
            generation=get("generation_tokens_total"),
            sources=tuple((s, get("continuation_total", source=s)) for s in SOURCE_LABELS.values()),
            running=get("requests_running"),
            waiting=get("requests_waiting"),
            sessions=get("sessions_resident"),
            slots=get("sessions"),
            state_bytes=get("state_bytes"),
            state_limit=get("state_bytes_limit"),
            drafts=get("speculative_drafts_total", position="1"),
            drafts_kept=get("speculative_drafts_accepted_total", position="1"),
        )


def stats_line(before: Tally, now: Tally, seconds: float) -> str | None:
    """The interval from `before` to `now`, or None when nothing happened in it and nothing
    is running or waiting."""
    dt = max(seconds, 1e-9)
    prompt = now.prompt - before.prompt
    generation = now.generation - before.generation
    was = dict(before.sources)
    paths = [f"{s}={n - was.get(s, 0.0):.0f}" for s, n in now.sources if n - was.get(s, 0.0)]
    if not (prompt or generation or paths or now.running or now.waiting):
        return None
    reused = (now.cached - before.cached) / prompt if prompt else 0.0
    mib = 2**20
    limit = f"/{now.state_limit / mib:.1f}" if 0 < now.state_limit < float("inf") else ""
    prefilled = (now.prefilled - before.prefilled) / dt
    drafts = now.drafts - before.drafts
    kept = now.drafts_kept - before.drafts_kept
    spec = f", drafts kept {kept:.0f}/{drafts:.0f} ({kept / drafts:.0%})" if drafts else ""
    return (
        f"stats: prompt {prompt / dt:.1f} tok/s (prefilled {prefilled:.1f}), "
        f"generation {generation / dt:.1f} tok/s, running {now.running:.0f}, "
        f"waiting {now.waiting:.0f}, sessions {now.sessions:.0f}/{now.slots:.0f}, "
        f"state {now.state_bytes / mib:.1f}{limit} MiB, reused {reused:.1%} of prompt tokens, "
        f"paths {' '.join(paths) or '-'}{spec}"
    )


class StatsLine:
    """Logs `stats_line` every `interval` seconds from its own thread until `stop`."""

    def __init__(self, metrics: ServerMetrics, interval: float = 10.0) -> None:
        self.metrics = metrics
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds4jax-stats", daemon=True)

    def start(self) -> StatsLine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        before, t0 = Tally.read(self.metrics), time.monotonic()
        while not self._stop.wait(self.interval):
            now, t1 = Tally.read(self.metrics), time.monotonic()
            line = stats_line(before, now, t1 - t0)
            if line is not None:
                log.info("%s", line)
            before, t0 = now, t1
