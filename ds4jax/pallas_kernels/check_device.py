"""Device check for the Pallas kernels: do they lower and compile (Triton on GPU), do they
compute their twins' function on V4 Flash shapes, and how fast are they against the twins.

    PYTHONPATH=. python3 ds4jax/pallas_kernels/check_device.py --out kernels.json
    PYTHONPATH=. python3 ds4jax/pallas_kernels/check_device.py --cpu-smoke   # tiny, interpreted

A script for a borrowed accelerator, not a test: it imports only jax, numpy and the kernels
beside it (nothing above them: the whole-model timing on a device is `bench/device_model.py`),
catches each case's failure so one bad lowering does not end the run, writes the JSON after
every case (a run cut off by its time limit still leaves its results), and skips the
optional block-size sweep once `--budget-s` is spent.

Correctness: the truth is the twin under `jax.default_matmul_precision("highest")` (IEEE
float32 dots). The kernel is checked twice: at "highest" (must match to float32 rounding,
so any indexing or masking error shows) and at the default precision, where both Triton
and XLA run float32 dots as TF32 on tensor cores (error ~1e-4..1e-3 relative, reported
beside the twin's own). Times: median of repeated loops of asynchronous calls (so the
per-call dispatch is amortised), each loop ~20 ms, after a compile call and a warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.pallas_kernels.indexer_scores import BlockSizes as IndexerBlocks
from ds4jax.pallas_kernels.indexer_scores import indexer_scores, indexer_scores_reference
from ds4jax.pallas_kernels.paged_attention import BlockSizes as PagedBlocks
from ds4jax.pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from ds4jax.pallas_kernels.sink_attention import BlockSizes as SinkBlocks
from ds4jax.pallas_kernels.sink_attention import sink_attention, sink_attention_reference
from ds4jax.pallas_kernels.sparse_attention import BlockSizes as SparseBlocks
from ds4jax.pallas_kernels.sparse_attention import sparse_attention, sparse_attention_reference

EXACT_TOL = 1e-5  # relative, kernel at "highest" vs the twin at "highest"
TF32_TOL = 1e-2  # relative, kernel at the default precision (TF32 on GPU)

# V4 Flash: 64 heads × 512, indexer 64 × 128, top-512, window 128, CSA ratio 4, HCA 128
H, D, IH, ID, TOPK, W = 64, 512, 64, 128, 512, 128
PAGE_TOKENS = 256  # model.page_table.PAGE_TOKENS (not imported: nothing above the kernels)

#: ops with no lowering on a platform: their cases time the twin only and are not failures
NO_LOWERING = {"gpu": {"paged_attention": "scalar prefetch has no Triton/Mosaic GPU lowering"}}


class Run:
    def __init__(self, out: Path | None, budget_s: float) -> None:
        self.out, self.budget_s, self.t0 = out, budget_s, time.perf_counter()
        self.doc: dict[str, Any] = {"env": {}, "cases": [], "sweeps": []}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.doc, indent=1, default=str))


def _err(out: Any, ref: Any) -> dict[str, Any]:
    a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(b)
    with np.errstate(invalid="ignore"):  # −∞ − −∞ where both are masked
        d = np.where(fin, a - b, 0.0)
    return {
        "rel": float(np.linalg.norm(d) / max(np.linalg.norm(np.where(fin, b, 0.0)), 1e-30)),
        "max_abs": float(np.abs(d).max(initial=0.0)),
        "inf_pattern_ok": bool(np.array_equal(np.isinf(a), np.isinf(b))),
        "nan": bool(np.isnan(a).any()),
    }


def _time(fn: Callable, args: tuple, reps: int, loop_s: float = 0.02) -> float:
    """Median seconds per call; `fn` already compiled and warmed by the caller."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    n = int(min(200, max(1, loop_s / max(time.perf_counter() - t, 1e-6))))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def _chained(fn: Callable, n: int) -> Callable:
    """n dependent calls in one jitted program (unrolled, so no per-iteration host sync):
    the device time of one call without the host's dispatch, which dominates at decode
    sizes. The zero-weighted feedback keeps XLA from hoisting or merging the calls."""

    def chained(*args: Any) -> Any:
        first, rest = args[0], args[1:]
        out = None
        for _ in range(n):
            out = fn(first, *rest)
            c = jnp.ravel(out)[0]
            first = first + jnp.where(jnp.isfinite(c), c, 0.0).astype(first.dtype) * 0
        return out

    return jax.jit(chained)


def _compile(fn: Callable, args: tuple, precision: str | None = None) -> tuple[Any, float]:
    t = time.perf_counter()
    if precision:
        with jax.default_matmul_precision(precision):
            out = jax.block_until_ready(fn(*args))
    else:
        out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t


def _first_lines(e: BaseException, n: int = 6) -> str:
    lines = [ln for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    return "\n".join(lines[:n])


# ----------------------------------------------------------------------- inputs


def sink_inputs(seed: int, T: int, K: int, h: int = H, d: int = D) -> tuple:
    k = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(k[0], (T, h, d)),
        jax.random.normal(k[1], (K, d)),
        jax.random.bernoulli(k[2], 0.7, (T, K)),
        jax.random.normal(k[3], (h,)),
    )


def indexer_inputs(seed: int, T: int, C: int, ih: int = IH, d: int = ID) -> tuple:
    k = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(k[0], (T, ih, d)),
        jax.random.normal(k[1], (T, ih)) * ih**-0.5,
        jax.random.normal(k[2], (C, d)),
        jax.random.bernoulli(k[3], 0.8, (T, C)),
    )


def sparse_inputs(seed: int, T: int, C: int, k_sel: int = TOPK, h: int = H, d: int = D) -> tuple:
    k = jax.random.split(jax.random.key(seed), 7)
    Kr = W + T
    return (
        jax.random.normal(k[0], (T, h, d)),
        jax.random.normal(k[1], (Kr, d)),
        jax.random.bernoulli(k[2], 0.6, (T, Kr)),
        jax.random.normal(k[3], (C, d)),
        jax.random.randint(k[4], (T, k_sel), 0, C, jnp.int32),
        jax.random.bernoulli(k[5], 0.9, (T, k_sel)),
        jax.random.normal(k[6], (h,)),
    )


def paged_inputs(seed: int, T: int, ctx: int, cap: int, ratio: int, h: int = H,
                 d: int = D) -> tuple:  # fmt: skip
    """A chunk of T queries ending at `ctx` tokens: its sequence holds ctx/256 pages at
    shuffled ids of a pool twice that size, its table padded with the null page to the
    capacity `cap`, and query t sees the rows its position completes."""
    k = jax.random.split(jax.random.key(seed), 6)
    R, held, width = PAGE_TOKENS // ratio, -(-ctx // PAGE_TOKENS), -(-cap // PAGE_TOKENS)
    P = 2 * held + 1
    ids = 1 + jax.random.permutation(k[4], P - 1)[:held].astype(jnp.int32)
    Kr = W + T
    return (
        jax.random.normal(k[0], (T, h, d)),
        jax.random.normal(k[1], (Kr, d)),
        jax.random.bernoulli(k[2], 0.6, (T, Kr)),
        jax.random.normal(k[3], (P, R, d)),
        jnp.pad(ids, (0, width - held)),
        (jnp.arange(ctx - T, ctx, dtype=jnp.int32) + 1) // ratio,
        jax.random.normal(k[5], (h,)),
    )


OPS = {
    "sink_attention": (sink_attention, sink_attention_reference, sink_inputs),
    "indexer_scores": (indexer_scores, indexer_scores_reference, indexer_inputs),
    "sparse_attention": (sparse_attention, sparse_attention_reference, sparse_inputs),
    "paged_attention": (paged_attention, paged_attention_reference, paged_inputs),
}


def cases(smoke: bool) -> list[tuple[str, dict[str, int]]]:
    if smoke:
        return [
            ("sink_attention", dict(T=1, K=40, h=4, d=64)),
            ("sink_attention", dict(T=5, K=70, h=4, d=64)),
            ("indexer_scores", dict(T=3, C=50, ih=16, d=32)),
            ("sparse_attention", dict(T=3, C=60, k_sel=5, h=4, d=64)),
            ("paged_attention", dict(T=1, ctx=700, cap=1024, ratio=4, h=4, d=64)),
            ("paged_attention", dict(T=5, ctx=1000, cap=2048, ratio=128, h=4, d=64)),
        ]
    out: list[tuple[str, dict[str, int]]] = []
    # dense attention: window + chunk + CSA rows (ctx/4) through a mask, as the model runs
    # CSA up to 64k context (and HCA/sliding layers, which have fewer keys)
    for T, ctx in [(1, 1024), (1, 8192), (1, 65536), (64, 8192), (256, 8192), (256, 65536),
                   (512, 1024), (512, 65536)]:  # fmt: skip
        out.append(("sink_attention", dict(T=T, K=W + T + ctx // 4)))
    for T, ctx in [(1, 1024), (1, 8192), (1, 65536), (64, 65536), (256, 65536), (512, 65536)]:
        out.append(("indexer_scores", dict(T=T, C=ctx // 4)))
    # the gather path: CSA beyond 64k context (here 64k and 256k rows' worth)
    for T, ctx in [(1, 65536), (1, 262144), (64, 65536), (256, 262144), (512, 65536)]:
        out.append(("sparse_attention", dict(T=T, C=ctx // 4)))
    # attention over pages, CSA (64-row pages) and HCA (2-row pages): the cost should
    # follow the pages held (ctx), not the table's capacity (cap), which the twin gathers
    for T, ctx, cap, ratio in [(1, 8192, 65536, 4), (1, 65536, 65536, 4), (64, 8192, 65536, 4),
                               (256, 65536, 65536, 4), (1, 2048, 262144, 4),
                               (1, 65536, 1048576, 128), (256, 65536, 262144, 128)]:  # fmt: skip
        out.append(("paged_attention", dict(T=T, ctx=ctx, cap=cap, ratio=ratio)))
    return out


CHAIN = 10  # calls per chained program


def check_case(run: Run, op: str, shape: dict[str, int], reps: int, interpret: bool,
               highest: bool = True) -> None:  # fmt: skip
    kernel, twin, make = OPS[op]
    row: dict[str, Any] = {"op": op, **shape}
    print(f"--- {op} {shape}", flush=True)
    why = NO_LOWERING.get(jax.default_backend(), {}).get(op)
    if why and not interpret:
        skip_case(run, row, twin, lambda: make(1, **shape), why, reps)
        return
    try:
        args = make(1, **shape)
        kern = jax.jit(partial(kernel, interpret=interpret))
        ref = jax.jit(twin)
        out_k, row["kernel_compile_s"] = _compile(kern, args)
        out_r, row["twin_compile_s"] = _compile(ref, args)
        if highest:
            truth, _ = _compile(ref, args, "highest")
            out_hi, _ = _compile(kern, args, "highest")
            row["kernel_highest"] = _err(out_hi, truth)
        else:  # truth: the twin at the default precision
            truth = out_r
        row["kernel_default"] = _err(out_k, truth)
        row["twin_default"] = _err(out_r, truth)
        # fresh inputs: the same function on other data
        args2 = make(2, **shape)
        row["kernel_default_seed2"] = _err(kern(*args2), ref(*args2))
        row["kernel_ms"] = _time(kern, args, reps) * 1e3
        row["twin_ms"] = _time(ref, args, reps) * 1e3
        row["speedup"] = row["twin_ms"] / row["kernel_ms"]
        if shape.get("T", 0) == 1 or shape.get("T", 0) == 64:  # dispatch-bound sizes
            for name, fn in (("kernel", kern), ("twin", ref)):
                ch = _chained(fn, CHAIN)
                _compile(ch, args)
                row[f"{name}_device_ms"] = _time(ch, args, reps) * 1e3 / CHAIN
            row["device_speedup"] = row["twin_device_ms"] / row["kernel_device_ms"]
        de = row["kernel_default"]
        hi = row.get("kernel_highest", {**de, "rel": 0.0})  # without it: the TF32 check only
        row["ok"] = bool(
            hi["rel"] <= EXACT_TOL and de["rel"] <= TF32_TOL
            and hi["inf_pattern_ok"] and de["inf_pattern_ok"] and not (hi["nan"] or de["nan"])
        )  # fmt: skip
        if "device_speedup" in row:
            print(f"    chained (device time): kernel {row['kernel_device_ms']:.4f} ms  twin "
                  f"{row['twin_device_ms']:.4f} ms (×{row['device_speedup']:.2f})")  # fmt: skip
        print(
            f"    ok={row['ok']} rel(highest)={row.get('kernel_highest', {}).get('rel', -1):.2e}"
            f" rel(default)={de['rel']:.2e} "
            f"twin rel(default)={row['twin_default']['rel']:.2e} | kernel {row['kernel_ms']:.3f}"
            f" ms  twin {row['twin_ms']:.3f} ms  (×{row['speedup']:.2f})",
            flush=True,
        )
    except Exception as e:  # one failing case must not end the run
        row["ok"], row["error"] = False, _first_lines(e, 12)
        print("    FAILED:", row["error"], flush=True)
        traceback.print_exc(limit=3)
    run.doc["cases"].append(row)
    run.save()


def skip_case(run: Run, row: dict[str, Any], twin: Callable, make: Callable[[], tuple],
              why: str, reps: int) -> None:  # fmt: skip
    """A kernel with no lowering here: record why, and the twin's time alone."""
    row["ok"], row["skipped"] = None, why
    try:
        args = make()
        ref = jax.jit(twin)
        _, row["twin_compile_s"] = _compile(ref, args)
        row["twin_ms"] = _time(ref, args, reps) * 1e3
        print(f"    skipped ({why}); twin {row['twin_ms']:.3f} ms", flush=True)
    except Exception as e:  # the twin must run everywhere: a failure, not a skip
        del row["skipped"]
        row["ok"], row["error"] = False, _first_lines(e, 12)
        print("    FAILED (twin):", row["error"], flush=True)
    run.doc["cases"].append(row)
    run.save()


def sweeps(smoke: bool) -> list[tuple[str, dict[str, int], list[Any]]]:
    sink_cfgs = [
        SinkBlocks(block_t=1, block_k=64, block_h=16, num_splits=1, num_warps=4, num_stages=1),
        SinkBlocks(block_t=1, block_k=32, block_h=32, num_splits=1, num_warps=8, num_stages=2),
        SinkBlocks(block_t=1, block_k=16, block_h=64, num_splits=1, num_warps=8, num_stages=2),
        SinkBlocks(block_t=2, block_k=32, block_h=16, num_splits=1, num_warps=8, num_stages=2),
    ]
    idx_cfgs = [
        IndexerBlocks(1, 64, num_warps=4, num_stages=2),
        IndexerBlocks(1, 128, num_warps=8, num_stages=2),
        IndexerBlocks(2, 64, num_warps=8, num_stages=2),
        IndexerBlocks(1, 32, num_warps=4, num_stages=3),
    ]
    sparse_cfgs = [
        SparseBlocks(16, 32, 32, num_warps=4, num_stages=2),
        SparseBlocks(32, 32, 32, num_warps=8, num_stages=2),
        SparseBlocks(64, 16, 16, num_warps=8, num_stages=2),
        SparseBlocks(16, 64, 64, num_warps=4, num_stages=1),
    ]
    paged_cfgs = [
        PagedBlocks(block_t=8, block_pages=1),
        PagedBlocks(block_t=8, block_pages=4),
        PagedBlocks(block_t=1, block_h=16, block_pages=2),
        PagedBlocks(block_t=16, block_h=16, block_pages=2),
    ]
    if smoke:
        return [
            ("sink_attention", dict(T=1, K=40, h=4, d=64), sink_cfgs[:2]),
            ("indexer_scores", dict(T=3, C=50, ih=16, d=32), idx_cfgs[:2]),
            ("sparse_attention", dict(T=3, C=60, k_sel=5, h=4, d=64), sparse_cfgs[:2]),
            ("paged_attention", dict(T=5, ctx=700, cap=1024, ratio=4, h=4, d=64), paged_cfgs[:2]),
        ]
    decode_split = [
        SinkBlocks(block_t=1, block_k=32, block_h=16, num_splits=s, num_warps=4, num_stages=2)
        for s in (8, 32, 128)
    ]
    return [
        ("sink_attention", dict(T=1, K=W + 1 + 65536 // 4), sink_cfgs + decode_split),
        ("sink_attention", dict(T=256, K=W + 256 + 65536 // 4), sink_cfgs),
        ("indexer_scores", dict(T=256, C=65536 // 4), idx_cfgs),
        ("indexer_scores", dict(T=1, C=65536 // 4), idx_cfgs),
        ("sparse_attention", dict(T=256, C=65536 // 4), sparse_cfgs),
        ("sparse_attention", dict(T=1, C=65536 // 4), sparse_cfgs),
        ("paged_attention", dict(T=256, ctx=65536, cap=65536, ratio=4), paged_cfgs),
        ("paged_attention", dict(T=1, ctx=65536, cap=1048576, ratio=128), paged_cfgs),
    ]


def sweep(run: Run, op: str, shape: dict[str, int], cfgs: list[Any], reps: int,
          interpret: bool) -> None:  # fmt: skip
    kernel, twin, make = OPS[op]
    if op in NO_LOWERING.get(jax.default_backend(), {}) and not interpret:
        return
    args = make(3, **shape)
    ref = jax.block_until_ready(jax.jit(twin)(*args))
    for bs in cfgs:
        if run.left() < 0:
            print("    (budget spent: sweep cut short)", flush=True)
            return
        row: dict[str, Any] = {"op": op, **shape, "block_sizes": repr(bs)}
        try:
            fn = jax.jit(partial(kernel, block_sizes=bs, interpret=interpret))
            out, row["compile_s"] = _compile(fn, args)
            row["err"] = _err(out, ref)
            row["kernel_ms"] = _time(fn, args, reps) * 1e3
            print(f"    {op} {shape} {bs}: {row['kernel_ms']:.3f} ms rel {row['err']['rel']:.1e}",
                  flush=True)  # fmt: skip
        except Exception as e:
            row["error"] = _first_lines(e)
            print(f"    {op} {shape} {bs}: FAILED {row['error']}", flush=True)
        run.doc["sweeps"].append(row)
        run.save()


def table(doc: dict[str, Any]) -> None:
    print("\n| op | shape | ok | rel err (highest) | rel err (default) | twin rel (default) "
          "| kernel ms | twin ms | twin/kernel |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in doc["cases"]:
        shape = " ".join(f"{k}={v}" for k, v in r.items() if isinstance(v, int) and k != "ok")
        if "error" in r:
            print(f"| {r['op']} | {shape} | FAIL | {r['error'].splitlines()[0][:80]} |||||")
            continue
        if "skipped" in r:
            print(f"| {r['op']} | {shape} | SKIP | {r['skipped']} |||| {r['twin_ms']:.3f} ||")
            continue
        hi = r.get("kernel_highest", {}).get("rel", float("nan"))
        print(f"| {r['op']} | {shape} | {r['ok']} | {hi:.1e} | "
              f"{r['kernel_default']['rel']:.1e} | {r['twin_default']['rel']:.1e} | "
              f"{r['kernel_ms']:.3f} | {r['twin_ms']:.3f} | {r['speedup']:.2f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpreted")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip optional parts after")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--skip", default="", help="comma list of sections: cases,sweeps")
    ap.add_argument("--filter", default="", help="only cases whose 'op k=v …' has this text")
    ap.add_argument("--no-highest", action="store_true", help="skip the IEEE-float32 check")
    a = ap.parse_args(argv)
    smoke = a.cpu_smoke
    interpret = jax.default_backend() == "cpu"
    run = Run(a.out, a.budget_s)
    dev = jax.devices()[0]
    run.doc["env"] = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": getattr(dev, "device_kind", "?"),
        "core_count": getattr(dev, "core_count", None),
        "interpret": interpret,
        "smoke": smoke,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    print(json.dumps(run.doc["env"]), flush=True)
    if not smoke and interpret:
        print("no accelerator: pass --cpu-smoke for the interpreted check", file=sys.stderr)
        return 2
    skip = set(a.skip.split(",")) - {""}
    if "cases" not in skip:
        for op, shape in cases(smoke):
            label = op + " " + " ".join(f"{k}={v}" for k, v in shape.items())
            if a.filter and not any(f in label for f in a.filter.split("|")):
                continue
            check_case(run, op, shape, a.reps, interpret, highest=not a.no_highest)
    if "sweeps" not in skip:
        for op, shape, cfgs in sweeps(smoke):
            if run.left() < 0:
                break
            print(f"--- sweep {op} {shape}", flush=True)
            sweep(run, op, shape, cfgs, a.reps, interpret)
    run.doc["elapsed_s"] = time.perf_counter() - run.t0
    run.save()
    table(run.doc)
    failed = [r for r in run.doc["cases"] if r.get("ok") is not True and "skipped" not in r]
    skipped = sum("skipped" in r for r in run.doc["cases"])
    print(f"\n{len(run.doc['cases']) - len(failed) - skipped}/{len(run.doc['cases'])} cases ok, "
          f"{skipped} skipped (no lowering), {run.doc['elapsed_s']:.0f} s", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
