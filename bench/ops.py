"""Operations per decode step (issue 27): how many XLA operations one step of the server's
batched decode (`model.batch.step`) executes, and what a step costs at B = 1, 2, 4, 8 —
one program per token, and in bursts (`model.batch.burst`: `BURST_STEPS` tokens a row per
program, how the server decodes while every row only samples), whose aggregate tok/s
against B=1 is the batching bar.

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


def step_program(native_kernels: bool = True) -> Any:
    """A jit of the server's step (`model.batch.step`) of its own, traced with the native CPU
    kernels on or off (`ds4jax.native`), so both programs live in one process."""
    import contextlib

    import jax

    from ds4jax import native
    from ds4jax.model import batch as batch_ops

    raw = batch_ops.step.__wrapped__

    def step(params: Any, batch: Any, *args: Any, cfg: Any, size: int) -> Any:
        with contextlib.nullcontext() if native_kernels else native.disabled():
            return raw(params, batch, *args, cfg=cfg, size=size)

    return jax.jit(step, static_argnames=("cfg", "size"), donate_argnums=1)


def decode_step_ops(cfg: Any, params: Any, state: Any, size: int,
                    native_kernels: bool = True) -> OpCount:  # fmt: skip
    """The operations of the step for `size` rows of `state`'s shapes."""
    import jax

    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *x.shape), x.dtype), state)
    lowered = step_program(native_kernels).lower(params, rows, *step_args(size), cfg=cfg,
                                                 size=size)  # fmt: skip
    return count_ops(lowered.compile().as_text())


def take_turns(runs: dict[Any, Any], rounds: int) -> dict[Any, list[float]]:
    """Wall ms of each of `runs` (callables, compiled and warm), `rounds` times, the runs
    taking turns: a drift of this machine's speed weighs on every one alike, so their
    ratios are what is measured."""
    out: dict[Any, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            t0 = time.perf_counter()
            run()
            out[key].append((time.perf_counter() - t0) * 1e3)
    return out


def _rows(states: list[Any], size: int) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda *xs: jnp.stack(xs), *states[:size])


def step_ms(cfg: Any, params: Any, states: list[Any], sizes: tuple[int, ...], steps: int,
            ways: tuple[bool, ...] = (True,)) -> dict[tuple[bool, int], list[float]]:  # fmt: skip
    """Wall time of `steps` greedy steps at each batch size, with the native kernels on and
    off (`ways`), each step read back as the server does; row i of a batch is conversation
    `states[i]`; the programs take turns step by step (`take_turns`)."""
    programs = {way: step_program(way) for way in ways}
    batches = {(way, size): _rows(states, size) for way in ways for size in sizes}

    def run(way: bool, size: int) -> Any:
        args = step_args(size)  # made once, outside the timed call, as before

        def once() -> None:
            b, tok, _k = programs[way](params, batches[way, size], *args, cfg=cfg,
                                       size=size)  # fmt: skip
            batches[way, size] = b
            np.asarray(tok)

        return once

    runs = {key: run(*key) for key in batches}
    take_turns(runs, 3)  # compile, warm
    return take_turns(runs, steps)


#: temperature and min-p of a sampled burst: the server's defaults (`ds4jax serve --min-p`)
SAMPLED = (1.0, 0.05)


def burst_ms(cfg: Any, params: Any, states: list[Any], sizes: tuple[int, ...],
             bursts: int, sampled: bool = False) -> dict[int, list[float]]:  # fmt: skip
    """Wall ms per token of `bursts` bursts (`model.batch.burst`, the server's decode while
    every row only samples: `BURST_STEPS` tokens a row per program) at each batch size,
    greedy or `sampled` (`SAMPLED`, each row its own key, as the server's requests sample by
    default), the tokens read back after each, the sizes taking turns (`take_turns`)."""
    import jax

    from ds4jax.model import batch as batch_ops

    K = batch_ops.BURST_STEPS
    batches = {size: _rows(states, size) for size in sizes}

    def run(size: int) -> Any:
        _, *args = step_args(size)
        if sampled:
            keys = jax.random.key_data(jax.random.split(jax.random.key(size), size))
            args[0] = np.asarray(keys)  # args: keys, temperature, top-k, top-p, min-p, EOS
            args[1] = np.full(size, SAMPLED[0], np.float32)
            args[4] = np.full(size, SAMPLED[1], np.float32)
        allowed = np.full(size, K, np.int32)

        def once() -> None:
            b, tok, _k, _l = batch_ops.burst(params, batches[size], allowed, *args, cfg=cfg,
                                             size=size)  # fmt: skip
            batches[size] = b
            np.asarray(tok)

        return once

    runs = {size: run(size) for size in sizes}
    take_turns(runs, 2)  # compile, warm
    return {size: [ms / K for ms in times] for size, times in take_turns(runs, bursts).items()}


#: the rows' conversations: different tokens, so a batch's rows route to different experts
#: (copies of one conversation would all read the same four experts per layer)
ROW_PROMPTS = 8


def _prompt(row: int) -> np.ndarray:
    return ((np.arange(2, 402, dtype=np.int32) * (row + 1) + 97 * row) % 5000).astype(np.int32)


def run(quick: bool) -> dict[str, Any]:
    import jax

    from ds4jax import native
    from ds4jax.config import load_config
    from ds4jax.model.batch import BURST_STEPS
    from ds4jax.model.forward import prefill
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    name = "tiny" if quick else "bench-192m"
    cfg = load_config(name)
    params = init_params(cfg, 0)
    states = [prefill(params, init_state(cfg, 4096), _prompt(r), cfg)[0]
              for r in range(ROW_PROMPTS)]  # fmt: skip
    jax.block_until_ready(states)
    ways = (True, False) if native.active() else (False,)
    timings = step_ms(cfg, params, states, SIZES, 10 if quick else 40, ways)
    per_token = burst_ms(cfg, params, states, SIZES, 4 if quick else 16)
    sampled = burst_ms(cfg, params, states, SIZES, 4 if quick else 16, sampled=True)
    rows = []
    for size in SIZES:
        row: dict[str, Any] = {"batch": size}
        for way in ways:
            ops = decode_step_ops(cfg, params, states[0], size, way)
            times = timings[way, size]
            ms = statistics.median(times)
            pre = "" if way == ways[0] else "twin_"
            row.update({f"{pre}ops": ops.total, f"{pre}ops_most": ops.most,
                        f"{pre}unknown_loops": ops.unknown_loops, f"{pre}step_ms": round(ms, 2),
                        f"{pre}tok_s": round(size / ms * 1e3, 1),
                        f"{pre}step_ms_all": times})  # fmt: skip
            if not pre:
                row["by_kind"] = dict(ops.by_kind.most_common())
        ms = statistics.median(per_token[size])
        row.update({"burst_ms_per_token": round(ms, 2), "burst_tok_s": round(size / ms * 1e3, 1),
                    "burst_ms_all": per_token[size]})  # fmt: skip
        ms = statistics.median(sampled[size])
        row.update({"sampled_burst_ms_per_token": round(ms, 2),
                    "sampled_burst_tok_s": round(size / ms * 1e3, 1),
                    "sampled_burst_ms_all": sampled[size]})  # fmt: skip
        rows.append(row)
    for r in rows:
        r["aggregate_vs_b1"] = round(r["tok_s"] / rows[0]["tok_s"], 2)
        r["burst_aggregate_vs_b1"] = round(r["burst_tok_s"] / rows[0]["burst_tok_s"], 2)
        r["sampled_burst_aggregate_vs_b1"] = round(
            r["sampled_burst_tok_s"] / rows[0]["sampled_burst_tok_s"], 2
        )
        if "twin_tok_s" in r:
            r["twin_aggregate_vs_b1"] = round(r["twin_tok_s"] / rows[0]["twin_tok_s"], 2)
            r["native_speedup"] = round(r["twin_step_ms"] / r["step_ms"], 2)
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": quick,
            "model": name, "prompt_tokens": int(_prompt(0).size), "state_capacity": 4096,
            "native_kernels": ways[0], "burst_steps": BURST_STEPS,
            "sampled": {"temperature": SAMPLED[0], "min_p": SAMPLED[1]}, "rows": rows}  # fmt: skip


def main(quick: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    rep = run(quick)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\n{rep['model']}, decode step after a {rep['prompt_tokens']}-token prompt "
          f"(greedy, median of the steps, the sizes taking turns); bursts of "
          f"{rep['burst_steps']} steps per program as the server decodes, greedy and sampled "
          f"(temperature {SAMPLED[0]}, min-p {SAMPLED[1]}: the server's defaults)")  # fmt: skip
    twin = "twin_ops" in rep["rows"][0]
    print(f"rows: {ROW_PROMPTS} different conversations; native CPU kernels "
          f"{'on, beside the jnp twins (twin_*)' if twin else 'off'}")  # fmt: skip
    print(
        f"{'batch':>5} {'ops':>12} {'ms/step':>8} {'tok/s':>7} {'vs B=1':>7}"
        + f" {'burst ms/tok':>12} {'tok/s':>7} {'vs B=1':>7}"
        + f" {'sampled':>8} {'tok/s':>7} {'vs B=1':>7}"
        + (f" {'twin ops':>12} {'twin ms':>8} {'vs B=1':>7} {'speedup':>7}" if twin else "")
    )
    for r in rep["rows"]:
        line = (f"{r['batch']:>5} {r['ops']}-{r['ops_most']:<7} {r['step_ms']:>8.1f} "
                f"{r['tok_s']:>7.1f} {r['aggregate_vs_b1']:>6.2f}x "
                f"{r['burst_ms_per_token']:>12.2f} {r['burst_tok_s']:>7.1f} "
                f"{r['burst_aggregate_vs_b1']:>6.2f}x "
                f"{r['sampled_burst_ms_per_token']:>8.2f} {r['sampled_burst_tok_s']:>7.1f} "
                f"{r['sampled_burst_aggregate_vs_b1']:>6.2f}x")  # fmt: skip
        if twin:
            line += (f" {r['twin_ops']}-{r['twin_ops_most']:<7} {r['twin_step_ms']:>8.1f} "
                     f"{r['twin_aggregate_vs_b1']:>6.2f}x "
                     f"{r['native_speedup']:>6.2f}x")  # fmt: skip
        print(line)
    write_json("ops", rep, quick)
    return rep


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
