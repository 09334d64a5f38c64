"""Decoding streams while a long prompt is prefilled (issue 27, item 4), side by side in one
run: the gaps between one stream's tokens with the prefill bound (`--stall-bound`, the
engine's `stall_bound`) and without it, against the same streams with no prompt arriving.

On the real engine (bench-192m's random weights, greedy, the serve defaults' chunk sizes),
in process: four requests decode; their tokens are timed as the server streams them
(`on_token`). Then a long prompt arrives and the gaps are timed while it prefills — until
it takes its row, whose join (the batch growing to the prompt's span) is not a prefill
gap and is left out. Without the bound the whole prefill is timed; with it, the first
`window` seconds (the bounded prefill of 16k tokens takes minutes on 2 cores), and its
rate gives the whole prefill's time. Every program both runs need is compiled before
anything is timed.

    python -m bench stall [--quick]

Reported: p50 / p99 gaps and their ratio to the streams' p50 alone (the issue's bar:
p99 ≤ 2×), the chunk sizes the bound chose, and the prompt's prefill rate either way.

Both sides step a program per token (`burst=1`, `serve --burst 1`): the bar is about the
gap between one token and the next, and bursts (`--burst`, the default) hand a stream its
tokens four at a time while nothing waits — gaps of ~0 and of four steps, whose p50 says
nothing about the pace; a prompt arriving stops them anyway.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.batching import _prepared as _request
from bench.report import write_json

STREAMS = 4
CHUNKS = (4, 16, 64, 256, 512)  # `serve --chunk-sizes`' default


def _engine(name: str, max_len: int, stall: float | None):
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.model.params import init_params

    cfg = load_config(name)
    return Engine(cfg, init_params(cfg, 0), V4Tokenizer(), max_len=max_len, chunk_sizes=CHUNKS,
                  sessions=STREAMS + 2, max_batch=8, stall_bound=stall, burst=1)  # fmt: skip


def _long_text(tokenizer, tokens: int) -> str:
    """A user message of about `tokens` tokens."""
    line = "Rule {}: keep every module small and named for what it holds.\n"
    per = len(tokenizer.encode_text(line.format(1000)))
    return "".join(line.format(i) for i in range(tokens // per))


def _warm(engine, prompt_tokens: int, rows: int = STREAMS) -> None:
    """Compile what the timed part runs beyond `warm_up`, at the long prompt's span: every
    chunk size as a program of its own, and the mixed steps of `rows` rows with a chunk of
    each size up to 64 riding in them."""
    import jax

    from bench.ops import step_args
    from ds4jax.model import batch as batch_ops
    from ds4jax.model.forward import prefill

    state = engine._fit(engine._empty, prompt_tokens)
    for size in engine.chunk_sizes:
        s, _ = prefill(engine.params, state, [engine.tokenizer.bos_id] * size, engine.cfg,
                       chunk_sizes=(size,))  # fmt: skip
        jax.block_until_ready(s.logits)
    args = step_args(rows)
    for size in (s for s in engine.chunk_sizes if s <= 64):
        scratch = jax.tree.map(jax.numpy.copy, engine._batch)
        chunk = (state, np.zeros(size, np.int32), np.int32(1))
        out = batch_ops.step(engine.params, scratch, *args, chunk, cfg=engine.cfg, size=rows)
        jax.block_until_ready(out)


def _stats(gaps: list[float], alone: float | None = None) -> dict[str, Any]:
    ms = 1e3 * np.asarray(gaps)
    out = {"gaps": len(gaps), "p50_ms": round(float(np.percentile(ms, 50)), 1),
           "p99_ms": round(float(np.percentile(ms, 99)), 1),
           "max_ms": round(float(ms.max()), 1)}  # fmt: skip
    if alone:
        out["p99_vs_alone_p50"] = round(out["p99_ms"] / alone, 2)
    out["all_ms"] = [round(float(x), 1) for x in ms]
    return out


def scenario(name: str, max_len: int, prompt_tokens: int, stall: float | None,
             window: float, alone_ticks: int) -> dict[str, Any]:  # fmt: skip
    """Four streams decode; then a `prompt_tokens` prompt arrives. Gaps alone, then during
    its prefill (at most `window` seconds of it)."""
    engine = _engine(name, max_len, stall)
    engine.warm_up()
    text = _long_text(engine.tokenizer, prompt_tokens)
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    stop = threading.Event()
    rows = []
    for i in range(STREAMS):
        note = stamps[i].append
        rows.append(
            engine.submit(
                _request(engine, f"Stream {i}: tell a long story.", 4000),
                cancel=stop,
                on_token=lambda n=note: n(time.perf_counter()),
            )
        )
    while sum(t is not None for t in engine._rows) < STREAMS:
        engine.tick()
    _warm(engine, len(engine.tokenizer.encode_text(text)) + 16)
    for _ in range(alone_ticks):
        engine.tick()
    alone_from = [len(s) for s in stamps]
    for _ in range(alone_ticks):
        engine.tick()
    alone = [g for s, a in zip(stamps, alone_from, strict=True) for g in np.diff(s[a:])]
    long = engine.submit(_request(engine, text, 1))
    t0 = time.perf_counter()
    marks = [len(s) for s in stamps]
    limits: dict[int, int] = {}
    done, ends = 0, marks
    while long.decoder is None and not long.finished.is_set():
        if time.perf_counter() - t0 > window:
            break
        before = long.done_tokens
        engine.tick()
        if long.decoder is None and long.tokens:
            n = long.done_tokens - before
            limits[n] = limits.get(n, 0) + 1
            done = long.done_tokens
        ends = [len(s) for s in stamps]
    elapsed = time.perf_counter() - t0
    finished = long.decoder is not None or long.finished.is_set()
    during = [g for s, a, b in zip(stamps, marks, ends, strict=True) for g in np.diff(s[a:b])]
    stop.set()
    while engine.busy:
        engine.tick()
    assert all(r.error is None for r in rows), [r.error for r in rows]
    base = _stats(alone)
    rate = done / elapsed if elapsed else 0.0
    return {"stall_bound": stall, "prompt_tokens": len(long.tokens), "alone": base,
            "during_prefill": _stats(during, base["p50_ms"]),
            "prefill_tokens_timed": done, "prefill_seconds_timed": round(elapsed, 2),
            "prefill_finished": finished, "prefill_tok_s": round(rate, 1),
            "prefill_seconds_all": round(len(long.tokens) / rate, 1) if rate else None,
            "tokens_per_tick": dict(sorted(limits.items())),
            "chunk_costs_ms": {k: round(v * 1e3, 1)
                               for k, v in sorted(engine.tick_costs.chunk_s.items())},
            "step_costs_ms": {k: round(v * 1e3, 1)
                              for k, v in sorted(engine.tick_costs.step_s.items())}}  # fmt: skip


def overtake(name: str, max_len: int, prompt_tokens: int) -> dict[str, Any]:
    """A short request (a new 'Hi.' conversation, 8 tokens of reply) arriving once a quarter
    of a `prompt_tokens` prompt is dispatched on an idle engine (`interleave.overtakes`):
    its time to first token then and alone, and the long prompt's prefill alone and with
    it. Before the short one could start beside the long one, it waited out the whole
    prefill; before the prefill kept one chunk queued ahead and no more, it queued behind
    every chunk already dispatched."""
    engine = _engine(name, max_len, 2.0)
    engine.warm_up()
    texts = [f"Conversation {i}.\n" + _long_text(engine.tokenizer, prompt_tokens)
             for i in range(3)]  # fmt: skip
    _warm(engine, len(engine.tokenizer.encode_text(texts[0])) + 16, rows=1)

    def short(i: int) -> tuple[Any, list[float]]:
        stamps: list[float] = []
        t = engine.submit(_request(engine, f"Hi {i}.", 8),
                          on_token=lambda: stamps.append(time.perf_counter()))  # fmt: skip
        return t, stamps

    def drain() -> None:
        while engine.busy:
            engine.tick()

    t0 = time.perf_counter()
    alone, stamps = short(0)
    tickets = [alone]
    while not stamps:
        engine.tick()
    ttft_alone = stamps[0] - t0
    drain()
    t0 = time.perf_counter()
    long = engine.submit(_request(engine, texts[0], 1))
    while long.decoder is None and not long.finished.is_set():
        engine.tick()
    long_alone = time.perf_counter() - t0
    drain()
    for i in (1, 2):  # the first compiles the mixed steps of this batch's shape
        t0 = time.perf_counter()
        long = engine.submit(_request(engine, texts[i], 1))
        quarter = len(engine.tokenizer.encode_text(texts[i])) // 4
        while long.done_tokens < quarter and not long.finished.is_set():
            engine.tick()  # a quarter of the prompt dispatched
        t1 = time.perf_counter()
        during, stamps = short(i)
        tickets += [long, during]
        while not stamps:
            engine.tick()
        ttft_during = stamps[0] - t1
        while long.decoder is None and not long.finished.is_set():
            engine.tick()
        long_with = time.perf_counter() - t0
        drain()
    assert all(t.error is None for t in tickets), [t.error for t in tickets]
    return {"prompt_tokens": len(long.tokens), "short_ttft_alone_s": round(ttft_alone, 3),
            "short_ttft_during_prefill_s": round(ttft_during, 3),
            "long_prefill_alone_s": round(long_alone, 2),
            "long_prefill_with_short_s": round(long_with, 2)}  # fmt: skip


def serve(name: str, ctx: int, log: Path, args: list[str]) -> tuple[subprocess.Popen, str]:
    """`ds4jax serve` of config `name` with `args` on a free port, its log in `log`,
    returned once it says it is ready."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "ds4jax", "serve", "--config", name, "--ctx", str(ctx),
           "--port", str(port), *args]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.monotonic() + 900
    while "ready on" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"ds4jax serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def over_http(name: str, ctx: int, prompt_tokens: int, stall: float | None, window: float,
              alone_s: float) -> dict[str, Any]:  # fmt: skip
    """The same scenario as a user meets it: a server, four streaming `anthropic` SDK
    clients, the gaps between their text deltas as the client sees them; then a fifth
    client sends the long prompt (one token asked)."""
    import anthropic

    log = Path(tempfile.gettempdir()) / f"ds4jax-bench-stall-{stall or 0}.log"
    proc, url = serve(
        name,
        ctx,
        log,
        ["--sessions", str(STREAMS + 2), "--stall-bound", str(stall or 0), "--burst", "1"],
    )
    try:
        client = anthropic.Anthropic(base_url=url, api_key="bench", max_retries=0, timeout=900)
        stamps: list[list[float]] = [[] for _ in range(STREAMS)]
        stop = threading.Event()

        def stream(i: int) -> None:
            with client.messages.stream(
                model="deepseek-v4-flash", max_tokens=3000,
                thinking={"type": "disabled"},
                messages=[{"role": "user", "content": f"Stream {i}: tell a long story."}],
            ) as events:  # fmt: skip
                for event in events:
                    if event.type == "content_block_delta":
                        stamps[i].append(time.perf_counter())
                    if stop.is_set():
                        return

        threads = [threading.Thread(target=stream, args=(i,), daemon=True)
                   for i in range(STREAMS)]  # fmt: skip
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 20:
            time.sleep(0.1)
        marks = [len(s) for s in stamps]
        time.sleep(alone_s)
        alone = [g for s, a in zip(stamps, marks, strict=True) for g in np.diff(s[a:])]
        from ds4jax.chat.tokenizer import V4Tokenizer

        text = _long_text(V4Tokenizer(), prompt_tokens)
        done = threading.Event()

        def send_long() -> None:
            try:
                client.messages.create(model="deepseek-v4-flash", max_tokens=1,
                                       thinking={"type": "disabled"},
                                       messages=[{"role": "user", "content": text}])  # fmt: skip
                done.set()
            except anthropic.APIError:  # past the window the server is stopped under it
                pass

        t0 = time.perf_counter()
        marks = [len(s) for s in stamps]
        threading.Thread(target=send_long, daemon=True).start()
        finished = done.wait(window)
        elapsed = time.perf_counter() - t0
        during = [g for s, a in zip(stamps, marks, strict=True) for g in np.diff(s[a:])]
        stop.set()
    finally:
        proc.terminate()
        proc.wait(60)
    base = _stats(alone)
    return {"stall_bound": stall, "over": "http", "server_log": str(log), "alone": base,
            "during_prefill": _stats(during, base["p50_ms"]), "prompt_finished": finished,
            "prompt_seconds": round(elapsed, 1) if finished else None,
            "seconds_timed": round(elapsed, 1)}  # fmt: skip


def main(quick: bool = False) -> dict[str, Any]:
    from bench.disk import use_compile_cache

    use_compile_cache()
    name, prompt, max_len, window = (("tiny", 1500, 2048, 10.0) if quick
                                     else ("bench-192m", 16000, 16384, 60.0))  # fmt: skip
    out: dict[str, Any] = {"date": datetime.now().isoformat(timespec="seconds"),
                           "quick": quick, "model": name, "streams": STREAMS,
                           "chunk_sizes": list(CHUNKS), "runs": []}  # fmt: skip
    for stall in (None, 2.0):
        print(f"-- {STREAMS} streams, a {prompt}-token prompt arrives; stall bound {stall}",
              flush=True)  # fmt: skip
        r = scenario(name, max_len, prompt, stall, window, 10 if quick else 30)
        out["runs"].append(r)
        a, d = r["alone"], r["during_prefill"]
        print(f"   gaps alone p50 {a['p50_ms']} ms p99 {a['p99_ms']}; during the prefill p50 "
              f"{d['p50_ms']} p99 {d['p99_ms']} max {d['max_ms']} ms "
              f"(p99 {d['p99_vs_alone_p50']}x the p50 alone); prefill "
              f"{r['prefill_tok_s']} tok/s, {r['prefill_tokens_timed']} tokens in "
              f"{r['prefill_seconds_timed']} s (all: ~{r['prefill_seconds_all']} s); "
              f"tokens per tick {r['tokens_per_tick']}", flush=True)  # fmt: skip
    print(f"-- a short request arrives while a {prompt}-token prompt prefills", flush=True)
    r = out["overtake"] = overtake(name, max_len, prompt)
    print(f"   its first token after {r['short_ttft_during_prefill_s']} s (alone "
          f"{r['short_ttft_alone_s']} s); the long prompt's prefill "
          f"{r['long_prefill_with_short_s']} s with it, {r['long_prefill_alone_s']} s alone "
          "(what the short one waited before)", flush=True)  # fmt: skip
    if not quick:  # as a user meets it: a server and streaming SDK clients
        out["http"] = []
        for stall in (None, 2.0):
            print(f"-- over HTTP: {STREAMS} streaming SDK clients, a {prompt}-token prompt "
                  f"arrives; --stall-bound {stall or 0}", flush=True)  # fmt: skip
            r = over_http(name, max_len, prompt, stall, window, 10.0)
            out["http"].append(r)
            a, d = r["alone"], r["during_prefill"]
            print(f"   deltas alone p50 {a['p50_ms']} ms p99 {a['p99_ms']}; during the "
                  f"prefill p50 {d['p50_ms']} p99 {d['p99_ms']} max {d['max_ms']} ms (p99 "
                  f"{d['p99_vs_alone_p50']}x the p50 alone); the long request "
                  f"{r['prompt_seconds'] or 'not done'} s of {r['seconds_timed']} s timed",
                  flush=True)  # fmt: skip
    write_json("stall", out, quick)
    return out


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
