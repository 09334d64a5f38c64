"""Decode over HTTP as an agent's clients meet it (issue 27): 1, 2, 4 and 8 streaming
`anthropic` SDK clients against one `ds4jax serve` with its defaults (bursts on, up to 8
rows), the tokens each client received and when, side by side in one run.

The issue's first measurement (four streaming SDK clients on bench-192m: one stream alone
19.3 tok/s, four together 24.4 tok/s in all, 1.26×) is this part's question. Each client
asks for `TOKENS` tokens of a different short prompt (thinking off); its rate is
(output tokens − 1) / (last event − first text delta) as the client saw them, and the
aggregate of n clients is all their tokens past each one's first over the span from the
first client's first delta to the last one's end — a client that started late or ended
early counts against it. The client counts take turns round by round (`ROUNDS`), after
one untimed round that compiles every batch size's programs; each figure is the median
over the rounds.

    python -m bench streams [--quick]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.report import write_json
from bench.stall import serve

CLIENTS = (1, 2, 4, 8)
TOKENS = 256
ROUNDS = 3


def clients_round(url: str, n: int, tokens: int) -> dict[str, Any]:
    """`n` streaming clients at once, each asking `tokens` tokens; their rates and the
    aggregate (see the module's docstring)."""
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="bench", max_retries=0, timeout=900)
    first: list[float | None] = [None] * n
    end: list[float] = [0.0] * n
    out: list[int] = [0] * n
    errors: list[str] = []
    go = threading.Barrier(n)

    def stream(i: int) -> None:
        go.wait()
        try:
            with client.messages.stream(
                model="deepseek-v4-flash", max_tokens=tokens, thinking={"type": "disabled"},
                messages=[{"role": "user", "content": f"Client {i}: tell a long story."}],
            ) as events:  # fmt: skip
                for event in events:
                    if event.type == "content_block_delta" and first[i] is None:
                        first[i] = time.perf_counter()
                out[i] = events.get_final_message().usage.output_tokens
            end[i] = time.perf_counter()
        except anthropic.APIError as err:
            errors.append(f"client {i}: {err}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors or None in first:
        raise RuntimeError(f"a client failed or got no text: {errors}")
    starts = [f for f in first if f is not None]
    rates = [(o - 1) / (e - f) for o, e, f in zip(out, end, starts, strict=True) if e > f]
    span = max(end) - min(starts)
    return {"clients": n, "output_tokens": out, "span_s": round(span, 3),
            "aggregate_tok_s": round(sum(o - 1 for o in out) / span, 1),
            "per_client_tok_s": [round(r, 1) for r in rates]}  # fmt: skip


def main(quick: bool = False) -> dict[str, Any]:
    from bench.disk import use_compile_cache

    use_compile_cache()
    name, clients, tokens, rounds = (("tiny", (1, 4), 32, 1) if quick
                                     else ("bench-192m", CLIENTS, TOKENS, ROUNDS))  # fmt: skip
    log = Path(tempfile.gettempdir()) / "ds4jax-bench-streams.log"
    proc, url = serve(name, 4096, log, ["--sessions", str(max(clients) + 2)])
    runs: list[dict[str, Any]] = []
    try:
        for n in clients:  # compile: every batch size's step and burst
            clients_round(url, n, 16)
        for r in range(rounds):
            for n in clients:
                runs.append({"round": r + 1, **clients_round(url, n, tokens)})
                print(f"round {r + 1}, {n} clients: {runs[-1]['aggregate_tok_s']} tok/s in "
                      f"all, each {runs[-1]['per_client_tok_s']}", flush=True)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)
    rows = []
    for n in clients:
        mine = [r for r in runs if r["clients"] == n]
        rows.append(
            {
                "clients": n,
                "aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in mine),
                "per_client_tok_s": round(
                    statistics.median(x for r in mine for x in r["per_client_tok_s"]), 1
                ),
            }
        )
    for row in rows:
        row["aggregate_vs_1"] = round(row["aggregate_tok_s"] / rows[0]["aggregate_tok_s"], 2)
        print(f"{row['clients']} clients: {row['aggregate_tok_s']} tok/s in all "
              f"({row['aggregate_vs_1']}x one alone), {row['per_client_tok_s']} each",
              flush=True)  # fmt: skip
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick,
           "model": name, "tokens": tokens, "rounds": rounds,
           "rows": rows, "runs": runs}  # fmt: skip
    write_json("streams", out, quick)
    return out


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
