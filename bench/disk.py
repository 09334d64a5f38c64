"""Disk checkpoints (`ds4jax.kvstore.disk.DiskStore`): what a save and a restore cost, and
what a restart gains over a cold prefill.

* Throughput of a 16k-token state, in f32 and with fp8 rows (`Config.state_dtype`: the
  rows stored as the release's records, decoded on load): `DiskStore.save` (device → host
  copy of the live rows,
  checksums, Orbax write, metadata, rename) and `lookup` + `DiskHit.load` (checksums, Orbax
  read, scatter into the full-capacity state), in MB/s of live state bytes, against Orbax
  alone on the same arrays and against a raw sequential write (numpy `tofile` + fsync) and
  read (`fromfile`) of the same bytes, all in the same run and directory. States are random
  live rows (no model needed): `tiny`, `bench-192m`, and, without `quick`, the real
  `deepseek-v4-flash` shapes. One unmeasured save first (it compiles the device slices for
  these row counts: `first_save_s`); then the median of the repeats. Reads come from the
  page cache (nothing is dropped), for the checkpoint and the raw file alike; Orbax does not
  fsync, the raw write does.
* Restart: the `tiny` model (random weights) at 4k and 16k tokens (1k and 4k with `quick`):
  a cold prefill of n + 128 tokens against lookup + load of an n-token checkpoint + prefill
  of the 128-token suffix, and the largest logit difference between the two.

    python -m bench.disk [--quick]

Results are printed and written to `bench/results/disk-<date>-<HHMM>[-quick].json`.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MB = 1e6
SUFFIX = 128


def log(msg: str) -> None:
    print(msg, flush=True)


def use_compile_cache() -> None:
    """The persistent XLA cache `ds4jax serve` uses, unless one is configured already."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.expanduser(
            "~/.cache/ds4jax/xla"
        )
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def random_state(cfg: Any, n: int, max_len: int, seed: int = 0) -> Any:
    """A canonical state of `n` tokens with random live rows (what a prefill leaves, as far
    as sizes and the store go)."""
    import jax.numpy as jnp

    from ds4jax.kvstore.payload import ROW_FIELDS, live_rows
    from ds4jax.model.state import DecodeState, LayerState, init_state

    rng = np.random.default_rng(seed)
    empty = init_state(cfg, max_len)
    layers = []
    for i, layer in enumerate(empty.layers):
        kw = {}
        for name, x in vars(layer).items():
            if x is None:
                continue
            a = np.array(x)
            k = live_rows(cfg, i, name, n, a.shape[0]) if name in ROW_FIELDS else a.shape[0]
            a[:k] = rng.random((k, *a.shape[1:]), dtype=np.float32)
            kw[name] = jnp.asarray(a)
        layers.append(LayerState(**kw))
    logits = jnp.asarray(rng.random(cfg.vocab_size, dtype=np.float32))
    return DecodeState(tuple(layers), jnp.asarray(n, jnp.int32), logits)


def _segments(tokens: Any) -> tuple:
    from ds4jax.chat.segments import Segment

    return (Segment("".join(f"{int(t)} " for t in tokens)),)


def _raw_io(arrays: dict[str, np.ndarray], path: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for k in sorted(arrays):
            arrays[k].tofile(f)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    with open(path, "rb") as f:
        back = [np.fromfile(f, arrays[k].dtype, arrays[k].size) for k in sorted(arrays)]
    t2 = time.perf_counter()
    assert sum(b.nbytes for b in back) == sum(a.nbytes for a in arrays.values())
    path.unlink()
    return t1 - t0, t2 - t1


def throughput(config: str, n: int, reps: int, root: Path, dtype: str = "f32") -> dict[str, Any]:
    import jax

    from ds4jax.config import load_config
    from ds4jax.kvstore import disk
    from ds4jax.kvstore.payload import manifest, pack, payload_bytes

    cfg = load_config(config).replace(state_dtype=dtype)  # rows stored as its records
    max_len = n + 256
    state = random_state(cfg, n, max_len)
    arrays = pack(state, n, cfg)
    nbytes = payload_bytes(arrays)
    tokens = tuple(int(t) for t in np.random.default_rng(1).integers(2, 1000, n))
    directory = root / f"{config}-{dtype}"
    store = disk.DiskStore(directory, "bench", cfg=cfg, max_len=max_len, min_tokens=1,
                           budget_mb=1 << 20)  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in ("save", "load", "orbax_w", "orbax_r")}
    times |= {"raw_w": [], "raw_r": []}
    t0 = time.perf_counter()
    store.save(tokens, _segments((-1, *tokens)), state, "shutdown", None)
    first_save = time.perf_counter() - t0  # compiles the device slices of these row counts
    for r in range(reps):
        segs = _segments((r, *tokens))  # a new text each time: a new checkpoint
        t0 = time.perf_counter()
        store.save(tokens, segs, state, "shutdown", None)
        t1 = time.perf_counter()
        fresh = disk.DiskStore(directory, "bench", cfg=cfg, max_len=max_len, min_tokens=1,
                               budget_mb=1 << 20)  # fmt: skip
        t2 = time.perf_counter()
        loaded = fresh.lookup(segs).load()
        jax.block_until_ready(loaded)
        t3 = time.perf_counter()
        times["save"].append(t1 - t0)
        times["load"].append(t3 - t2)
        orbax_dir = root / f"orbax-{config}-{dtype}-{r}"
        t0 = time.perf_counter()
        disk._write_payload(orbax_dir, arrays)
        t1 = time.perf_counter()
        disk._read_payload(orbax_dir, manifest(arrays))
        t2 = time.perf_counter()
        shutil.rmtree(orbax_dir)
        times["orbax_w"].append(t1 - t0)
        times["orbax_r"].append(t2 - t1)
        w, rd = _raw_io(arrays, root / f"raw-{config}-{dtype}.bin")
        times["raw_w"].append(w)
        times["raw_r"].append(rd)
    shutil.rmtree(directory)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "config": config,
        "state_dtype": dtype,
        "tokens": n,
        "live_bytes": nbytes,
        "bytes_per_token": round(nbytes / n, 1),
        "reps": reps,
        "first_save_s": round(first_save, 3),
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "MB_per_s": {k: round(nbytes / MB / v, 1) for k, v in med.items()},
    }


def restart(ns: tuple[int, ...], root: Path) -> list[dict[str, Any]]:
    import jax

    from ds4jax.config import load_config
    from ds4jax.kvstore.disk import DiskStore
    from ds4jax.model.forward import prefill
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state, span_for, spans

    cfg = load_config("tiny")
    params = init_params(cfg, 0)
    max_len = max(ns) + 2 * SUFFIX
    chunks = (64, 512)
    empty = init_state(cfg, max_len)
    t0 = time.perf_counter()
    # compile (or load from the persistent cache) outside the timings: at the context's
    # capacity (the cold prefill) and at each restored state's span (`model.state.spans`)
    spans_ = spans(cfg, max_len)
    for cap in {max_len, *(span_for(spans_, n + SUFFIX) for n in ns)}:
        for size in chunks:
            jax.block_until_ready(prefill(params, init_state(cfg, cap), [0] * size, cfg,
                                          chunk_sizes=(size,)))  # fmt: skip
    log(f"  tiny: compiled chunks {chunks} at max_len {max_len} in {time.perf_counter() - t0:.1f}s")
    out = []
    for n in ns:
        tokens = [int(t) for t in np.random.default_rng(n).integers(2, 100000, n + SUFFIX)]
        directory = root / f"restart-{n}"
        t0 = time.perf_counter()
        cold, _ = prefill(params, empty, tokens, cfg, chunk_sizes=chunks)
        jax.block_until_ready(cold)
        t_cold = time.perf_counter() - t0
        prefix, _ = prefill(params, empty, tokens[:n], cfg, chunk_sizes=chunks)
        jax.block_until_ready(prefix)  # time the save, not the end of this prefill
        store = DiskStore(directory, "bench", cfg=cfg, max_len=max_len, min_tokens=1)
        t0 = time.perf_counter()
        store.save(tuple(tokens[:n]), _segments(tokens[:n]), prefix, "shutdown", None)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        store = DiskStore(directory, "bench", cfg=cfg, max_len=max_len, min_tokens=1)
        hit = store.lookup(_segments(tokens))
        state = hit.load()
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        state, _ = prefill(params, state, tokens[n:], cfg, chunk_sizes=chunks)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        diff = float(np.abs(np.asarray(state.logits) - np.asarray(cold.logits)).max())
        log(f"  restart at {n} tokens: cold {t_cold:.2f} s, restore {t2 - t0:.3f} s")
        out.append(
            {
                "tokens": n,
                "suffix": SUFFIX,
                "cold_prefill_s": round(t_cold, 3),
                "save_s": round(t_save, 3),
                "open_lookup_load_s": round(t1 - t0, 3),
                "suffix_prefill_s": round(t2 - t1, 3),
                "restore_total_s": round(t2 - t0, 3),
                "speedup": round(t_cold / (t2 - t0), 1),
                "max_logit_diff": diff,
            }
        )
        shutil.rmtree(directory)
    return out


def run(quick: bool) -> dict[str, Any]:
    """Measure everything (see the module docstring); `quick` keeps it under a minute once
    the tiny model's two chunk programs are in the compile cache."""
    use_compile_cache()
    root = Path(tempfile.mkdtemp(prefix="ds4jax-bench-disk-"))
    try:
        configs = [("tiny", "f32"), ("bench-192m", "f32"), ("bench-192m", "fp8")]
        if not quick:
            configs += [("deepseek-v4-flash", "f32"), ("deepseek-v4-flash", "fp8")]
        rep: dict[str, Any] = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "quick": quick,
            "directory_fs": root.as_posix(),
            "throughput": [],
        }
        log(f"disk checkpoints under {root}")
        for name, dtype in configs:
            t = throughput(name, 16384, 2 if quick else 3, root, dtype)
            rep["throughput"].append(t)
            m = t["MB_per_s"]
            log(f"  {name} {dtype}: {t['live_bytes'] / MB:.1f} MB ({t['bytes_per_token']:.0f} "
                f"B a token), save {m['save']:.0f} MB/s, "
                f"load {m['load']:.0f} MB/s (raw {m['raw_w']:.0f} / {m['raw_r']:.0f})")  # fmt: skip
        rep["restart"] = restart((1024, 4096) if quick else (4096, 16384), root)
        rep["loadavg_end"] = list(os.getloadavg())
        return rep
    finally:
        shutil.rmtree(root, ignore_errors=True)


def print_table(rep: dict[str, Any]) -> None:
    log("\n16k-token state, MB/s of live bytes (median), page cache warm for reads")
    log(
        f"{'config':<22} {'MB':>8} {'save':>8} {'load':>8} {'orbax w':>8} {'orbax r':>8} "
        f"{'raw w+fsync':>12} {'raw r':>8}"
    )
    for t in rep["throughput"]:
        m = t["MB_per_s"]
        log(
            f"{t['config'] + ' ' + t.get('state_dtype', 'f32'):<22} {t['live_bytes'] / MB:>8.1f} "
            f"{m['save']:>8.0f} {m['load']:>8.0f} "
            f"{m['orbax_w']:>8.0f} {m['orbax_r']:>8.0f} {m['raw_w']:>12.0f} {m['raw_r']:>8.0f}"
        )
    log(f"\nrestart (tiny model): cold prefill of n + {SUFFIX} vs open + load + suffix prefill")
    log(f"{'tokens':>7} {'cold s':>8} {'restore s':>10} {'(load':>7} {'suffix)':>8} "
        f"{'speedup':>8} {'save s':>7} {'max |dlogit|':>13}")  # fmt: skip
    for r in rep["restart"]:
        log(
            f"{r['tokens']:>7} {r['cold_prefill_s']:>8.2f} {r['restore_total_s']:>10.3f} "
            f"{r['open_lookup_load_s']:>7.3f} {r['suffix_prefill_s']:>8.3f} "
            f"{r['speedup']:>7.1f}x {r['save_s']:>7.3f} {r['max_logit_diff']:>13.2e}"
        )


def main(quick: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    rep = run(quick)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(rep)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = rep["date"][:16].replace("T", "-").replace(":", "")  # 2026-01-31-1405
    path = RESULTS_DIR / f"disk-{stamp}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps(rep, indent=1) + "\n", encoding="utf-8")
    log(f"wrote {path} ({rep['seconds']} s)")
    return rep


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
