"""Operations per decode step (issue 27): how many XLA operations one step of the server's
batched decode (`model.batch.step`) executes, and what a step costs at B = 1, 2, 4, 8.

Why count: on XLA:CPU each operation of a compiled program is a separate kernel call with a
fixed cost of a few microseconds (a launch on a GPU, a serial op on a TPU), and a decode
step of a small model is mostly such calls, not arithmetic. The count is read from the
optimized HLO the step compiles to (`count_ops`), so it is a property of the program, the
same on every machine and every run; the timings beside it are this machine's.

What counts as one operation: every instruction of the entry computation that runs a
kernel — a fusion, a dot, a copy, a concatenate, a custom call, … — but not the free ones
(parameters, constants, tuples and their elements, bitcasts). A `while` counts its body
and condition once per iteration (XLA records a loop's trip count when it knows it; an
unknown one counts once and is reported), a `conditional` one plus one branch — its
smallest in `total`, its largest in `most` — and a `call` what it calls. The step's
conditionals are "some row sampled EOS" and "some row samples rather than decodes greedily"
(both false in the greedy steps timed here: the smallest branch), and, in the MoE, "this
expert was not applied yet" per selected expert (true for each distinct one), so the ops a
step runs lie between the two. Fused computations are not walked: a fusion is one kernel.

    python -m bench ops [--quick]

Results are printed and written to `bench/results/ops-<date>-<HHMM>[-quick].json`
(`bench.report.write_json`).
"""

from __future__ import annotations

import datetime
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.report import write_json

SIZES = (1, 2, 4, 8)
#: instructions that run no kernel
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "after-all", "partition-id", "replica-id"})  # fmt: skip

_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INST = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(")


@dataclass
class OpCount:
    total: int = 0  # conditionals' smallest branches
    most: int = 0  # conditionals' largest branches
    by_kind: Counter = field(default_factory=Counter)  # fusions by their kind
    unknown_loops: int = 0  # while loops whose trip count XLA did not record


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, cur = "", None
    for line in hlo.splitlines():
        if m := _HEAD.match(line):
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and (m := _INST.match(line)):
            comps[cur].append((m.group(1), line))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _callee(line: str, attr: str) -> str:
    m = re.search(rf"{attr}=%?([\w.\-]+)", line)
    if m is None:
        raise ValueError(f"no {attr}= in {line[:120]!r}")
    return m.group(1)


def count_ops(hlo: str) -> OpCount:
    """Operations one execution of the optimized HLO module `hlo` (`compiled.as_text()`)
    runs, by the rules in the module docstring."""
    comps, entry = _computations(hlo)
    out = OpCount()
    pick = min

    def walk(name: str, times: int) -> int:
        n = 0
        for op, line in comps[name]:
            if op in FREE:
                continue
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                k = int(trips.group(1)) if trips else 1
                out.unknown_loops += trips is None and times > 0
                body, cond = _callee(line, "body"), _callee(line, "condition")
                n += k * (walk(body, times * k) + walk(cond, times * k))
            elif op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", line)
                if m:
                    names = [b.strip().lstrip("%") for b in m.group(1).split(",")]
                else:
                    names = [_callee(line, f"{k}_computation") for k in ("true", "false")]
                chosen = pick(names, key=lambda b: walk(b, 0))  # times 0: sizes only
                n += 1 + walk(chosen, times)
                out.by_kind["conditional"] += times
            elif op == "call":
                n += walk(_callee(line, "to_apply"), times)
            else:
                kind = re.search(r"kind=(k\w+)", line) if op == "fusion" else None
                out.by_kind[f"fusion {kind.group(1)}" if kind else op] += times
                n += 1
        return n

    out.total = walk(entry, 1)
    pick = max
    out.most = walk(entry, 0)
    return out


def step_args(size: int) -> tuple:
    """The per-row arguments of `model.batch.step` for `size` greedy rows: no forced token,
    temperature 0, no filters."""
    return (np.full(size, -1, np.int32), np.zeros((size, 2), np.uint32),
            np.zeros(size, np.float32), np.zeros(size, np.int32), np.ones(size, np.float32),
            np.zeros(size, np.float32), np.int32(-1))  # fmt: skip


def decode_step_ops(cfg: Any, params: Any, state: Any, size: int) -> OpCount:
    """The operations of `model.batch.step` for `size` rows of `state`'s shapes."""
    import jax

    from ds4jax.model import batch as batch_ops

    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *x.shape), x.dtype), state)
    lowered = batch_ops.step.lower(params, rows, *step_args(size), cfg=cfg, size=size)
    return count_ops(lowered.compile().as_text())


def step_ms(cfg: Any, params: Any, state: Any, sizes: tuple[int, ...],
            steps: int) -> dict[int, list[float]]:  # fmt: skip
    """Wall time of `steps` greedy steps at each batch size, each step read back as the
    server does. The sizes take turns step by step (all compiled first), so a drift of
    this machine's speed weighs on every size alike: their ratios are what is measured."""
    import jax
    import jax.numpy as jnp

    from ds4jax.model import batch as batch_ops

    batches, args = {}, {size: step_args(size) for size in sizes}
    for size in sizes:
        b = jax.tree.map(lambda x, n=size: jnp.array(jnp.broadcast_to(x, (n, *x.shape))), state)
        for _ in range(3):  # compile, warm
            b, tok, _k = batch_ops.step(params, b, *args[size], cfg=cfg, size=size)
            np.asarray(tok)
        batches[size] = b
    out: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(steps):
        for size in sizes:
            t0 = time.perf_counter()
            batches[size], tok, _k = batch_ops.step(params, batches[size], *args[size],
                                                    cfg=cfg, size=size)  # fmt: skip
            np.asarray(tok)
            out[size].append((time.perf_counter() - t0) * 1e3)
    return out


def run(quick: bool) -> dict[str, Any]:
    import jax

    from ds4jax.config import load_config
    from ds4jax.model.forward import prefill
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    name = "tiny" if quick else "bench-192m"
    cfg = load_config(name)
    params = init_params(cfg, 0)
    prompt = np.arange(2, 402, dtype=np.int32) % 5000  # a 400-token conversation
    state, _ = prefill(params, init_state(cfg, 4096), prompt, cfg)
    jax.block_until_ready(state)
    rows = []
    timings = step_ms(cfg, params, state, SIZES, 10 if quick else 40)
    for size in SIZES:
        ops = decode_step_ops(cfg, params, state, size)
        times = timings[size]
        ms = statistics.median(times)
        rows.append({"batch": size, "ops": ops.total, "ops_most": ops.most,
                     "unknown_loops": ops.unknown_loops,
                     "by_kind": dict(ops.by_kind.most_common()), "step_ms": round(ms, 2),
                     "tok_s": round(size / ms * 1e3, 1), "step_ms_all": times})  # fmt: skip
    base = rows[0]["tok_s"]
    for r in rows:
        r["aggregate_vs_b1"] = round(r["tok_s"] / base, 2)
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": quick,
            "model": name, "prompt_tokens": int(prompt.size), "state_capacity": 4096,
            "rows": rows}  # fmt: skip


def main(quick: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    rep = run(quick)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\n{rep['model']}, decode step after a {rep['prompt_tokens']}-token prompt "
          f"(greedy, median of the steps, the sizes taking turns)")  # fmt: skip
    print(f"{'batch':>5} {'ops':>12} {'ms/step':>8} {'tok/s':>7} {'vs B=1':>7}  largest kinds")
    for r in rep["rows"]:
        kinds = ", ".join(f"{k} {v}" for k, v in list(r["by_kind"].items())[:4])
        ops = f"{r['ops']}-{r['ops_most']}"
        print(f"{r['batch']:>5} {ops:>12} {r['step_ms']:>8.1f} {r['tok_s']:>7.1f} "
              f"{r['aggregate_vs_b1']:>6.2f}x  {kinds}")  # fmt: skip
    write_json("ops", rep, quick)
    return rep


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
