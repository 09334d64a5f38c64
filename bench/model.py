"""Model speed, side by side in one run: ds4jax against transformers' `DeepseekV4ForCausalLM`
on the same random config (`bench-192m` by default), and state bytes per token.

* Prefill tokens/s at 512 / 2048 / 8192 tokens. ds4jax: `prefill` (chunks of up to 512)
  into `init_state(cfg, n + 64)`; the first call of each state shape compiles, and that
  call is reported separately. transformers: float32, eval, `torch.inference_mode()`, 2
  threads, one forward with `use_cache=True` and `logits_to_keep=1` (what generation does
  on its first step).
* Decode tokens/s: greedy steps after a 512-token prefill; ds4jax through the server's
  batched step at batch size 1 (greedy inside the jit), the token read back to the host
  every step; transformers forward one token at a time with the returned cache (no
  `generate` overheads). Only the steps are timed.
* State bytes per token for `deepseek-v4-flash` and the bench config: `state_bytes(cfg, n)`
  against `dense_kv_bytes(cfg, n)` (pure arithmetic).

Repeats alternate ds4jax and transformers so a change of load hits both; past a minimum
they go on (up to a maximum) while either side's two best times differ by more than 10%;
the table shows the best, the JSON every time and the load average after each pair. One
run each at 8192. On a shared machine the best is the figure to quote, and the load
column says whether to trust it: transformers' OpenMP threads spin at barriers and slow
down far more than XLA's pool when a third process shares the 2 cores (10–30x, seen
here), so ratios from a loaded run flatter ds4jax. `--budget-min` caps the part: extra
repeats, and an 8192 run predicted to overrun, are skipped and listed as skipped.

Results are printed and written to `bench/results/model-<date>-<HHMM>[-quick].json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Figures the team reported earlier (not measured by this bench): context for the table.
REPORTED = {
    "note": "reported earlier, not measured in this run",
    "transformers": {"prefill": {512: 1000, 2048: 430, 8192: 108}, "decode": 19},
    "llama.cpp": {"prefill": {512: 1080, 2048: 1030, 8192: 740}, "decode": 79},
}

STATE_CONFIGS = ("deepseek-v4-flash", "bench-192m")
STATE_LENGTHS = (1024, 4096, 16384, 65536, 262144)


def log(msg: str) -> None:
    print(msg, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench model", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="128/512 tokens, 8 decode steps")
    ap.add_argument("--config", default="bench-192m")
    ap.add_argument("--sizes", help="prefill sizes, comma separated (default 512,2048,8192)")
    ap.add_argument(
        "--repeats",
        type=int,
        help="fixed repeats of sizes <= 2048 (default: adaptive, 5..8 at 512, 3..5 at 2048)",
    )
    ap.add_argument("--decode-ctx", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, help="greedy steps (default 32; quick 8)")
    ap.add_argument("--no-hf", action="store_true", help="ds4jax only")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=2,
        help="transformers' threads (default 2; 1 is far steadier on a loaded machine)",
    )
    ap.add_argument(
        "--budget-min",
        type=float,
        default=12.0,
        help="soft cap on this part's minutes: extra repeats and a large transformers run "
        "predicted to overrun it are skipped (and say so)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- state bytes


def state_table() -> list[dict[str, Any]]:
    from ds4jax.config import load_config
    from ds4jax.model.state import dense_kv_bytes, state_bytes

    rows = []
    log("\nstate bytes per token (float32 values; both include the next-token logits)")
    log(f"{'config':<18} {'tokens':>7} {'state B/tok':>12} {'dense KV B/tok':>15} {'ratio':>7}")
    for name in STATE_CONFIGS:
        cfg = load_config(name)
        for n in STATE_LENGTHS:
            s, d = state_bytes(cfg, n) / n, dense_kv_bytes(cfg, n) / n
            rows.append(
                {"config": name, "tokens": n, "state_per_token": s, "dense_per_token": d}
                | {"dense_over_state": d / s}
            )
            log(f"{name:<18} {n:>7,} {s:>12,.0f} {d:>15,.0f} {d / s:>6.2f}x")
    return rows


# ---------------------------------------------------------------- the two engines


def _sync(x: Any) -> None:
    import jax

    jax.block_until_ready(x)


class Ds4jax:
    def __init__(self, cfg: Any, seed: int) -> None:
        import jax

        from ds4jax.model.params import init_params

        self.cfg = cfg
        t0 = time.perf_counter()
        self.params = init_params(cfg, seed)
        _sync(self.params)
        self.init_s = time.perf_counter() - t0
        self.n_params = int(sum(x.size for x in jax.tree.leaves(self.params)))

    def state(self, max_len: int) -> Any:
        from ds4jax.model.state import init_state

        return init_state(self.cfg, max_len)

    def prefill(self, state: Any, tokens: np.ndarray) -> tuple[float, Any]:
        from ds4jax.model.forward import prefill

        t0 = time.perf_counter()
        state, logits = prefill(self.params, state, tokens, self.cfg)
        _sync(logits)
        return time.perf_counter() - t0, state

    def decode(self, state: Any, steps: int) -> float:
        """Greedy tokens from `state` (left untouched) as the server decodes a row that only
        samples: `model.batch.burst` programs of up to `BURST_STEPS` tokens at batch size 1
        (tokens chosen inside the program, the batch donated), the tokens read back to the
        host after each program."""
        import jax
        import numpy as np

        from bench.ops import step_args
        from ds4jax.model import batch as batch_ops

        batch = jax.tree.map(lambda x: jax.numpy.array(x)[None], state)
        _, *args = step_args(1)
        K = batch_ops.BURST_STEPS
        t0 = time.perf_counter()
        for done in range(0, steps, K):
            allowed = np.full(1, min(K, steps - done), np.int32)
            batch, toks, _, _ = batch_ops.burst(self.params, batch, allowed, *args,
                                                cfg=self.cfg, size=1)  # fmt: skip
            np.asarray(toks)
        return time.perf_counter() - t0


class Transformers:
    def __init__(self, cfg: Any, params: Any, seed: int, threads: int = 2) -> None:
        import torch
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

        from ds4jax.config import to_hf_config

        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.torch = torch
        t0 = time.perf_counter()
        self.model = DeepseekV4ForCausalLM(DeepseekV4Config(**to_hf_config(cfg))).float().eval()
        # transformers' default tid2eid is all zeros (every token to expert 0): use
        # ds4jax's table (distinct experts per token), so hash layers route alike.
        for layer, lp in zip(self.model.model.layers, params["layers"], strict=True):
            if "tid2eid" in lp["ffn"]:
                t2e = torch.from_numpy(np.asarray(lp["ffn"]["tid2eid"]).astype(np.int64))
                layer.mlp.gate.tid2eid.copy_(t2e)
        self.init_s = time.perf_counter() - t0
        self.n_params = int(sum(p.numel() for p in self.model.parameters()))
        self.experts_impl = self.model.config._experts_implementation
        self.attn_impl = self.model.config._attn_implementation

    def _ids(self, tokens: np.ndarray) -> Any:
        return self.torch.tensor(np.asarray(tokens, np.int64)[None])

    def prefill(self, tokens: np.ndarray) -> tuple[float, Any]:
        ids = self._ids(tokens)
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(ids, use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t0
        return dt, out

    def decode(self, tokens: np.ndarray, steps: int) -> float:
        """Prefill `tokens` (untimed), then `steps` greedy one-token forwards on its cache."""
        _, out = self.prefill(tokens)
        cache = out.cache
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                out = self.model(nxt, cache=cache, use_cache=True)
                cache = out.cache
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            int(nxt)
            return time.perf_counter() - t0


# ---------------------------------------------------------------- the runs


#: A size's own ds4jax run may overrun the budget by this much before it is skipped.
GRACE_S = 60.0

#: Two best times within this factor: enough repeats.
STABLE = 1.10


def _best(times: list[float]) -> float | None:
    return min(times) if times else None


def _stable(times: list[float]) -> bool:
    t = sorted(times)
    return len(t) < 2 or t[1] <= STABLE * t[0]


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _summary(n: int, times: list[float]) -> dict[str, Any]:
    if not times:
        return {"times_s": [], "best_s": None, "median_s": None, "tok_s": None}
    best = min(times)
    return {
        "times_s": [round(t, 4) for t in times],
        "best_s": round(best, 4),
        "median_s": round(statistics.median(times), 4),
        "tok_s": round(n / best, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp  # noqa: F401  (imported here so its import is not timed later)

    from ds4jax.config import load_config
    from ds4jax.model.forward import CHUNK_SIZES

    t_start = time.perf_counter()
    deadline = t_start + 60 * args.budget_min
    quick = args.quick
    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else ([128, 512] if quick else [512, 2048, 8192])
    )
    sizes = sorted(sizes)
    steps = args.decode_steps or (8 if quick else 32)
    ctx = args.decode_ctx

    def repeats_for(n: int) -> tuple[int, int]:
        """(at least, at most) interleaved repeats: past the minimum, repeat while either
        side's two best times differ by more than `STABLE` (a shared, noisy machine)."""
        if n > 2048:
            return 1, 1
        if args.repeats:
            return args.repeats, args.repeats
        if quick:
            return 2, 4
        return (5, 8) if n <= 512 else (3, 5)

    def left() -> float:
        return deadline - time.perf_counter()

    report: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "quick": quick,
        "config": args.config,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        },
        "reported_earlier": REPORTED,
    }
    report["state_bytes"] = state_table()

    cfg = load_config(args.config)
    log(
        f"\nmodel {args.config}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size:,}"
    )
    log(f"load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus")
    jx = Ds4jax(cfg, args.seed)
    log(f"ds4jax init_params {jx.init_s:.1f} s ({jx.n_params / 1e6:.1f}M params)")
    hf = None
    if not args.no_hf:
        import torch
        import transformers

        hf = Transformers(cfg, jx.params, args.seed, args.torch_threads)
        log(
            f"transformers build {hf.init_s:.1f} s ({hf.n_params / 1e6:.1f}M params, "
            f"experts={hf.experts_impl}, attention={hf.attn_impl}, threads {args.torch_threads})"
        )
        report["versions"] = {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
    else:
        report["versions"] = {"jax": jax.__version__}
    report["setup"] = {
        "ds4jax_init_params_s": round(jx.init_s, 2),
        "ds4jax_params": jx.n_params,
        "ds4jax_chunk_sizes": list(CHUNK_SIZES),
        "ds4jax_max_len": "n + 64 per prefill size; decode ctx + max(64, steps)",
        "transformers_build_s": round(hf.init_s, 2) if hf else None,
        "transformers_params": hf.n_params if hf else None,
        "transformers_experts_implementation": hf.experts_impl if hf else None,
        "transformers_attn_implementation": hf.attn_impl if hf else None,
        "transformers_prefill": "one forward, use_cache=True, logits_to_keep=1",
        "torch_threads": args.torch_threads,
        "ds4jax_backend": jax.default_backend(),
        "ds4jax_attention_impl": getattr(cfg, "attention_impl", None),
        "tokens": f"uniform random ids in [2, vocab), numpy seed {args.seed}",
    }

    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(2, cfg.vocab_size, max(max(sizes), ctx)).astype(np.int32)

    if hf is not None:  # first-call overheads (allocator, lazy init): one untimed forward
        dt, out = hf.prefill(tokens[: min(sizes[0], 512)])
        del out
        log(f"transformers warm-up forward ({min(sizes[0], 512)} tokens) {dt:.2f} s")

    prefill_rows: list[dict[str, Any]] = []
    hf_times_by_n: dict[int, list[float]] = {}
    jx_times_by_n: dict[int, list[float]] = {}

    def interleave(
        count: int,
        reps: tuple[int, int],
        run_jax: Callable[[], float],
        run_hf: Callable[[], float] | None,
        predicted_hf: float | None = None,
    ) -> tuple[list[float], list[float], list[float], list[str]]:
        """Alternate ds4jax and transformers runs (so load changes hit both); returns
        (ds4jax times, transformers times, load average after each pair, skip notes)."""
        lo, hi = reps
        jt: list[float] = []
        ht: list[float] = []
        loads: list[float] = []
        skipped: list[str] = []
        for r in range(hi):
            if r >= lo and _stable(jt) and _stable(ht):
                break
            if r and left() < 0:
                skipped.append(f"repeats {r + 1}+: over the {args.budget_min} min budget")
                break
            dt = run_jax()
            jt.append(dt)
            log(f"  [{r + 1}] ds4jax       {dt:8.2f} s  {count / dt:9.1f} tok/s   load {_load()}")
            if run_hf is not None:
                if predicted_hf is not None and predicted_hf > left():
                    msg = f"transformers: predicted {predicted_hf:.0f} s > {left():.0f} s left"
                    skipped.append(msg)
                    log(f"  skip {msg}")
                else:
                    if predicted_hf is not None:
                        log(f"  transformers: one run, ~{predicted_hf:.0f} s predicted ...")
                    dt = run_hf()
                    ht.append(dt)
                    log(
                        f"  [{r + 1}] transformers {dt:8.2f} s  {count / dt:9.1f} tok/s"
                        f"   load {_load()}"
                    )
            loads.append(_load())
        return jt, ht, loads, skipped

    def finish_row(row: dict[str, Any], count: int, jt, ht, loads, skipped) -> dict[str, Any]:
        bj, bh = _best(jt), _best(ht)
        row |= {
            "ds4jax": _summary(count, jt),
            "transformers": _summary(count, ht),
            "ratio": round(bh / bj, 3) if bj and bh else None,
            "loadavg": loads,
            "skipped": skipped,
        }
        return row

    def prefill_size(n: int) -> None:
        max_len = n + 64
        reps = repeats_for(n)
        log(f"\n-- prefill {n} tokens (ds4jax max_len {max_len}; repeats {reps[0]}..{reps[1]})")
        if n > 2048 and jx_times_by_n:  # chunks cost more as the row capacity grows
            k = max(jx_times_by_n)
            predicted_jx = min(jx_times_by_n[k]) * (n / k) * 1.5
            if predicted_jx > left() + GRACE_S:
                msg = f"ds4jax {n}: predicted {predicted_jx:.0f} s > {left():.0f} s left"
                log(f"  skip {msg} (and transformers)")
                row = {"tokens": n, "ds4jax_max_len": max_len, "ds4jax_compile_s": None}
                prefill_rows.append(finish_row(row, n, [], [], [], [msg]))
                return
        predicted_hf = None
        measured = [k for k, v in hf_times_by_n.items() if v]
        if n > 2048 and measured:  # attention grows ~quadratically: scale the largest one
            k = max(measured)
            predicted_hf = min(hf_times_by_n[k]) * (n / k) ** 2
        # ds4jax warm-up: the first chunk compiles the only program this size runs
        w = min(n, max(CHUNK_SIZES))
        first, _ = jx.prefill(jx.state(max_len), tokens[:w])
        again, _ = jx.prefill(jx.state(max_len), tokens[:w])
        compile_s = max(first - again, 0.0)
        log(
            f"ds4jax first call ({w} tokens) {first:.2f} s, again {again:.2f} s "
            f"-> compile ~{compile_s:.1f} s"
        )

        def run_jax() -> float:
            dt, _ = jx.prefill(jx.state(max_len), tokens[:n])
            return dt

        def run_hf() -> float:
            gc.collect()
            dt, out = hf.prefill(tokens[:n])
            del out
            gc.collect()
            return dt

        res = interleave(n, reps, run_jax, run_hf if hf else None, predicted_hf)
        hf_times_by_n[n] = res[1]
        jx_times_by_n[n] = res[0]
        row = {
            "tokens": n,
            "ds4jax_max_len": max_len,
            "ds4jax_first_call_s": round(first, 3),
            "ds4jax_compile_s": round(compile_s, 2),
        }
        prefill_rows.append(finish_row(row, n, *res))

    def decode() -> dict[str, Any]:
        max_len = ctx + max(64, steps)
        reps = (2, 4) if quick else (3, 6)
        log(
            f"\n-- decode: {steps} greedy steps after a {ctx}-token prefill "
            f"(ds4jax max_len {max_len}; repeats {reps[0]}..{reps[1]})"
        )
        pt, st = jx.prefill(jx.state(max_len), tokens[:ctx])
        first = jx.decode(st, 1)
        again = jx.decode(st, 1)
        compile_s = max(first - again, 0.0)
        log(
            f"ds4jax prefill {pt:.2f} s; first decode step {first:.2f} s, again {again:.3f} s "
            f"-> compile ~{compile_s:.1f} s"
        )
        if hf is not None:
            hf.decode(tokens[:ctx], 2)  # warm-up
        res = interleave(
            steps,
            reps,
            lambda: jx.decode(st, steps),
            (lambda: hf.decode(tokens[:ctx], steps)) if hf else None,
        )
        row = {
            "context": ctx,
            "steps": steps,
            "ds4jax_max_len": max_len,
            "ds4jax_first_step_s": round(first, 3),
            "ds4jax_compile_s": round(compile_s, 2),
        }
        return finish_row(row, steps, *res)

    # the largest size last, after decode: it is the one a budget may cut
    for n in sizes[:-1]:
        prefill_size(n)
    report["decode"] = decode()
    prefill_size(sizes[-1])
    report["prefill"] = prefill_rows
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    return report


# ---------------------------------------------------------------- output


def _fmt(x: float | None, spec: str = "9,.1f") -> str:
    return format(x, spec) if x is not None else "        -"


def _median_tok_s(side: dict[str, Any], count: int) -> float | None:
    return count / side["median_s"] if side["median_s"] else None


def print_table(rep: dict[str, Any]) -> None:
    log(
        f"\n{rep['config']}: tokens/s, best of the repeats; ratio = ds4jax / transformers; "
        "medians in brackets"
    )
    log(
        f"{'':<15} {'ds4jax':>9} {'transformers':>13} {'ratio':>7}   "
        f"{'(median ds4jax / transformers)':<31} {'compile s':>9}"
    )
    rows = [(f"prefill {row['tokens']:>6}", row["tokens"], row) for row in rep["prefill"]]
    d = rep["decode"]
    rows.append((f"decode {d['steps']:>3}@{d['context']:<4}", d["steps"], d))
    for label, count, row in rows:
        r = row["ratio"]
        med = (
            "("
            + " / ".join(
                _fmt(_median_tok_s(row[k], count), ".1f").strip()
                for k in ("ds4jax", "transformers")
            )
            + ")"
        )
        log(
            f"{label:<15} {_fmt(row['ds4jax']['tok_s'])} "
            f"{_fmt(row['transformers']['tok_s'], '13,.1f')} "
            f"{(f'{r:6.2f}x' if r else '      -'):>7}   {med:<31} "
            f"{_fmt(row['ds4jax_compile_s'], '9.1f')}"
        )
        for s in row["skipped"]:
            log(f"  (skipped {s})")
    ref = rep["reported_earlier"]
    log(f"\n{ref['note']} (different runs, for context):")
    for eng in ("transformers", "llama.cpp"):
        pre = " / ".join(f"{v:,}" for v in ref[eng]["prefill"].values())
        sizes = "/".join(str(k) for k in ref[eng]["prefill"])
        log(f"  {eng:<13} prefill {sizes}: {pre} tok/s; decode ~{ref[eng]['decode']} tok/s")
    la = rep["machine"]
    log(
        f"\nload average start {la['loadavg_start'][0]:.2f}, end {la['loadavg_end'][0]:.2f} "
        f"on {la['cpus']} cpus (above ~{la['cpus']} means other processes shared the cores)"
    )
    log(f"model bench took {rep['total_s']:.0f} s")


def write_json(rep: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = rep["date"][:16].replace("T", "-").replace(":", "")  # 2026-01-31-1405
    path = out_dir / f"model-{stamp}{'-quick' if rep['quick'] else ''}.json"
    path.write_text(json.dumps(rep, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rep = run(args)
    print_table(rep)
    path = write_json(rep, args.out)
    log(f"wrote {path}")
    return rep


if __name__ == "__main__":
    main()
