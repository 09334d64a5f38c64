"""The whole model on a borrowed accelerator: attention through the Pallas kernels against
the jnp twins (`attention_impl` "pallas" vs "xla") — the logits of a long prefill, and the
time of one prefill chunk and one decode step at that context.

    PYTHONPATH=. python3 -m bench.device_model --out model.json
    PYTHONPATH=. python3 -m bench.device_model --cpu-smoke   # small config, interpreted

Not a `make bench` part (it needs an accelerator to say anything about speed). The
kernel-level checks stay beside the kernels (`ds4jax/pallas_kernels/check_device.py`,
whose timing and error helpers this reuses); this one needs the model above them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.model.forward import forward_chunk, prefill
from ds4jax.model.params import init_params
from ds4jax.model.state import init_state
from ds4jax.pallas_kernels.check_device import Run, _compile, _err, _first_lines, _time


def model_check(run: Run, smoke: bool, reps: int, precision: str | None = None) -> None:
    """Whole model, attention_impl "pallas" against "xla": logits and per-chunk time."""
    if smoke:  # tests/model/conftest.py's small config
        base = Config(
            vocab_size=512, hidden_size=64, num_layers=5, num_heads=4, head_dim=64,
            rope_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
            compress_ratios=(0, 4, 8, 4, 8), hash_layers=(True, True, False, False, False),
            index_heads=16, index_head_dim=64, index_topk=5, quant_sim=False,
        )  # fmt: skip
        n_ctx, chunk = 40, 16
    else:  # V4 Flash attention dims (heads, head_dim, indexer, top-k, window), small rest
        base = Config(
            vocab_size=1024, hidden_size=512, num_layers=3, compress_ratios=(0, 4, 128),
            hash_layers=(True, False, False), num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, quant_sim=False,
        )  # fmt: skip
        n_ctx, chunk = 8192, 512
    toks = np.random.default_rng(0).integers(0, base.vocab_size, n_ctx + chunk)
    results: dict[str, Any] = {}
    for impl in ("xla", "pallas"):
        if run.left() < 0:
            print("    (budget spent: model check cut short)", flush=True)
            return
        row: dict[str, Any] = {"impl": impl, "n_ctx": n_ctx, "chunk": chunk,
                               "precision": precision or "default"}  # fmt: skip
        ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
        try:
            with ctx:
                cfg = base.replace(attention_impl=impl)
                params = init_params(cfg, seed=5)
                t = time.perf_counter()
                state, logits = prefill(
                    params, init_state(cfg, n_ctx + 2 * chunk), toks[:n_ctx], cfg,
                    chunk_sizes=(chunk,), all_logits=True,
                )  # fmt: skip
                row["prefill_s_with_compile"] = time.perf_counter() - t
                results[impl] = np.asarray(logits)
                chunk_toks = jnp.asarray(toks[n_ctx:], jnp.int32)
                one = jnp.asarray(toks[n_ctx : n_ctx + 1], jnp.int32)
                # forward_chunk is jitted itself; params stay arguments, not baked-in constants
                pre = partial(forward_chunk, params, n_valid=chunk, cfg=cfg)
                dec = partial(forward_chunk, params, n_valid=1, cfg=cfg)
                for name, fn, x in (("chunk", pre, chunk_toks), ("decode", dec, one)):
                    _compile(fn, (state, x))
                    row[f"{name}_ms"] = _time(fn, (state, x), reps) * 1e3
                print(f"    model {impl}: chunk of {chunk} {row['chunk_ms']:.2f} ms, decode "
                      f"{row['decode_ms']:.2f} ms at {n_ctx} tokens", flush=True)  # fmt: skip
        except Exception as e:
            row["error"] = _first_lines(e, 12)
            print(f"    model {impl}: FAILED {row['error']}", flush=True)
            traceback.print_exc(limit=3)
        run.doc["model"].append(row)
        run.save()
    if len(results) == 2:
        e = _err(results["pallas"], results["xla"])
        run.doc["model"].append({"logits_pallas_vs_xla": e})
        print(f"    model logits pallas vs xla: rel {e['rel']:.2e} max {e['max_abs']:.2e}")
        run.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    ap.add_argument("--cpu-smoke", action="store_true", help="small config, interpreted")
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop after this")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--precision", default=None, help='e.g. "highest"')
    a = ap.parse_args(argv)
    if not a.cpu_smoke and jax.default_backend() == "cpu":
        print("no accelerator: pass --cpu-smoke for the interpreted check", file=sys.stderr)
        return 2
    run = Run(a.out, a.budget_s)
    run.doc = {"env": {"jax": jax.__version__, "backend": jax.default_backend(),
                       "devices": [str(d) for d in jax.devices()],
                       "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, "model": []}  # fmt: skip
    model_check(run, a.cpu_smoke, a.reps, a.precision)
    failed = [r for r in run.doc["model"] if "error" in r]
    print(json.dumps(run.doc["model"], default=str)[:2000])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
