"""The study over many conversations: `run` measures them into a `Report` (with the
other-conversation reference row), `summarize` / `format_table` make the per-kind table and
`factor_counts` says how often each factor actually changed something."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ds4jax.engine import Engine
from ds4jax.fidelity.conversations import CLIENTS
from ds4jax.fidelity.measures import kl_divergence, top1_agreement
from ds4jax.fidelity.replays import (
    KIND_LABELS,
    KINDS,
    ConversationResult,
    _tool_use_ids,
    measure_conversation,
)
from ds4jax.fidelity.trajectory import Settings

#: The reference row: a different conversation's live state at the same position.
OTHER = "other"


@dataclass
class Report:
    settings: Settings
    results: list[ConversationResult]
    #: KL / top-1 at the first assistant position between conversation i's live state and
    #: conversation i+1's: the scale of "a different conversation altogether".
    other_kl: np.ndarray
    other_top1: np.ndarray


def run(
    engine: Engine,
    settings: Settings = Settings(),  # noqa: B008 (frozen: a shared default is safe)
    *,
    progress: Callable[[int, ConversationResult], None] | None = None,
) -> Report:
    """Measure `settings.conversations` seeded conversations (conversation i is the same
    whatever their number)."""
    results = []
    for i in range(settings.conversations):
        res = measure_conversation(engine, i, settings)
        results.append(res)
        if progress is not None:
            progress(i, res)
    engine.reset()
    n = len(results)
    firsts = [r.first_logits for r in results]
    pairs = [(firsts[i], firsts[(i + 1) % n]) for i in range(n)] if n > 1 else []
    other_kl = np.array([float(kl_divergence(a, b)) for a, b in pairs])
    other_top1 = np.array([bool(top1_agreement(a, b)) for a, b in pairs])
    return Report(settings, results, other_kl, other_top1)


@dataclass(frozen=True)
class KindSummary:
    kind: str
    label: str
    kl_first_mean: float
    kl_first_median: float
    kl_all_mean: float
    kl_all_p90: float
    top1_first: float
    top1_all: float
    shared_prefix_mean: float  # tokens
    shared_fraction_mean: float  # of the live prompt
    length_delta_mean: float  # replay tokens - live tokens
    identical: int  # conversations whose replay ids equal the live ids


def summarize(report: Report) -> list[KindSummary]:
    """One row per replay kind, then the `other` reference row (first position only)."""
    rows = []
    for kind in KINDS:
        rs = [r.kinds[kind] for r in report.results]
        lives = [r.trajectory.live_ids for r in report.results]
        first = np.array([k.kl[0] for k in rs])
        every = np.concatenate([k.kl for k in rs])
        rows.append(
            KindSummary(
                kind=kind,
                label=KIND_LABELS[kind],
                kl_first_mean=float(first.mean()),
                kl_first_median=float(np.median(first)),
                kl_all_mean=float(every.mean()),
                kl_all_p90=float(np.quantile(every, 0.9)),
                top1_first=float(np.mean([k.top1[0] for k in rs])),
                top1_all=float(np.concatenate([k.top1 for k in rs]).mean()),
                shared_prefix_mean=float(np.mean([k.shared_prefix for k in rs])),
                shared_fraction_mean=float(
                    np.mean([k.shared_prefix / len(li) for k, li in zip(rs, lives, strict=True)])
                ),
                length_delta_mean=float(
                    np.mean([len(k.ids) - len(li) for k, li in zip(rs, lives, strict=True)])
                ),
                identical=sum(k.ids == li for k, li in zip(rs, lives, strict=True)),
            )
        )
    if len(report.other_kl):
        o = report.other_kl
        rows.append(
            KindSummary(
                kind=OTHER, label="reference: another conversation's live state",
                kl_first_mean=float(o.mean()), kl_first_median=float(np.median(o)),
                kl_all_mean=float("nan"), kl_all_p90=float("nan"),
                top1_first=float(report.other_top1.mean()), top1_all=float("nan"),
                shared_prefix_mean=float("nan"), shared_fraction_mean=float("nan"),
                length_delta_mean=float("nan"), identical=0,
            )
        )  # fmt: skip
    return rows


def format_table(rows: Sequence[KindSummary]) -> str:
    """A plain-text table of `summarize` (no pandas)."""
    head = (
        f"{'kind':<7} {'KL@0 mean':>10} {'KL@0 med':>10} {'KL all':>10} {'KL p90':>10} "
        f"{'top1@0':>7} {'top1':>6} {'shared':>7} {'shared%':>8} {'Δlen':>6} {'same':>5}"
    )
    lines = [head, "-" * len(head)]

    def num(x: float, fmt: str) -> str:
        return "-" if np.isnan(x) else format(x, fmt)

    for r in rows:
        lines.append(
            f"{r.kind:<7} {num(r.kl_first_mean, '10.3g')} {num(r.kl_first_median, '10.3g')} "
            f"{num(r.kl_all_mean, '10.3g')} {num(r.kl_all_p90, '10.3g')} "
            f"{num(r.top1_first, '7.2f')} {num(r.top1_all, '6.2f')} "
            f"{num(r.shared_prefix_mean, '7.1f')} {num(100 * r.shared_fraction_mean, '7.1f')}% "
            f"{num(r.length_delta_mean, '6.1f')} {r.identical:>5}"
        )
    lines.append("")
    lines += [f"{r.kind:<7} {r.label}" for r in rows]
    return "\n".join(lines)


def factor_counts(report: Report) -> dict[str, int]:
    """How often each factor actually changed something (reasoning is always dropped in
    `a`), and which clients replayed the JSON."""
    rs = report.results
    out = {
        "conversations": len(rs),
        "tool JSON re-serialised to different bytes": sum(r.dsml_changed for r in rs),
        "sampled reasoning ids non-canonical": sum(r.reasoning_noncanonical for r in rs),
        "sampled DSML ids non-canonical": sum(r.dsml_noncanonical for r in rs),
        "parallel tool calls": sum(len(_tool_use_ids(r.trajectory.client_body)) > 1 for r in rs),
    }
    for client in CLIENTS:
        out[f"client {client}"] = sum(r.trajectory.client == client for r in rs)
    return out
