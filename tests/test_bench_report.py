"""The bench report (`bench.report`, `bench.summary`, `bench.plots`) on synthetic results in
the shapes the parts return: no model runs, so a broken table, plot or ratio shows up here
rather than at the end of a 20-minute `make bench`."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import report, summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _side(times: list[float], count: int) -> dict[str, Any]:
    if not times:
        return {"times_s": [], "best_s": None, "median_s": None, "tok_s": None}
    return {
        "times_s": times,
        "best_s": min(times),
        "median_s": sorted(times)[len(times) // 2],
        "tok_s": count / min(times),
    }


def _path(source: str, prefilled: int, ttft: float) -> dict[str, Any]:
    return {"source": source, "prefilled": prefilled, "ttft_s": ttft}


CONTINUATION = {
    "rows": [
        {
            "history_tokens": n,
            "live_tool": _path("anthropic-tool-output", 17, live),
            "token_prefix": _path("memory-token", 17, 0.09),
            "text_prefix": _path("memory-text", 17, 0.2),
            "disk": _path("disk-text", 17, disk),
            "cold": _path("none", n, cold),
        }
        for n, live, disk, cold in [(1000, 0.1, 0.2, 2.0), (4000, 0.08, 0.25, 8.0)]
    ]
}

MODEL = {
    "prefill": [
        {
            "tokens": 512,
            "ds4jax_compile_s": 7.0,
            "ds4jax": _side([0.5, 0.6], 512),
            "transformers": _side([1.0, 1.1], 512),
            "skipped": [],
        },
        {
            "tokens": 8192,
            "ds4jax_compile_s": 9.0,
            "ds4jax": _side([16.0], 8192),
            "transformers": _side([], 8192),
            "skipped": ["transformers: predicted 400 s > 60 s left"],
        },
    ],
    "decode": {
        "context": 512,
        "steps": 32,
        "ds4jax": _side([1.0], 32),
        "transformers": _side([4.0], 32),
    },
    "state_bytes": [
        {"config": c, "tokens": n, "state_per_token": s, "dense_per_token": d}
        for c, n, s, d in [
            ("deepseek-v4-flash", 1024, 40000.0, 80000.0),
            ("deepseek-v4-flash", 65536, 10000.0, 80000.0),
            ("bench-192m", 1024, 2000.0, 4000.0),
        ]
    ],
}


def _throughput(config: str, nbytes: int, mb_s: dict[str, float]) -> dict[str, Any]:
    return {
        "config": config,
        "tokens": 16384,
        "live_bytes": nbytes,
        "reps": 3,
        "seconds": {k: nbytes / 1e6 / v for k, v in mb_s.items()},
        "MB_per_s": mb_s,
    }


MBS = {
    "save": 50.0,
    "load": 100.0,
    "orbax_w": 80.0,
    "orbax_r": 200.0,
    "raw_w": 500.0,
    "raw_r": 2000.0,
}
DISK = {
    "throughput": [
        _throughput("tiny", 4_000_000, {k: v / 2 for k, v in MBS.items()}),
        _throughput("deepseek-v4-flash", 250_000_000, MBS),
    ],
    "restart": [
        {
            "tokens": 4096,
            "suffix": 128,
            "cold_prefill_s": 10.0,
            "save_s": 1.0,
            "open_lookup_load_s": 0.1,
            "suffix_prefill_s": 0.9,
            "restore_total_s": 1.0,
            "speedup": 10.0,
            "max_logit_diff": 0.0,
        },
    ],
}

KERNELS = {
    "backend": "cpu",
    "interpreted": True,
    "rows": [
        {
            "op": "sink_attention",
            "T": 1,
            "H": 8,
            "D": 128,
            "K": 512,
            "kernel_ms": 4.0,
            "twin_ms": 2.0,
            "kernel_GBps": 0.5,
        },
        {
            "op": "indexer_scores",
            "T": 64,
            "IH": 16,
            "d": 64,
            "C": 1024,
            "kernel_ms": 3.0,
            "twin_ms": 6.0,
        },
    ],
}

PROMPT = {
    "json_bytes": 100000,
    "prompt_chars": 60000,
    "tokens": 15000,
    "parse_render_s": 0.01,
    "tokenize_segments_s": 0.02,
    "tokenize_official_s": 0.03,
}

LAYERS = {
    "cases": [
        {
            "T": 512,
            "start": 0,
            "max_len": 576,
            "forward_chunk_ms": 600.0,
            "parts": [{"part": "moe hash", "count": 3, "best_ms": 40.0, "median_ms": 42.0}],
        },
        {"T": 1, "start": 8192, "max_len": 8256, "skipped": "time budget"},
    ]
}

SESSIONS = {
    "live_rate": [
        {"sessions": 1, "agents": 6, "loops_per_agent": 4, "tool_turns": 24, "live_turns": 0,
         "live_share": 0.0, "seconds": 9.0},
        {"sessions": 6, "agents": 6, "loops_per_agent": 4, "tool_turns": 24, "live_turns": 24,
         "live_share": 1.0, "seconds": 3.0},
    ],
    "retry": {"prompt_tokens": 16000, "cold_ttft_s": 8.0, "retry_ttft_s": 0.02,
              "retry_source": "fork-point", "retry_cached": 16000, "retry_prefilled": 0},
    "subagent": [
        {"sessions": 1, "alone_ttft_s": 0.05, "alone_source": "anthropic-tool-output",
         "alone_prefilled": 20, "with_subagent_ttft_s": 2.0, "with_subagent_source": "none",
         "with_subagent_prefilled": 4100, "history_tokens": 4120},
    ],
    "memory": [{"config": "deepseek-v4-flash", "context": 8192, "bytes_per_session": 10,
                "bytes_per_fork_point": 10, "live_bytes_when_full": 9}],
}  # fmt: skip

BATCHING = {
    "rows": [
        {"model": "tiny", "batch": b, "context": 512, "steps": 32, "seconds": 1.0,
         "tokens_per_s": 100.0 * b ** 0.5, "per_token_ms": 10.0,
         "solo_decode_step_tokens_per_s": 80.0, "recompiles_after_warmup": 0}
        for b in (1, 2, 4, 8)
    ],
    "recompiles_after_warmup": 0,
    "ttft": [{"max_batch": 1, "long_generation_tokens": 256, "idle_ttft_s": 0.05,
              "under_load_ttft_s": 2.5},
             {"max_batch": 8, "long_generation_tokens": 256, "idle_ttft_s": 0.05,
              "under_load_ttft_s": 0.1}],
    "latency": [{"streams": 1, "steps": 60, "p50_ms": 5.0, "p99_ms": 6.0},
                {"streams": 8, "steps": 60, "p50_ms": 12.0, "p99_ms": 15.0}],
}  # fmt: skip

RESPONSES = {
    "rows": [
        {
            "history_tokens": 20400,
            "live_call_id": _path("responses-tool-output", 18, 0.05),
            "visible_prefix": _path("responses-visible", 18, 0.04),
            "cold": _path("none", 20400, 8.0),
        }
    ]
}

LLAMACPP = {
    "ds4jax_tok_s": {"pp512": 2000.0, "tg32": 90.0, "tg32@d512": 80.0},
    "ds4jax_fp4_experts_tok_s": {"pp512": 1800.0, "tg32": 60.0, "tg32@d512": 70.0},
    "llama_cpp_tok_s": {"as_converted": {"pp512": 1600.0, "tg32": 150.0, "tg32@d512": 140.0},
                        "all_f32": {"pp512": 1000.0, "tg32": 60.0, "tg32@d512": 64.0}},
}  # fmt: skip


def test_llamacpp_ratios_pair_decode_at_the_same_depth() -> None:
    """Decode from an empty cache beside llama-bench's `tg32`, decode after the largest
    prefill beside its `tg32` at that depth (`-d`): never one against the other."""
    from bench import summary

    rows = {(r["ratio"], r["at"]): r for r in summary.llamacpp(LLAMACPP)}
    f32 = "ds4jax / llama.cpp (all_f32) tok/s"
    assert rows[f32, "decode 32 tokens"]["value"] == pytest.approx(1.5)
    assert rows[f32, "decode 32 tokens after 512"]["value"] == pytest.approx(1.25)
    assert rows[f32, "prefill 512 tokens"]["value"] == pytest.approx(2.0)


def test_llamacpp_decode_pairs_alternate_and_report_the_median_ratio() -> None:
    """Decode in pairs: the engines seconds apart, which goes first alternating; the figure
    is the median of the pairs' ratios (not the ratio of medians), in the summary beside
    the rounds' rows."""
    from bench import summary
    from bench.llamacpp import decode_pairs

    calls: list[str] = []
    ours, theirs = iter([100.0, 90.0, 120.0, 80.0]), iter([100.0, 100.0, 60.0, 100.0])

    def timed(who: str, it: Any) -> Any:
        return lambda: calls.append(who) or next(it)

    got = decode_pairs(timed("ours", ours), timed("theirs", theirs), 4)
    assert calls == ["theirs", "ours", "ours", "theirs", "theirs", "ours", "ours", "theirs"]
    assert got["pairs"] == [(100.0, 100.0), (90.0, 100.0), (120.0, 60.0), (80.0, 100.0)]
    assert got["ratio"] == pytest.approx(0.95)  # ratios 1.0, 0.9, 2.0, 0.8
    rep = {**LLAMACPP, "decode_pairs": {"all_f32": got}}
    rows = [r for r in summary.llamacpp(rep) if "pairs" in r["at"]]
    assert [(r["at"], r["value"]) for r in rows] == [
        ("decode 32 tokens, 4 pairs seconds apart (median ratio)", 0.95)
    ]
    assert (rows[0]["numerator"], rows[0]["denominator"]) == (95.0, 100.0)


def test_llamacpp_rounds_report_each_figures_median() -> None:
    """The comparison's rounds: each figure the median of the rounds that measured it, the
    ratios of those medians like for like."""
    from bench.llamacpp import medians, ratios

    runs = [{"tg32": 90.0, "pp512": 10.0}, {"tg32": 120.0}, {"tg32": 100.0, "pp512": 30.0}]
    assert medians(runs) == {"tg32": 100.0, "pp512": 20.0}
    theirs = {"all_f32": {"tg32": 80.0, "pp512": float("nan"), "tg32@d512": 10.0}}
    assert ratios({"all_f32": medians(runs)}, theirs) == {"all_f32": {"tg32": 1.25}}


def test_streams_ratios_are_each_client_count_against_one() -> None:
    from bench import summary

    rep = {"model": "bench-192m", "tokens": 256,
           "rows": [{"clients": 1, "aggregate_tok_s": 80.0},
                    {"clients": 4, "aggregate_tok_s": 240.0},
                    {"clients": 8, "aggregate_tok_s": 400.0}]}  # fmt: skip
    rows = summary.streams(rep)
    assert [r["ratio"] for r in rows] == [
        "decode tok/s in all over HTTP, 4 SDK clients / 1",
        "decode tok/s in all over HTTP, 8 SDK clients / 1",
    ]
    assert [r["value"] for r in rows] == [3.0, 5.0]


METRICS = {
    "decode": {"streams": 8, "tokens_each": 128, "rounds": 2, "token_us": 2.0,
               "request_us": 12.0, "observer_share_of_token": 0.0002,
               "metrics_on_tok_s": [99.0, 101.0], "metrics_off_tok_s": [100.0, 100.0],
               "on_median_tok_s": 99.0, "off_median_tok_s": 100.0, "on_over_off": 0.99},
    "scrape": {"sessions_resident": 8, "fork_points": 8, "scrapes": 200, "median_ms": 1.2,
               "max_ms": 3.0, "bytes": 21000},
}  # fmt: skip

PAGED = {
    "rows": [{"context": 4096, "paged": False, "state_bytes": 40, "prompt_tokens": 900,
              "frontiers": 24},
             {"context": 4096, "paged": True, "state_bytes": 10, "prompt_tokens": 900,
              "frontiers": 24, "pages_used": 30, "page_bytes": 1}],
    "same_replies": True,
}  # fmt: skip


def _stall_run(bound: float | None, p99: float, rate: float) -> dict[str, Any]:
    return {"stall_bound": bound, "prompt_tokens": 16000,
            "alone": {"gaps": 120, "p50_ms": 40.0, "p99_ms": 50.0, "max_ms": 55.0},
            "during_prefill": {"gaps": 80, "p50_ms": 60.0, "p99_ms": p99, "max_ms": p99,
                               "p99_vs_alone_p50": p99 / 40},
            "prefill_tok_s": rate, "prefill_seconds_all": 16000 / rate}  # fmt: skip


STALL = {"model": "bench-192m", "streams": 4,
         "runs": [_stall_run(None, 4000.0, 500.0), _stall_run(2.0, 70.0, 100.0)]}  # fmt: skip

RESULTS = {
    "prompt": PROMPT,
    "model": MODEL,
    "continuation": CONTINUATION,
    "disk": DISK,
    "kernels": KERNELS,
    "sessions": SESSIONS,
    "batching": BATCHING,
    "responses": RESPONSES,
    "llamacpp": LLAMACPP,
    "metrics": METRICS,
    "paged": PAGED,
    "stall": STALL,
}


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, list[Path]]:
    out = tmp_path_factory.mktemp("results")
    parts = RESULTS | {"layers": LAYERS}
    return {part: report.write_part(part, rep, "STAMP", out) for part, rep in parts.items()}


def test_every_part_writes_stamped_csvs_and_its_plots(written) -> None:
    names = {part: sorted(p.name for p in paths) for part, paths in written.items()}
    assert names["continuation"] == ["continuation-STAMP-ttft.csv", "continuation-STAMP.png"]
    assert names["model"] == [
        "model-STAMP-decode.csv",
        "model-STAMP-prefill.csv",
        "model-STAMP-state-bytes.csv",
        "model-STAMP-state-bytes.png",
        "model-STAMP.png",
    ]
    assert names["disk"] == [
        "disk-STAMP-restart.csv",
        "disk-STAMP-throughput.csv",
        "disk-STAMP.png",
    ]
    assert names["kernels"] == ["kernels-STAMP-kernels.csv"]
    assert names["batching"] == [
        "batching-STAMP-latency.csv",
        "batching-STAMP-throughput.csv",
        "batching-STAMP-ttft.csv",
    ]
    assert names["sessions"] == [
        "sessions-STAMP-live-rate.csv",
        "sessions-STAMP-memory.csv",
        "sessions-STAMP-retry.csv",
        "sessions-STAMP-subagent.csv",
    ]
    assert names["responses"] == ["responses-STAMP-ttft.csv"]
    assert names["llamacpp"] == ["llamacpp-STAMP-speed.csv"]
    assert names["metrics"] == ["metrics-STAMP-decode.csv", "metrics-STAMP-scrape.csv"]
    assert names["paged"] == ["paged-STAMP-bytes.csv"]
    for path in (p for paths in written.values() for p in paths if p.suffix == ".png"):
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path


def test_csvs_have_one_row_per_measurement_with_units(written) -> None:
    csvs = {p.name: p for paths in written.values() for p in paths if p.suffix == ".csv"}
    cols, rows = _read(csvs["continuation-STAMP-ttft.csv"])
    assert cols == ["history_tokens", "path", "source", "prefilled_tokens", "ttft_s"]
    assert len(rows) == 2 * 5
    disk_row = next(r for r in rows if r["history_tokens"] == "4000" and r["path"] == "disk")
    assert float(disk_row["ttft_s"]) == 0.25 and disk_row["source"] == "disk-text"

    cols, rows = _read(csvs["model-STAMP-prefill.csv"])
    assert cols[:6] == ["tokens", "engine", "repeats", "best_s", "median_s", "tok_per_s"]
    assert [(r["tokens"], r["engine"]) for r in rows] == [
        ("512", "ds4jax"),
        ("512", "transformers"),
        ("8192", "ds4jax"),
        ("8192", "transformers"),
    ]
    assert float(rows[1]["tok_per_s"]) == pytest.approx(512.0)
    assert rows[3]["tok_per_s"] == "" and "predicted" in rows[3]["skipped"]

    cols, rows = _read(csvs["model-STAMP-state-bytes.csv"])
    assert "state_bytes_per_token" in cols and "dense_bytes_per_token" in cols
    assert [float(r["dense_over_state"]) for r in rows] == [2.0, 8.0, 2.0]

    cols, rows = _read(csvs["disk-STAMP-throughput.csv"])
    assert cols == ["config", "tokens", "live_MB", "operation", "median_s", "MB_per_s"]
    assert len(rows) == 2 * 6
    assert {r["operation"] for r in rows} == set(report.DISK_OPS.values())

    _, rows = _read(csvs["kernels-STAMP-kernels.csv"])
    assert rows[0]["shape"] == "T=1 H=8 D=128 K=512" and rows[1]["kernel_GB_per_s"] == ""
    _, rows = _read(csvs["layers-STAMP-layers.csv"])
    assert len(rows) == 1 and float(rows[0]["total_ms"]) == 120.0  # the skipped case: no row


def _value(rows: list[dict[str, Any]], name: str, at: str) -> float | None:
    (row,) = [r for r in rows if r["ratio"] == name and r["at"].startswith(at)]
    return row["value"]


def test_summary_ratios_are_this_runs_measurements() -> None:
    rows = summary.summary_rows(RESULTS)
    assert _value(rows, "cold / live_call_id TTFT", "20400 ") == 160.0
    assert _value(rows, "metrics on / off decode tok/s", "8 streams") == 0.99
    assert _value(rows, "dense / paged retained-state bytes", "ctx 4096") == 4.0
    # 10 ms a token (100 tok/s), 2 us of it the observer's
    assert _value(rows, "token time / metrics observer's time per token", "8 streams") == 5000
    # like for like: the as-converted GGUF (MXFP4 experts) beside ds4jax's fp4-experts run
    assert _value(rows, "ds4jax / llama.cpp (as_converted) tok/s", "decode 32 tokens after") == 0.5
    assert _value(rows, "ds4jax / llama.cpp (all_f32) tok/s", "prefill 512") == 2.0
    assert _value(rows, "cold / visible_prefix TTFT", "20400 ") == 200.0
    assert _value(rows, "cold / live_tool TTFT", "1000 ") == 20.0
    assert _value(rows, "cold / live_tool TTFT", "4000 ") == 100.0
    assert _value(rows, "cold / disk TTFT", "4000 ") == 32.0
    assert _value(rows, "live_tool TTFT max / min", "1000..4000") == 1.25
    assert _value(rows, "ds4jax / transformers prefill tok/s", "512 ") == 2.0
    assert _value(rows, "ds4jax / transformers prefill tok/s", "8192 ") is None  # skipped
    assert _value(rows, "ds4jax / transformers decode tok/s", "32 steps") == 4.0
    state = [r for r in rows if r["ratio"].startswith("dense / ds4jax state bytes")]
    assert [(r["at"], r["value"]) for r in state] == [
        ("1024 context tokens", 2.0),
        ("65536 context tokens", 8.0),
    ]
    # the disk ratios are the largest state's
    assert _value(rows, "raw write+fsync / DiskStore save MB/s", "deepseek") == 10.0
    assert _value(rows, "raw read / DiskStore load MB/s", "deepseek") == 20.0
    assert _value(rows, "cold prefill / (load + suffix prefill)", "4096 ") == 10.0
    assert _value(rows, "jnp twin / Pallas indexer_scores time", "T=64") == 2.0
    assert _value(rows, "official encode / segment tokenize time", "15000 ") == 1.5
    assert _value(rows, "live tool turns, 1 sessions", "6 agents") == 0.0
    assert _value(rows, "live tool turns, 6 sessions", "6 agents") == 1.0
    assert _value(rows, "cold / retry TTFT", "16000 ") == 400.0
    assert _value(rows, "B=4 / B=1 decode tok/s", "tiny") == 2.0
    assert _value(rows, "batched B=1 / solo decode_step tok/s", "tiny") == 1.25
    assert _value(rows, "short-request TTFT under load / idle, max_batch 1", "256") == 50.0
    assert _value(rows, "short-request TTFT under load / idle, max_batch 8", "256") == 2.0
    assert _value(rows, "per-token p99, 8 streams / 1", "tiny") == 2.5
    assert _value(rows, "main TTFT after a sub-agent / alone, 1 sessions", "4120 ") == 40.0
    gap = "stream p99 gap during a prefill / p50 alone, stall bound"
    assert _value(rows, f"{gap} None", "bench-192m, 4 streams, a 16000-token") == 100
    assert _value(rows, f"{gap} 2.0", "bench-192m") == 1.75
    assert _value(rows, "prompt prefill tok/s bounded / whole chunks", "bench-192m") == 0.2


def test_summary_table_and_files(tmp_path) -> None:
    rows = summary.summary_rows({"continuation": CONTINUATION})
    text = summary.format_table(rows)
    assert "cold / live_tool TTFT" in text and "100x" in text and "8 s / 0.08 s" in text
    paths = summary.write(rows, "STAMP", ["a note"], tmp_path)
    assert [p.name for p in paths] == ["summary-STAMP.csv", "summary-STAMP.md"]
    cols, back = _read(paths[0])
    assert cols == ["part", "ratio", "at", "value", "numerator", "denominator", "unit"]
    assert len(back) == len(rows)
    md = paths[1].read_text()
    assert "- a note" in md and md.count("| continuation |") == len(rows)


def test_run_stamps_differ_by_the_second_and_mark_quick() -> None:
    from datetime import datetime

    a = report.run_stamp(False, datetime(2026, 1, 31, 14, 5, 1))
    b = report.run_stamp(True, datetime(2026, 1, 31, 14, 5, 2))
    assert (a, b) == ("2026-01-31-140501", "2026-01-31-140502-quick")


def test_llama_bench_json_and_logit_cosine() -> None:
    from bench.llamacpp import min_cosine, parse_llama_bench

    text = (
        '[{"n_prompt": 512, "n_gen": 0, "avg_ts": 1578.5, "stddev_ts": 3.1},'
        ' {"n_prompt": 0, "n_gen": 32, "avg_ts": 131.25, "stddev_ts": 0.5, "n_depth": 0},'
        ' {"n_prompt": 0, "n_gen": 32, "avg_ts": 101.5, "stddev_ts": 0.5, "n_depth": 8192}]'
    )
    assert parse_llama_bench(text) == {"pp512": 1578.5, "tg32": 131.25, "tg32@d8192": 101.5}
    a = np.array([[1.0, 2.0, 3.0], [1.0, 0.0, 0.0]], np.float32)
    assert min_cosine(a, a * 2) == pytest.approx(1.0)
    assert min_cosine(a, np.array([[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]], np.float32)) == 0.0
