"""Time to first token of a tool-result turn, by continuation path, vs history length.

For each history length (a system prompt grown to ~N tokens, a teacher-forced tool call,
then the client's tool-result request) the same request is served five ways on the tiny
model:

* live tool ids — the engine just sampled the call (the fast path);
* token prefix  — the live state is the request's own tokens up to the tool result;
* text prefix   — the live tokens spell the history but tokenize differently;
* disk          — nothing live (a restarted server): the call's state comes back from the
  `DiskStore` checkpoint its clean exit wrote (lookup + load + suffix prefill);
* cold          — nothing live, nothing on disk.

Reported: prefilled tokens and TTFT (prefill + the first decode step). The goal: the live path
prefills only the suffix, is flat in history length, and cold/live ≥ 20× at 16k.

Results are printed and written to `bench/results/continuation-<date>-<HHMM>[-quick].json`.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

PATHS = ("live_tool", "token_prefix", "text_prefix", "disk", "cold")
TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
CALL = (
    'Let me look.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _system(tok, n_tokens: int) -> str:
    words = "the engine keeps the sampled state as the truth and appends only the suffix ".split()
    text, i = [], 0
    while len(tok.encode_text(" ".join(text))) < n_tokens:
        text.extend(words[j % len(words)] for j in range(i, i + 200))
        i += 200
    return " ".join(text)


def _follow_up(first: dict, tid: str) -> dict:
    """The client's next request: the history, the call it received, the tool's result."""
    call = {"type": "tool_use", "id": tid, "name": "bash", "input": {"command": "ls -la"}}
    result = {"type": "tool_result", "tool_use_id": tid, "content": "a.txt\nb.txt"}
    return dict(
        first,
        messages=[
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "Let me look."}, call],
            },
            {"role": "user", "content": [result]},
        ],
    )


def measure(engine: Any, tok: Any, n: int, store_dir: Path) -> dict:
    """One history length: the same tool-result request served by every path in `PATHS`."""
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.chat.segments import template
    from ds4jax.kvstore.disk import DiskStore
    from ds4jax.kvstore.store import NoStore

    def prepared(body: dict, max_tokens: int = 1):
        return engine.prepare_request(parse_messages_request(body), max_tokens=max_tokens)

    def open_store() -> DiskStore:
        # for the disk path only, and saving on a clean exit only: the other paths run
        # store-less, and the disk path finds the one checkpoint written below
        return DiskStore(store_dir, "bench", cfg=engine.cfg, max_len=engine.max_len,
                         tokenizer=tok, min_tokens=64, cold=False, continued_every=0,
                         evict=False)  # fmt: skip

    first = {"system": _system(tok, n), "tools": TOOLS,
             "messages": [{"role": "user", "content": "go"}]}  # fmt: skip
    engine.reset()
    engine.store = NoStore()
    res1 = engine.run(prepared(first, 200), forced_tokens=tok.encode_segments(template(CALL)))
    live_after_call, binding = engine.live, engine.bindings.tool
    req = prepared(_follow_up(first, res1.tool_ids[0]))
    engine.store = open_store()
    engine.shutdown()  # the clean exit's checkpoint of the state after the call
    engine.store = NoStore()

    def live_tool() -> None:
        engine.live, engine.bindings.tool = live_after_call, binding

    def token_prefix() -> None:
        # the same live tokens without the tool binding: only the token prefix matches
        engine.live, engine.bindings.tool = live_after_call, None

    def text_prefix() -> None:
        # the same history text, its first word sampled as two tokens
        engine.reset()
        alt = tok.encode_text("Le") + tok.encode_text("t me look.")
        alt += tok.encode_segments(template(CALL[len("Let me look.") :]))
        engine.run(prepared(first, 200), forced_tokens=alt)
        engine.bindings.tool = None

    def disk() -> None:
        # a restarted server: nothing live, the store reopened on the same directory
        engine.reset()
        engine.store = open_store()

    def timed(setup) -> tuple[str, int, float]:
        engine.store = NoStore()
        setup()
        t = time.perf_counter()
        res = engine.run(req)  # one sampled token: prefill + first decode step
        return res.source.value, res.prefilled, time.perf_counter() - t

    setups = {"live_tool": live_tool, "token_prefix": token_prefix, "text_prefix": text_prefix,
              "disk": disk, "cold": engine.reset}  # fmt: skip
    row: dict = {"history_tokens": len(req.view.tokens)}
    for name in PATHS:
        # best of two for the cheap paths (the first call of a size may still compile)
        runs = [timed(setups[name]) for _ in range(1 if name == "cold" else 2)]
        source, prefilled, seconds = min(runs, key=lambda r: r[2])
        row[name] = {"source": source, "prefilled": prefilled, "ttft_s": round(seconds, 4)}
        print(f"   {name:<13} {seconds:8.3f} s  ({prefilled} tok prefilled, {source})",
              flush=True)  # fmt: skip
    engine.store = NoStore()
    return row


def main(quick: bool = False) -> dict:
    from bench.disk import use_compile_cache
    from bench.report import write_json
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.model.params import init_params

    use_compile_cache()  # the compiles are not what this part measures: reuse them
    sizes = [512, 2048] if quick else [1024, 4096, 16384]
    cfg = load_config("tiny")
    tok = V4Tokenizer()
    engine = Engine(cfg, init_params(cfg, 0), tok, max_len=max(sizes) + 1024)
    print(f"warm-up: compiling prefill chunks {engine.chunk_sizes} and the decode step at "
          f"max_len {engine.max_len} ...", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    engine.warm_up()
    print(f"warm-up (compile) {time.perf_counter() - t0:.1f}s", flush=True)
    root = Path(tempfile.mkdtemp(prefix="ds4jax-bench-continuation-"))
    rows = []
    try:
        for n in sizes:
            print(f"-- history ~{n} tokens", flush=True)
            rows.append(measure(engine, tok, n, root / str(n)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'tokens':>7} " + " ".join(f"{k:>13}" for k in PATHS) + "   (TTFT s)")
    for row in rows:
        print(
            f"{row['history_tokens']:>7} " + " ".join(f"{row[k]['ttft_s']:>13.3f}" for k in PATHS)
        )
    live = [r["live_tool"]["ttft_s"] for r in rows]
    last = rows[-1]
    summary = {
        "live_flatness": round(max(live) / min(live), 3),
        "cold_over_live_at_largest": round(last["cold"]["ttft_s"] / last["live_tool"]["ttft_s"], 1),
        "cold_over_disk_at_largest": round(last["cold"]["ttft_s"] / last["disk"]["ttft_s"], 1),
    }
    print(
        f"live TTFT max/min over sizes {summary['live_flatness']}×; at "
        f"{last['history_tokens']} tokens cold/live {summary['cold_over_live_at_largest']}×, "
        f"cold/disk {summary['cold_over_disk_at_largest']}×",
        flush=True,
    )
    now = datetime.now()
    out = {"date": now.isoformat(timespec="seconds"), "quick": quick, "rows": rows,
           "summary": summary, "model": "tiny (random weights), CPU"}  # fmt: skip
    write_json("continuation", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
