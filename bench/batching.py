"""Aggregate decode throughput of the batched step (`ds4jax.model.batch`) by batch size.

For each model (bench-192m, tiny, the trained demo) B rows, each a session after a
`CTX`-token prefill, advance together for `STEPS` greedy steps, the tokens read back to the
host every step as a server does; reported: tokens/s over all rows, and, beside it, the
solo `decode_step` loop the engine ran before batching. Before timing, each batch size is
compiled once; the compile count of the step is read after warm-up and again after every
timed run, so a recompile would show (it should stay 0).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from bench.report import write_json

SIZES = (1, 2, 4, 8)
MODELS = ("bench-192m", "tiny", "demo")


def _setup(name: str):
    from ds4jax.config import load_config
    from ds4jax.model.checkpoint import load_model
    from ds4jax.model.params import init_params

    if name == "demo":
        cfg, params, _, _ = load_model("demo")
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
    write_json("batching", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
