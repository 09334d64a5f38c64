"""`make bench`: everything measured side by side in one run, results in bench/results/.

    python -m bench                 # all parts but layers (< 20 min on 2 cores)
    python -m bench prompt          # render + tokenize a Claude-Code-sized request
    python -m bench model           # prefill / decode tokens/s vs transformers, state bytes
    python -m bench continuation    # TTFT of a tool-result turn by path vs history length
    python -m bench disk            # disk save/restore vs raw I/O; restore+suffix vs cold
    python -m bench kernels         # Pallas kernels vs jnp twins (interpreted on CPU)
    python -m bench sessions        # session pool: live rate, retry, sub-agent, memory
    python -m bench batching        # batched decode throughput, TTFT under load, latency
    python -m bench responses       # TTFT of a Codex-shaped tool turn: call_id, visible, cold
    python -m bench llamacpp        # llama.cpp beside ds4jax: logits, prefill and decode
    python -m bench metrics         # /metrics: decode tok/s with and without, scrape cost
    python -m bench paged           # retained-state bytes, frontiers dense vs in pages
    python -m bench context         # the same conversation at --ctx 8k and 1M: speed, bytes
    python -m bench memory          # process memory: 8 agents at --ctx 1M, retries of a long prompt
    python -m bench ops             # XLA ops per decode step and its cost at B = 1, 2, 4, 8
    python -m bench streams         # 1, 2, 4, 8 streaming SDK clients on a server: tok/s
    python -m bench speculative     # MTP speculative decoding: tok/s with/without, acceptance
    python -m bench layers          # where ds4jax's time goes inside one chunk
    python -m bench --quick         # small sizes: a smoke run

`python -m bench model --help` lists the model part's own options.

Besides each part's JSON, every part run here leaves CSVs and PNG plots stamped with this
run (`bench.report`), and a run of several parts ends with one table of ratios measured in
it, also written as `summary-<stamp>.md` / `.csv` (`bench.summary`).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Any

PARTS = ("prompt", "model", "continuation", "disk", "kernels", "sessions", "batching",
         "responses", "llamacpp", "metrics", "paged", "context", "memory", "ops", "stall",
         "streams", "speculative",
         "layers")  # fmt: skip

#: `make bench` keeps to about 40 minutes on 2 cores (28 before llama.cpp's rounds and streams): the
#: model part caps itself (`--budget-min`) and the layer breakdown starts no case after this.
LAYERS_DEADLINE_MIN = 18.0


def run_part(part: str, quick: bool, rest: list[str], t0: float) -> dict[str, Any]:
    """Run one part; returns the dict its `main` returns (what its JSON holds)."""
    module = importlib.import_module(f"bench.{part}")
    if part == "model":
        return module.main(rest)
    if part == "layers":
        return module.main(rest, deadline=t0 + 60 * LAYERS_DEADLINE_MIN)
    return module.main(quick=quick)  # every other part: `main(quick=…)`


def main(argv: list[str] | None = None) -> None:
    from bench import report, summary

    argv = list(sys.argv[1:] if argv is None else argv)
    rest = [a for a in argv if a not in PARTS]
    quick = "--quick" in rest
    # the layer breakdown is a profile, not a figure: it runs only when named
    parts = [a for a in argv if a in PARTS] or [p for p in PARTS if p != "layers"]
    if "--budget-min" not in rest and len(parts) > 1:
        # leave the other parts ~14 minutes of the 20-minute `make bench` allowance (the
        # llama.cpp part alone takes ~3.5; its one-time build is on top)
        rest += ["--budget-min", "6"]
    stamp = report.run_stamp(quick)
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    for i, part in enumerate(parts, 1):
        print(f"\n=== bench {part} ({i}/{len(parts)}, {time.perf_counter() - t0:.0f} s in) ===",
              flush=True)  # fmt: skip
        t = time.perf_counter()
        results[part] = run_part(part, quick, rest, t0)
        seconds[part] = round(time.perf_counter() - t, 1)
        for path in report.write_part(part, results[part], stamp):
            print(f"wrote {path}")
        print(f"=== {part} took {seconds[part]:.0f} s", flush=True)
    total = time.perf_counter() - t0
    rows = summary.summary_rows(results)
    if rows:
        print(f"\nsummary: ratios measured side by side in this run ({stamp})")
        print(summary.format_table(rows))
    if len(parts) > 1:
        notes = [
            f"`{' '.join(['python -m bench', *argv])}`; each part's CSVs and PNGs carry the "
            f"same stamp ({stamp})",
            "seconds per part: "
            + ", ".join(f"{p} {s:.0f}" for p, s in seconds.items())
            + f"; total {total:.0f}",
            f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus",
        ]
        for path in summary.write(rows, stamp, notes):
            print(f"wrote {path}")
    print(f"\nbench total {total:.0f} s", flush=True)


if __name__ == "__main__":
    from ds4jax import allocator

    allocator.reexec()  # as `ds4jax serve` runs: the engine measured is the one served
    main()
