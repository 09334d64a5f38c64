"""PNG plots of the bench tables (the rows `bench.report` builds).

`matplotlib.figure.Figure` with the Agg canvas it picks by default for `savefig` to a
PNG: no pyplot, so no global state, no GUI backend, nothing to close on a headless
machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

Row = dict[str, Any]


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps a legend placed outside the axes
    return path


def ttft(rows: list[Row], path: Path) -> Path:
    """TTFT vs history length, one line per path; log y, as cold is ~100× the live path."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for name in dict.fromkeys(r["path"] for r in rows):
        pts = sorted((r["history_tokens"], r["ttft_s"]) for r in rows if r["path"] == name)
        ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="history (tokens)",
        ylabel="TTFT (s)",
        title="Time to first token of a tool-result turn, by path",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    return _save(fig, path)


def model_speed(prefill: list[Row], decode: list[Row], path: Path) -> Path:
    """Prefill tokens/s vs prompt length (both engines), and decode tokens/s as bars."""
    fig = Figure(figsize=(10, 4.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    for engine in ("ds4jax", "transformers"):
        pts = sorted(
            (r["tokens"], r["tok_per_s"])
            for r in prefill
            if r["engine"] == engine and r["tok_per_s"]
        )
        if pts:
            left.plot(*zip(*pts, strict=True), marker="o", label=engine)
    left.set(
        xscale="log", xlabel="prompt (tokens)", ylabel="prefill tokens/s (best)", title="Prefill"
    )
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    bars = [(r["engine"], r["tok_per_s"] or 0.0) for r in decode]
    right.bar([e for e, _ in bars], [v for _, v in bars], color=["C0", "C1"][: len(bars)])
    d = decode[0] if decode else {"steps": "?", "context_tokens": "?"}
    right.set(
        ylabel="decode tokens/s (best)",
        title=f"Decode ({d['steps']} steps after {d['context_tokens']})",
    )
    return _save(fig, path)


def state_bytes(rows: list[Row], path: Path) -> Path:
    """Live state bytes per token vs context, against a dense per-token cache, per config."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, config in enumerate(dict.fromkeys(r["config"] for r in rows)):
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["context_tokens"])
        x = [r["context_tokens"] for r in mine]
        ax.plot(
            x,
            [r["state_bytes_per_token"] for r in mine],
            marker="o",
            color=f"C{i}",
            label=f"{config}: ds4jax state",
        )
        ax.plot(
            x,
            [r["dense_bytes_per_token"] for r in mine],
            ls="--",
            color=f"C{i}",
            label=f"{config}: dense per-token cache",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context (tokens)",
        ylabel="bytes per token",
        title="State bytes per token (float32)",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    return _save(fig, path)


def disk(throughput: list[Row], restart: list[Row], path: Path) -> Path:
    """Save / restore MB/s against Orbax alone and raw sequential I/O (grouped bars per
    config, log y), and the restart: cold prefill against restore + suffix."""
    fig = Figure(figsize=(11, 4.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    configs = list(dict.fromkeys(r["config"] for r in throughput))
    ops = list(dict.fromkeys(r["operation"] for r in throughput))
    width = 0.8 / max(len(ops), 1)
    for j, op in enumerate(ops):
        vals = {r["config"]: r["MB_per_s"] for r in throughput if r["operation"] == op}
        xs = [i + (j - (len(ops) - 1) / 2) * width for i in range(len(configs))]
        left.bar(xs, [vals.get(c, 0.0) for c in configs], width, label=op)
    left.set_xticks(range(len(configs)), configs)
    left.set(
        yscale="log",
        ylabel="MB/s of live state (median)",
        title="Disk checkpoint vs Orbax alone vs raw I/O",
    )
    left.legend(fontsize=8)
    labels = [str(r["tokens"]) for r in restart]
    xs = list(range(len(restart)))
    right.bar([x - 0.2 for x in xs], [r["cold_prefill_s"] for r in restart], 0.4, label="cold")
    right.bar(
        [x + 0.2 for x in xs], [r["restore_total_s"] for r in restart], 0.4, label="load + suffix"
    )
    right.set_xticks(xs, labels)
    right.set(xlabel="checkpoint (tokens)", ylabel="seconds", title="Restart (tiny model)")
    right.legend(fontsize=8)
    return _save(fig, path)
