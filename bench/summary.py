"""The one table `python -m bench` ends with: ratios of figures measured side by side in
this run, never against numbers from another run or machine.

Each ratio is oriented so its name reads as a sentence ("cold / live_tool TTFT" = how many
times slower a cold prefill is than the live path) and keeps its numerator and denominator,
so a surprising ratio can be traced to the two measurements behind it. The full figures
are in the parts' CSVs and JSONs; this table picks the comparisons the issue asks for.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.report import RESULTS_DIR, write_csv

Row = dict[str, Any]

#: the state-bytes rows summarised: the real model's (the bench config only scales it down)
STATE_CONFIG = "deepseek-v4-flash"


def ratio(part: str, name: str, at: str, num: float | None, den: float | None, unit: str) -> Row:
    """A ratio row; a missing side (a skipped measurement) leaves the value empty."""
    value = round(num / den, 3) if num is not None and den else None
    return {
        "part": part,
        "ratio": name,
        "at": at,
        "value": value,
        "numerator": num,
        "denominator": den,
        "unit": unit,
    }


def continuation(rep: Row) -> list[Row]:
    rows = rep["rows"]
    out = []
    for r in rows:
        at = f"{r['history_tokens']} history tokens"
        for path in ("live_tool", "disk"):
            if path in r:
                out.append(
                    ratio(
                        "continuation",
                        f"cold / {path} TTFT",
                        at,
                        r["cold"]["ttft_s"],
                        r[path]["ttft_s"],
                        "s",
                    )
                )
    last = rows[-1]
    for path in ("token_prefix", "text_prefix"):
        if path in last:
            at = f"{last['history_tokens']} history tokens"
            out.append(
                ratio(
                    "continuation",
                    f"cold / {path} TTFT",
                    at,
                    last["cold"]["ttft_s"],
                    last[path]["ttft_s"],
                    "s",
                )
            )
    live = [r["live_tool"]["ttft_s"] for r in rows]
    span = f"{rows[0]['history_tokens']}..{last['history_tokens']} tokens"
    out.append(ratio("continuation", "live_tool TTFT max / min", span, max(live), min(live), "s"))
    return out


def model(rep: Row) -> list[Row]:
    out = []
    for r in rep["prefill"]:
        out.append(
            ratio(
                "model",
                "ds4jax / transformers prefill tok/s",
                f"{r['tokens']} tokens",
                r["ds4jax"]["tok_s"],
                r["transformers"]["tok_s"],
                "tok/s",
            )
        )
    d = rep["decode"]
    out.append(
        ratio(
            "model",
            "ds4jax / transformers decode tok/s",
            f"{d['steps']} steps after {d['context']}",
            d["ds4jax"]["tok_s"],
            d["transformers"]["tok_s"],
            "tok/s",
        )
    )
    for r in rep["state_bytes"]:
        if r["config"] == STATE_CONFIG:
            out.append(
                ratio(
                    "model",
                    f"dense / ds4jax state bytes per token ({STATE_CONFIG})",
                    f"{r['tokens']} context tokens",
                    r["dense_per_token"],
                    r["state_per_token"],
                    "B/token",
                )
            )
    return out


def disk(rep: Row) -> list[Row]:
    """Save and load of the largest state against raw I/O of the same bytes, and the restart
    (load + suffix prefill) against a cold prefill."""
    t = max(rep["throughput"], key=lambda t: t["live_bytes"])
    at = (f"{t['config']} {t.get('state_dtype', 'f32')}, {t['tokens']} tokens "
          f"({t['live_bytes'] / 1e6:.0f} MB)")  # fmt: skip
    m = t["MB_per_s"]
    out = [
        ratio("disk", "raw write+fsync / DiskStore save MB/s", at, m["raw_w"], m["save"], "MB/s"),
        ratio("disk", "raw read / DiskStore load MB/s", at, m["raw_r"], m["load"], "MB/s"),
        ratio("disk", "Orbax write / DiskStore save MB/s", at, m["orbax_w"], m["save"], "MB/s"),
        ratio("disk", "Orbax read / DiskStore load MB/s", at, m["orbax_r"], m["load"], "MB/s"),
    ]
    for r in rep["restart"]:
        out.append(
            ratio(
                "disk",
                "cold prefill / (load + suffix prefill)",
                f"{r['tokens']} + {r['suffix']} tokens, tiny",
                r["cold_prefill_s"],
                r["restore_total_s"],
                "s",
            )
        )
    return out


def kernels(rep: Row) -> list[Row]:
    mode = ", interpreted" if rep["interpreted"] else ""
    return [
        ratio(
            "kernels",
            f"jnp twin / Pallas {r['op']} time",
            f"T={r['T']} ({rep['backend']}{mode})",
            r["twin_ms"],
            r["kernel_ms"],
            "ms",
        )
        for r in rep["rows"]
    ]


def prompt(rep: Row) -> list[Row]:
    return [
        ratio(
            "prompt",
            "official encode / segment tokenize time",
            f"{rep['tokens']} tokens",
            rep["tokenize_official_s"],
            rep["tokenize_segments_s"],
            "s",
        )
    ]


def sessions(rep: Row) -> list[Row]:
    rates = {r["sessions"]: r for r in rep["live_rate"]}
    out = []
    for n, r in rates.items():
        out.append(ratio("sessions", f"live tool turns, {n} sessions", f"{r['agents']} agents",
                         r["live_turns"], r["tool_turns"], "turns"))  # fmt: skip
    rt = rep["retry"]
    out.append(ratio("sessions", "cold / retry TTFT", f"{rt['prompt_tokens']} tokens",
                     rt["cold_ttft_s"], rt["retry_ttft_s"], "s"))  # fmt: skip
    for r in rep["subagent"]:
        pool = f"{r['sessions']} sessions" + ("" if r.get("fork_points", True) else ", no forks")
        out.append(ratio("sessions", f"main TTFT after a sub-agent / alone, {pool}",
                         f"{r['history_tokens']} history tokens",
                         r["with_subagent_ttft_s"], r["alone_ttft_s"], "s"))  # fmt: skip
    return out


def batching(rep: Row) -> list[Row]:
    out = []
    by = {(r["model"], r["batch"]): r for r in rep["rows"]}
    for model in dict.fromkeys(r["model"] for r in rep["rows"]):
        one = by.get((model, 1))
        if one is None:
            continue
        for b in (4, 8):
            if (model, b) in by:
                many = by[(model, b)]["tokens_per_s"]
                out.append(ratio("batching", f"B={b} / B=1 decode tok/s", model, many,
                                 one["tokens_per_s"], "tok/s"))  # fmt: skip
        solo = one["solo_decode_step_tokens_per_s"]
        out.append(ratio("batching", "batched B=1 / solo decode_step tok/s", model,
                         one["tokens_per_s"], solo, "tok/s"))  # fmt: skip
    for r in rep.get("ttft", []):
        out.append(ratio("batching", f"short-request TTFT under load / idle, max_batch "
                         f"{r['max_batch']}", f"{r['long_generation_tokens']}-token generation",
                         r["under_load_ttft_s"], r["idle_ttft_s"], "s"))  # fmt: skip
    lat = {r["streams"]: r for r in rep.get("latency", [])}
    if 1 in lat and 8 in lat:
        out.append(ratio("batching", "per-token p99, 8 streams / 1", "tiny",
                         lat[8]["p99_ms"], lat[1]["p99_ms"], "ms"))  # fmt: skip
    return out


def responses(rep: Row) -> list[Row]:
    last = rep["rows"][-1]
    at = f"{last['history_tokens']} history tokens, Codex-shaped"
    return [
        ratio(
            "responses",
            f"cold / {path} TTFT",
            at,
            last["cold"]["ttft_s"],
            last[path]["ttft_s"],
            "s",
        )
        for path in ("live_call_id", "visible_prefix")
    ]


def llamacpp(rep: Row) -> list[Row]:
    from bench.llamacpp import DECODE, ours_for

    out = []
    for variant, theirs in rep.get("llama_cpp_tok_s", {}).items():
        ours = ours_for(rep, variant)
        for k, v in theirs.items():
            if k in ours:
                size, _, depth = k[2:].partition("@d")
                what = f"prefill {size} tokens" if k.startswith("pp") else f"decode {size} tokens"
                what += f" after {int(depth):,}" if depth else ""
                out.append(ratio("llamacpp", f"ds4jax / llama.cpp ({variant}) tok/s", what,
                                 ours[k], v, "tok/s"))  # fmt: skip
    for variant, paired in rep.get("decode_pairs", {}).items():
        a, b = (statistics.median(p[i] for p in paired["pairs"]) for i in (0, 1))
        row = ratio("llamacpp", f"ds4jax / llama.cpp ({variant}) tok/s",
                    f"decode {DECODE} tokens, {len(paired['pairs'])} pairs seconds apart "
                    "(median ratio)", a, b, "tok/s")  # fmt: skip
        out.append({**row, "value": paired["ratio"]})
    return out


def metrics(rep: Row) -> list[Row]:
    d = rep["decode"]
    at = f"{d['streams']} streams x {d['tokens_each']} tokens, tiny"
    rows = [ratio("metrics", "metrics on / off decode tok/s", at, d["on_median_tok_s"],
                  d["off_median_tok_s"], "tok/s")]  # fmt: skip
    if "token_us" in d:  # how many times the observer's own time a token takes
        rows.append(ratio("metrics", "token time / metrics observer's time per token", at,
                          round(1e6 / d["off_median_tok_s"], 2), d["token_us"], "us"))  # fmt: skip
    return rows


def paged(rep: Row) -> list[Row]:
    rows = rep["rows"]
    out = []
    for d, p in zip(rows[::2], rows[1::2], strict=True):
        at = f"ctx {d['context']}, 8 agents x {d['prompt_tokens']} tokens + retries"
        out.append(ratio("paged", "dense / paged retained-state bytes", at, d["state_bytes"],
                         p["state_bytes"], "B"))  # fmt: skip
    return out


def context(rep: Row) -> list[Row]:
    r8k, r1m, before, fp8 = rep["rows"]
    at = f"{rep['model']}, a {r8k['prompt_tokens']}-token conversation"
    return [
        ratio("context", "decode tok/s at ctx 1M / at ctx 8k", at, r1m["decode_tok_s"],
              r8k["decode_tok_s"], "tok/s"),
        ratio("context", f"decode tok/s at ctx 8k / before spans at ctx {before['context']}",
              at, r8k["decode_tok_s"], before["decode_tok_s"], "tok/s"),
        ratio("context", "decode tok/s with fp8 / f32 states at ctx 8k", at,
              fp8["decode_tok_s"], r8k["decode_tok_s"], "tok/s"),
        ratio("context", "prefill tok/s with fp8 / f32 states at ctx 8k", at,
              fp8["prefill_tok_s"], r8k["prefill_tok_s"], "tok/s"),
    ]  # fmt: skip


def ops(rep: Row) -> list[Row]:
    rows = {r["batch"]: r for r in rep["rows"]}
    at = f"{rep['model']}, greedy, after a {rep['prompt_tokens']}-token prompt"
    out = [ratio("ops", f"aggregate decode tok/s at B={b} / B=1", at, rows[b]["tok_s"],
                 rows[1]["tok_s"], "tok/s") for b in (4, 8) if b in rows]  # fmt: skip
    out += [ratio("ops", f"aggregate decode tok/s in bursts at B={b} / B=1", at,
                  rows[b]["burst_tok_s"], rows[1]["burst_tok_s"], "tok/s")
            for b in (4, 8) if b in rows and "burst_tok_s" in rows[b]]  # fmt: skip
    sampled = rep.get("sampled", {})
    at_sampled = (f"{rep['model']}, temperature {sampled.get('temperature')}, "
                  f"min-p {sampled.get('min_p')}, after a {rep['prompt_tokens']}-token "
                  "prompt")  # fmt: skip
    return out + [ratio("ops", f"aggregate decode tok/s in sampled bursts at B={b} / B=1",
                        at_sampled, rows[b]["sampled_burst_tok_s"],
                        rows[1]["sampled_burst_tok_s"], "tok/s")
                  for b in (4, 8) if b in rows and "sampled_burst_tok_s" in rows[b]]  # fmt: skip


def stall(rep: Row) -> list[Row]:
    """Each run's p99 gap while the prompt prefills against the p50 alone (the bar: 2),
    and the prompt's prefill rate bounded against whole chunks."""
    runs = {r["stall_bound"]: r for r in rep["runs"]}
    at = (f"{rep['model']}, {rep['streams']} streams, a "
          f"{rep['runs'][0]['prompt_tokens']}-token prompt")  # fmt: skip
    rows = [ratio("stall", f"stream p99 gap during a prefill / p50 alone, stall bound {b}", at,
                  r["during_prefill"]["p99_ms"], r["alone"]["p50_ms"], "ms")
            for b, r in runs.items()]  # fmt: skip
    if None in runs and len(runs) > 1:
        bounded = next(r for b, r in runs.items() if b is not None)
        rows.append(ratio("stall", "prompt prefill tok/s bounded / whole chunks", at,
                          bounded["prefill_tok_s"], runs[None]["prefill_tok_s"],
                          "tok/s"))  # fmt: skip
    return rows


def memory(rep: Row) -> list[Row]:
    a, r = rep["agents"], rep["retries"]
    at = f"{rep['model']}, ctx {a['context']}, 8 agents x {a['prompt_tokens'][0]} tokens"
    return [
        ratio("memory", "retained bytes at the context's capacity / with spans", at,
              a["full_capacity_bytes"], a["state_bytes"], "B"),
        ratio("memory", f"pages added per retry of a {r['prompt_tokens']}-token prompt",
              f"{rep['model']}, paged", r["pages_added"], r["retries"], "pages"),
    ]  # fmt: skip


def speculative(rep: Row) -> list[Row]:
    return [ratio("speculative", f"decode tok/s speculative (MTP) / plain at B={r['B']}",
                  f"{r['model']}, T={r['temperature']}, acceptance {r['acceptance']}",
                  r["spec_tok_s"], r["plain_tok_s"], "tok/s") for r in rep["rows"]]  # fmt: skip


def streams(rep: Row) -> list[Row]:
    """n streaming SDK clients' tokens in all against one client alone, over HTTP."""
    rows = {r["clients"]: r for r in rep["rows"]}
    at = f"{rep['model']}, `ds4jax serve` defaults, {rep['tokens']} tokens a client"
    return [ratio("streams", f"decode tok/s in all over HTTP, {n} SDK clients / 1", at,
                  rows[n]["aggregate_tok_s"], rows[1]["aggregate_tok_s"], "tok/s")
            for n in sorted(rows) if n > 1 and 1 in rows]  # fmt: skip


PARTS = {
    "prompt": prompt,
    "model": model,
    "continuation": continuation,
    "disk": disk,
    "kernels": kernels,
    "sessions": sessions,
    "batching": batching,
    "responses": responses,
    "llamacpp": llamacpp,
    "metrics": metrics,
    "paged": paged,
    "context": context,
    "ops": ops,
    "memory": memory,
    "stall": stall,
    "speculative": speculative,
    "streams": streams,
}


def summary_rows(results: dict[str, Row]) -> list[Row]:
    """The ratios of every part in `results` (part → the dict its `main` returned)."""
    return [row for part, rep in results.items() if part in PARTS for row in PARTS[part](rep)]


def _num(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f} {unit}" if abs(x) >= 1000 else f"{x:.4g} {unit}"


def _cells(row: Row) -> list[str]:
    value = "-" if row["value"] is None else f"{row['value']:.3g}x"
    sides = f"{_num(row['numerator'], row['unit'])} / {_num(row['denominator'], row['unit'])}"
    return [row["part"], row["ratio"], row["at"], value, sides]


HEADER = ["part", "ratio", "at", "value", "numerator / denominator"]


def format_table(rows: list[Row]) -> str:
    """Aligned plain text, for the terminal."""
    cells = [HEADER, *(_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    lines = [
        "  ".join(
            c.rjust(w) if i == 3 else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def markdown(rows: list[Row], title: str, notes: list[str]) -> str:
    lines = [
        f"# {title}",
        "",
        *(f"- {n}" for n in notes),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(["---", "---", "---", "---:", "---"]) + "|",
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write(rows: list[Row], stamp: str, notes: list[str], out_dir: Path = RESULTS_DIR) -> list[Path]:
    """`summary-<stamp>.csv` (numbers) and `.md` (the printed table, with `notes` above)."""
    csv_path = write_csv(out_dir / f"summary-{stamp}.csv", rows)
    md_path = out_dir / f"summary-{stamp}.md"
    md_path.write_text(markdown(rows, f"bench summary {stamp}", notes), encoding="utf-8")
    return [csv_path, md_path]
