"""Where ds4jax's time goes: one `forward_chunk` against its parts, each jitted alone.

For a chunk of T tokens on a state of `max_len` (the shapes `python -m bench model` runs):
attention per layer kind, MoE (hash and learned routing), one hyper-connection pre+post
pair, the LM head on the last token. The per-kind times are multiplied by how many layers
of that kind the config has; "sum of parts" against the whole chunk shows what the split
misses (fusion across parts, the embedding gather, state bookkeeping).

The state is empty with `pos` set to where the chunk would start: shapes are static, so
the cost of a chunk depends on `max_len` (the compressed-row capacity), not on how many
rows are filled.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def log(msg: str) -> None:
    print(msg, flush=True)


def _time(f: Any, *a: Any, reps: int) -> tuple[float, float]:
    import jax

    f = jax.jit(f)
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


def breakdown(cfg: Any, params: Any, T: int, max_len: int, start: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from ds4jax.model import layers as L
    from ds4jax.model.forward import forward_chunk
    from ds4jax.model.state import init_state

    st = init_state(cfg, max_len)
    st = dataclasses.replace(st, pos=jnp.asarray(start, jnp.int32))
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(2, cfg.vocab_size, T), jnp.int32)
    n, nv = st.pos, jnp.int32(T)
    pos = n + jnp.arange(T, dtype=jnp.int32)
    x = jax.random.normal(jax.random.key(0), (T, cfg.hidden_size))
    X = jnp.broadcast_to(x[:, None, :], (T, cfg.hc_mult, cfg.hidden_size))

    rows: list[tuple[str, int, float, float]] = []
    whole = _time(lambda p, s, t: forward_chunk(p, s, t, nv, cfg=cfg), params, st, toks, reps=reps)
    kinds = Counter(cfg.attn_types)
    for kind in ("sliding", "csa", "hca"):
        if not kinds[kind]:
            continue
        i = cfg.attn_types.index(kind)

        def attn(p: Any, ls: Any, x: Any, i: int = i) -> Any:
            return L.attention(cfg, i, p, ls, x, pos, n, nv)

        lp = params["layers"][i]
        rows.append(
            (f"attention {kind}", kinds[kind], *_time(attn, lp["attn"], st.layers[i], x, reps=reps))
        )
    hashed = Counter(cfg.hash_layers)
    for h in (True, False):
        if not hashed[h]:
            continue
        i = cfg.hash_layers.index(h)

        def moe(p: Any, x: Any, h: bool = h) -> Any:
            return L.moe(cfg, p, x, toks, h)

        name = "moe hash" if h else "moe learned"
        rows.append((name, hashed[h], *_time(moe, params["layers"][i]["ffn"], x, reps=reps)))
    lp0 = params["layers"][0]

    def hc(X: Any, lp: Any) -> Any:
        _, post, comb = L.hc_pre(cfg, X, lp["hc_attn_fn"], lp["hc_attn_scale"], lp["hc_attn_base"])
        return L.hc_post(x, X, post, comb)

    rows.append(("hc pre+post", 2 * cfg.num_layers, *_time(hc, X, lp0, reps=reps)))

    def head(X: Any, p: Any) -> Any:
        return L.linear(L.rmsw(L.hc_head(cfg, X[-1:], p), p["norm"], cfg.rms_eps), p["head"])

    rows.append(("head (last token)", 1, *_time(head, X, params, reps=reps)))
    total = sum(c * best for _, c, best, _ in rows)
    log(
        f"\n-- chunk T={T} at position {start}, max_len {max_len}: forward_chunk "
        f"{whole[0] * 1e3:.1f} ms (median {whole[1] * 1e3:.1f}); load {os.getloadavg()[0]:.2f}"
    )
    log(f"{'part':<20} {'x':>3} {'ms each':>9} {'ms total':>9} {'share':>6}")
    for name, c, best, _ in rows:
        log(f"{name:<20} {c:>3} {best * 1e3:>9.2f} {c * best * 1e3:>9.1f} {c * best / total:>6.0%}")
    log(f"{'sum of parts':<20} {'':>3} {'':>9} {total * 1e3:>9.1f}")
    return {
        "T": T,
        "start": start,
        "max_len": max_len,
        "forward_chunk_ms": round(whole[0] * 1e3, 2),
        "parts": [
            {"part": nm, "count": c, "best_ms": round(b * 1e3, 3), "median_ms": round(m * 1e3, 3)}
            for nm, c, b, m in rows
        ],
        "sum_of_parts_ms": round(total * 1e3, 2),
    }


def main(argv: list[str] | None = None, deadline: float | None = None) -> dict:
    """`deadline` (a `time.perf_counter()` value): cases not started by then are skipped."""
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params

    quick = "--quick" in (argv or [])
    cfg = load_config("bench-192m")
    params = init_params(cfg, 0)
    log("bench-192m, each part jitted alone; best of the repeats")
    cases = (
        [(64, 128, 0), (1, 128, 64)]
        if quick
        else [(512, 576, 0), (512, 8256, 7680), (1, 576, 512), (1, 8256, 8192)]
    )
    out = []
    for T, ml, s in cases:
        if deadline is not None and time.perf_counter() > deadline:
            log(f"\n-- skipped chunk T={T} at {s}, max_len {ml}: over the bench's time budget")
            out.append({"T": T, "start": s, "max_len": ml, "skipped": "time budget"})
            continue
        out.append(breakdown(cfg, params, T, ml, s, reps=3 if quick else 7))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now().isoformat(timespec="seconds")
    stamp = now[:16].replace("T", "-").replace(":", "")
    path = RESULTS_DIR / f"layers-{stamp}{'-quick' if quick else ''}.json"
    rep = {"date": now, "config": "bench-192m", "loadavg_end": list(os.getloadavg()), "cases": out}
    path.write_text(json.dumps(rep, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {path}")
    return rep


if __name__ == "__main__":
    main()
