"""CSV tables and PNG plots of one bench run, from the result dicts the parts return.

The JSON each part writes keeps everything (every repeat, load averages, setup); the CSVs
are the flat view a spreadsheet or a plot needs: one row per measurement, units in the
column names. Every file of a run carries the run's stamp (`<part>-<stamp>-<table>.csv`),
so a later run never overwrites an earlier one.

The table builders are pure (dict in, rows out) so the test can feed them synthetic
results; `write_part` is the only function that touches the disk.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import plots

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Row = dict[str, Any]

#: disk.py's operation keys → what the CSV and the plot call them
DISK_OPS = {
    "save": "DiskStore save",
    "load": "DiskStore load",
    "orbax_w": "Orbax write",
    "orbax_r": "Orbax read",
    "raw_w": "raw write+fsync",
    "raw_r": "raw read",
}

#: the shape fields of kernels.py's rows (sink_attention: T H D K; indexer_scores: T IH d C)
KERNEL_SHAPE_KEYS = ("T", "H", "IH", "D", "d", "K", "C")


def run_stamp(quick: bool, now: datetime | None = None) -> str:
    """Seconds in the stamp: two runs in one minute (a quick run, then a part alone) must
    not share files."""
    return f"{(now or datetime.now()):%Y-%m-%d-%H%M%S}{'-quick' if quick else ''}"


def write_json(part: str, rep: Row, quick: bool, out_dir: Path = RESULTS_DIR) -> Path:
    """A part's whole result as `<part>-<date>-<HHMM>[-quick].json`; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{part}-{datetime.now():%Y-%m-%d-%H%M}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps(rep, indent=1))
    print(f"wrote {path}", flush=True)
    return path


def write_csv(path: Path, rows: list[Row]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for row in rows for k in row))  # first-seen order
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


# ---------------------------------------------------------------- table builders


def continuation_rows(rep: Row) -> list[Row]:
    """One row per (history length, path)."""
    out = []
    for row in rep["rows"]:
        for path, m in row.items():
            if path == "history_tokens":
                continue
            out.append(
                {
                    "history_tokens": row["history_tokens"],
                    "path": path,
                    "source": m["source"],
                    "prefilled_tokens": m["prefilled"],
                    "ttft_s": m["ttft_s"],
                }
            )
    return out


def _engine_row(keys: Row, engine: str, side: Row) -> Row:
    return keys | {
        "engine": engine,
        "repeats": len(side["times_s"]),
        "best_s": side["best_s"],
        "median_s": side["median_s"],
        "tok_per_s": side["tok_s"],  # from the best time
    }


def prefill_rows(rep: Row) -> list[Row]:
    """One row per (prompt length, engine); a skipped measurement keeps its row, empty."""
    out = []
    for row in rep["prefill"]:
        keys = {"tokens": row["tokens"]}
        for engine in ("ds4jax", "transformers"):
            r = _engine_row(keys, engine, row[engine])
            r["compile_s"] = row.get("ds4jax_compile_s") if engine == "ds4jax" else None
            r["skipped"] = "; ".join(row.get("skipped", []))
            out.append(r)
    return out


def decode_rows(rep: Row) -> list[Row]:
    d = rep["decode"]
    keys = {"context_tokens": d["context"], "steps": d["steps"]}
    return [_engine_row(keys, e, d[e]) for e in ("ds4jax", "transformers")]


def state_rows(rep: Row) -> list[Row]:
    return [
        {
            "config": r["config"],
            "context_tokens": r["tokens"],
            "state_bytes_per_token": round(r["state_per_token"], 1),
            "dense_bytes_per_token": round(r["dense_per_token"], 1),
            "dense_over_state": round(r["dense_per_token"] / r["state_per_token"], 3),
        }
        for r in rep["state_bytes"]
    ]


def disk_throughput_rows(rep: Row) -> list[Row]:
    """One row per (config, operation): medians over the repeats, MB/s of live state bytes."""
    return [
        {
            "config": t["config"],
            "tokens": t["tokens"],
            "live_MB": round(t["live_bytes"] / 1e6, 2),
            "operation": DISK_OPS[op],
            "median_s": t["seconds"][op],
            "MB_per_s": t["MB_per_s"][op],
        }
        for t in rep["throughput"]
        for op in DISK_OPS
    ]


def disk_restart_rows(rep: Row) -> list[Row]:
    return [
        {
            "tokens": r["tokens"],
            "suffix_tokens": r["suffix"],
            "cold_prefill_s": r["cold_prefill_s"],
            "save_s": r["save_s"],
            "open_lookup_load_s": r["open_lookup_load_s"],
            "suffix_prefill_s": r["suffix_prefill_s"],
            "restore_total_s": r["restore_total_s"],
            "cold_over_restore": r["speedup"],
            "max_logit_diff": r["max_logit_diff"],
        }
        for r in rep["restart"]
    ]


def kernel_rows(rep: Row) -> list[Row]:
    out = []
    for r in rep["rows"]:
        shape = " ".join(f"{k}={r[k]}" for k in KERNEL_SHAPE_KEYS if k in r)
        out.append(
            {
                "op": r["op"],
                "shape": shape,
                "backend": rep["backend"],
                "interpreted": rep["interpreted"],
                "kernel_ms": round(r["kernel_ms"], 3),
                "twin_ms": round(r["twin_ms"], 3),
                "kernel_GB_per_s": round(r["kernel_GBps"], 3) if "kernel_GBps" in r else None,
            }
        )
    return out


def prompt_rows(rep: Row) -> list[Row]:
    return [
        {
            "json_bytes": rep["json_bytes"],
            "prompt_chars": rep["prompt_chars"],
            "tokens": rep["tokens"],
            "parse_render_ms": round(rep["parse_render_s"] * 1e3, 3),
            "tokenize_segments_ms": round(rep["tokenize_segments_s"] * 1e3, 3),
            "tokenize_official_ms": round(rep["tokenize_official_s"] * 1e3, 3),
        }
    ]


def layer_rows(rep: Row) -> list[Row]:
    """One row per (chunk case, part); skipped cases are left out."""
    return [
        {
            "chunk_tokens": c["T"],
            "start": c["start"],
            "max_len": c["max_len"],
            "part": p["part"],
            "count": p["count"],
            "best_ms": p["best_ms"],
            "median_ms": p["median_ms"],
            "total_ms": round(p["count"] * p["best_ms"], 3),
            "forward_chunk_ms": c["forward_chunk_ms"],
        }
        for c in rep["cases"]
        if "parts" in c
        for p in c["parts"]
    ]


# ---------------------------------------------------------------- per part


#: part → [(table name, builder)]
def sessions_live_rows(rep: Row) -> list[Row]:
    return list(rep["live_rate"])


def sessions_retry_rows(rep: Row) -> list[Row]:
    return [dict(rep["retry"])]


def sessions_subagent_rows(rep: Row) -> list[Row]:
    return list(rep["subagent"])


def sessions_memory_rows(rep: Row) -> list[Row]:
    return list(rep["memory"])


def batching_throughput_rows(rep: Row) -> list[Row]:
    return list(rep["rows"])


def batching_ttft_rows(rep: Row) -> list[Row]:
    return list(rep.get("ttft", []))


def batching_latency_rows(rep: Row) -> list[Row]:
    return list(rep.get("latency", []))


def llamacpp_rows(rep: Row) -> list[Row]:
    """One row per (engine, test): tokens/s, and the ratio to ds4jax's (like for like:
    `bench.llamacpp.OURS`)."""
    from bench.llamacpp import ours_for

    rows = [{"engine": engine, "test": k, "tok_per_s": v, "ds4jax_over_this": 1.0}
            for engine, key in (("ds4jax", "ds4jax_tok_s"),
                                ("ds4jax fp4-experts", "ds4jax_fp4_experts_tok_s"))
            for k, v in rep.get(key, {}).items()]  # fmt: skip
    for variant, theirs in rep.get("llama_cpp_tok_s", {}).items():
        ours = ours_for(rep, variant)
        for k, v in theirs.items():
            ratio = ours[k] / v if k in ours and v else None
            rows.append({"engine": f"llama.cpp {variant}", "test": k, "tok_per_s": v,
                         "ds4jax_over_this": ratio})  # fmt: skip
    return rows


def metrics_decode_rows(rep: Row) -> list[Row]:
    d = rep["decode"]
    return [{"metrics": "on", "tok_per_s": t} for t in d["metrics_on_tok_s"]] + [
        {"metrics": "off", "tok_per_s": t} for t in d["metrics_off_tok_s"]
    ]


def stall_row(run: Row) -> Row:
    """One run of `bench.stall`: the streams' gaps alone and during the prompt's prefill."""
    out = {"stall_bound": run["stall_bound"], "prompt_tokens": run["prompt_tokens"]}
    for side in ("alone", "during_prefill"):
        out |= {f"{side}_{k}": v for k, v in run[side].items() if k != "all_ms"}
    return out | {k: run[k] for k in ("prefill_tok_s", "prefill_seconds_all")}


def metrics_scrape_rows(rep: Row) -> list[Row]:
    return [dict(rep["scrape"])]


TABLES: dict[str, list[tuple[str, Callable[[Row], list[Row]]]]] = {
    "prompt": [("tokenize", prompt_rows)],
    "model": [("prefill", prefill_rows), ("decode", decode_rows), ("state-bytes", state_rows)],
    "continuation": [("ttft", continuation_rows)],
    "disk": [("throughput", disk_throughput_rows), ("restart", disk_restart_rows)],
    "kernels": [("kernels", kernel_rows)],
    "layers": [("layers", layer_rows)],
    "sessions": [("live-rate", sessions_live_rows), ("retry", sessions_retry_rows),
                 ("subagent", sessions_subagent_rows), ("memory", sessions_memory_rows)],
    "batching": [("throughput", batching_throughput_rows), ("ttft", batching_ttft_rows),
                 ("latency", batching_latency_rows)],
    "responses": [("ttft", continuation_rows)],
    "llamacpp": [("speed", llamacpp_rows)],
    "metrics": [("decode", metrics_decode_rows), ("scrape", metrics_scrape_rows)],
    "paged": [("bytes", lambda rep: list(rep["rows"]))],
    "context": [("speed", lambda rep: list(rep["rows"]))],
    "memory": [("agents", lambda rep: [{k: v for k, v in rep["agents"].items()
                                        if k != "prompt_tokens"}]),
               ("retries", lambda rep: [{k: v for k, v in rep["retries"].items()
                                         if k != "sources"}])],
    "ops": [("steps", lambda rep: [{k: v for k, v in r.items()
                                    if k not in ("by_kind", "step_ms_all", "twin_step_ms_all")}
                                   for r in rep["rows"]])],
    "stall": [("gaps", lambda rep: [stall_row(r) for r in rep["runs"]])],
    "speculative": [("decode", lambda rep: rep["rows"])],
    "streams": [("clients", lambda rep: rep["rows"])],
}  # fmt: skip


def write_part(part: str, rep: Row, stamp: str, out_dir: Path = RESULTS_DIR) -> list[Path]:
    """Write `part`'s CSVs and plots; returns the paths written."""
    tables = {name: build(rep) for name, build in TABLES[part]}
    paths = [
        write_csv(out_dir / f"{part}-{stamp}-{name}.csv", rows) for name, rows in tables.items()
    ]
    png = out_dir / f"{part}-{stamp}.png"
    if part == "continuation":
        paths.append(plots.ttft(tables["ttft"], png))
    elif part == "model":
        paths.append(plots.model_speed(tables["prefill"], tables["decode"], png))
        state_png = out_dir / f"{part}-{stamp}-state-bytes.png"
        paths.append(plots.state_bytes(tables["state-bytes"], state_png))
    elif part == "disk":
        paths.append(plots.disk(tables["throughput"], tables["restart"], png))
    return paths
