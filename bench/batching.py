"""Continuous batching, measured side by side in one run.

* **Aggregate decode throughput** of the batched step (`ds4jax.model.batch`) by batch size:
  for each model (bench-192m, tiny, the trained demo) B rows, each a session after a
  prefill, advance together for a number of greedy steps, the tokens read back to the host
  every step as a server does; reported: tokens/s over all rows and, beside it, the solo
  `decode_step` loop the engine ran before batching. Each batch size is compiled once
  before timing; the step's compile count is read after warm-up and after every timed run,
  so a recompile would show (it should stay 0).
* **Time to first token** of a short request (tiny model) submitted while a long
  generation is decoding, against the same request on an idle engine; with batching
  (`max_batch=8`) and without (`max_batch=1`, where it waits for the long one to end).
* **Per-token latency** (p50 / p99 of the scheduler's step time while a stream decodes)
  with 1 stream and with 8 (tiny model).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from bench.report import write_json

SIZES = (1, 2, 4, 8)
MODELS = ("bench-192m", "tiny", "demo")


def _setup(name: str):
    from ds4jax.chat.tokenizer import load_tokenizer
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params
    from ds4jax.weights.checkpoint import load_model

    if name == "demo":
        cfg, params, _, _ = load_model("demo", load_tokenizer=load_tokenizer)
        return cfg, params
    cfg = load_config(name)
    return cfg, init_params(cfg, 0)


def measure(name: str, ctx: int, steps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ds4jax.model import batch as mb
    from ds4jax.model.forward import decode_step, prefill
    from ds4jax.model.state import init_state

    cfg, params = _setup(name)
    max_len = ctx + steps + 16
    toks = np.random.default_rng(0).integers(10, cfg.vocab_size, ctx)
    state, _ = prefill(params, init_state(cfg, max_len), toks, cfg)
    jax.block_until_ready(state)

    # the loop the engine ran before batching: one decode_step per token
    decode_step(params, state, 1, cfg).logits.block_until_ready()
    t = time.perf_counter()
    s, tok = state, int(jnp.argmax(state.logits))
    for _ in range(steps):
        s = decode_step(params, s, tok, cfg)
        tok = int(jnp.argmax(s.logits))
    solo = steps / (time.perf_counter() - t)

    def run(batch, size: int, n: int):
        keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), size)))
        rest = (np.zeros(size, np.float32), np.zeros(size, np.int32),
                np.ones(size, np.float32), np.zeros(size, np.float32), np.int32(-1))  # fmt: skip
        for _ in range(n):
            batch, tokens, keys = mb.step(params, batch, np.full(size, -1, np.int32), keys,
                                          *rest, cfg=cfg, size=size)  # fmt: skip
            np.asarray(tokens)  # the host reads every step's tokens
            keys = np.asarray(keys)
        return batch

    batch = mb.empty_batch(cfg, max_len, max(SIZES))
    for row in range(max(SIZES)):
        batch = mb.insert(batch, jnp.int32(row), state)
    for size in SIZES:  # warm-up: compile every size once
        batch = run(batch, size, 1)
    compiled = mb.step._cache_size()
    rows = []
    for size in SIZES:
        for row in range(size):  # every row back at the prompt end
            batch = mb.insert(batch, jnp.int32(row), state)
        jax.block_until_ready(batch)
        t = time.perf_counter()
        batch = run(batch, size, steps)
        jax.block_until_ready(batch)
        seconds = time.perf_counter() - t
        rows.append({"model": name, "batch": size, "context": ctx, "steps": steps,
                     "seconds": round(seconds, 4),
                     "tokens_per_s": round(size * steps / seconds, 2),
                     "per_token_ms": round(1000 * seconds / steps, 2),
                     "solo_decode_step_tokens_per_s": round(solo, 2),
                     "recompiles_after_warmup": mb.step._cache_size() - compiled})  # fmt: skip
        print(f"   {name:<11} B={size}: {rows[-1]['tokens_per_s']:8.1f} tok/s "
              f"({rows[-1]['per_token_ms']:.1f} ms per step; solo decode_step {solo:.1f} tok/s)",
              flush=True)  # fmt: skip
    return {"rows": rows, "recompiles_after_warmup": mb.step._cache_size() - compiled}


def _engine(max_batch: int):
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.model.params import init_params

    cfg = load_config("tiny")
    engine = Engine(cfg, init_params(cfg, 0), V4Tokenizer(), max_len=2048, sessions=8,
                    fork_points=True, max_batch=max_batch)  # fmt: skip
    engine.warm_up()
    return engine


def _prepared(engine, text: str, max_tokens: int):
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.engine import SamplingParams

    body = {"messages": [{"role": "user", "content": text}], "thinking": {"type": "disabled"}}
    return engine.prepare_request(parse_messages_request(body), max_tokens=max_tokens,
                                  sampling=SamplingParams(temperature=0.0))  # fmt: skip


def _ttft(engine, under_load: bool, long_tokens: int) -> float:
    """Seconds from submitting a one-token request to its end: its prefill and its first
    (only) token."""
    engine.reset()
    if under_load:
        engine.submit(_prepared(engine, "Tell me a very long story, please.", long_tokens))
        while not any(engine._rows):  # the long one is decoding
            engine.tick()
    t = time.perf_counter()
    short = engine.submit(_prepared(engine, "Hi", 1))
    while not short.finished.is_set():
        engine.tick()
    done = time.perf_counter()
    while engine.busy:  # let the long one finish (not timed)
        engine.tick()
    return done - t


def ttft_rows(long_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for max_batch in (1, 8):
        engine = _engine(max_batch)
        idle = min(_ttft(engine, False, long_tokens) for _ in range(3))
        loaded = min(_ttft(engine, True, long_tokens) for _ in range(2))
        rows.append({"max_batch": max_batch, "long_generation_tokens": long_tokens,
                     "idle_ttft_s": round(idle, 4),
                     "under_load_ttft_s": round(loaded, 4)})  # fmt: skip
        print(f"   max_batch={max_batch}: short request TTFT idle {idle:.3f} s, while a "
              f"{long_tokens}-token generation decodes {loaded:.3f} s", flush=True)  # fmt: skip
    return rows


def latency_rows(tokens: int) -> list[dict[str, Any]]:
    import numpy as np

    engine = _engine(8)
    rows = []
    for streams in (1, 8):
        engine.reset()
        for i in range(streams):
            engine.submit(_prepared(engine, f"Stream {i}: keep talking.", tokens))
        steps = []
        while engine.busy:
            decoding = sum(t is not None for t in engine._rows)
            t = time.perf_counter()
            engine.tick()
            if decoding == streams and not engine._prefilling:  # steady state only
                steps.append(time.perf_counter() - t)
        ms = 1000 * np.asarray(steps)
        rows.append({"streams": streams, "steps": len(steps),
                     "p50_ms": round(float(np.percentile(ms, 50)), 2),
                     "p99_ms": round(float(np.percentile(ms, 99)), 2)})  # fmt: skip
        print(f"   {streams} stream(s): per-token latency p50 {rows[-1]['p50_ms']} ms, "
              f"p99 {rows[-1]['p99_ms']} ms", flush=True)  # fmt: skip
    return rows


def main(quick: bool = False) -> dict:
    from bench.disk import use_compile_cache

    use_compile_cache()
    ctx, steps = (128, 8) if quick else (512, 32)
    out: dict[str, Any] = {"date": datetime.now().isoformat(timespec="seconds"),
                           "quick": quick, "rows": [], "recompiles_after_warmup": 0}  # fmt: skip
    for name in MODELS:
        print(f"-- {name}: {steps} greedy steps after a {ctx}-token prefill", flush=True)
        m = measure(name, ctx, steps)
        out["rows"] += m["rows"]
        out["recompiles_after_warmup"] += m["recompiles_after_warmup"]
    print(f"recompiles after warm-up: {out['recompiles_after_warmup']}", flush=True)
    print("-- time to first token of a short request while a long generation decodes (tiny)",
          flush=True)  # fmt: skip
    out["ttft"] = ttft_rows(64 if quick else 256)
    print("-- per-token latency of a stream, alone and among 8 (tiny)", flush=True)
    out["latency"] = latency_rows(16 if quick else 64)
    write_json("batching", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
