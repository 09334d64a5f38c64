"""Speculative decoding with the MTP block (issue 29), side by side in one run.

For each model — the trained demo (its MTP block trained by `ds4jax.demo.train_mtp`) and
bench-192m with random weights and a random MTP block (acceptance ≈ 0: what speculation
costs when it never pays) — and each batch size B = 1, 4, 8: B requests decode together
in an engine without speculation and in one with `--speculative mtp` (gate open up to
8), alternated, `REPEATS` runs each. Reported per case: the aggregate decode rate (tokens
decided after every request's prompt was in, over the wall time they took; prefill is the
same in both and left out), the ratio, the drafts' acceptance, and for greedy whether every
output matched the plain engine's. The demo runs greedy and at temperature 1.

    python -m bench speculative [--quick]

Writes `bench/results/speculative-<date>-<HHMM>[-quick].json`.
"""

from __future__ import annotations

import statistics
import time
from datetime import datetime
from typing import Any

from bench.report import write_json

SIZES = (1, 4, 8)
#: runs of each case per model (the demo's replies decode in ~0.1 s: more runs for a median)
REPEATS = {"demo": 9, "bench-192m": 3}


def _engines(name: str, max_len: int) -> tuple[Any, Any]:
    """(plain, speculative) engines on the same weights."""
    from ds4jax.chat.tokenizer import V4Tokenizer, load_tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.model.params import init_params
    from ds4jax.weights.checkpoint import load_model

    if name == "demo":
        cfg, params, tokenizer, _ = load_model("demo", mtp=True, load_tokenizer=load_tokenizer)
    else:
        cfg = load_config(name)
        params = init_params(cfg, 0, mtp_layers=1)
        tokenizer = V4Tokenizer()
    alone = {k: v for k, v in params.items() if k != "mtp"}
    kw = dict(max_len=max_len, sessions=8, max_batch=8)
    return (
        Engine(cfg, alone, tokenizer, **kw),
        Engine(cfg, params, tokenizer, speculative="mtp", speculative_max_batch=8, **kw),
    )


def _requests(engine: Any, name: str, B: int, temperature: float, max_tokens: int) -> list[Any]:
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.engine import SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=7)
    if name == "demo":
        from ds4jax.demo.corpus import held_out_tasks, request_body
        from ds4jax.demo.evaluate import HELD_OUT_SEED

        kinds = ("single", "parallel", "followup", "refusal")
        tasks = [held_out_tasks(1, HELD_OUT_SEED + i, kinds[i % 4])[0] for i in range(B)]
        bodies = [request_body(t, thinking=True, system=None) for t in tasks]
    else:
        bodies = [{"messages": [{"role": "user", "content": f"Write story number {i}."}],
                   "thinking": {"type": "disabled"}} for i in range(B)]  # fmt: skip
    return [engine.prepare_request(parse_messages_request(b), max_tokens=max_tokens,
                                   sampling=sampling) for b in bodies]  # fmt: skip


def _decode(engine: Any, reqs: list[Any]) -> tuple[float, int, int, list[str]]:
    """(decode seconds, tokens decided in them, steps, the outputs): the clock starts once
    every request holds a row."""
    engine.pool = type(engine.pool).create(len(engine.pool.sessions), **engine._pool_args)
    engine.tool_memory = type(engine.tool_memory)()
    tickets = [engine.submit(r) for r in reqs]
    while engine.waiting or engine._prefilling:
        engine.tick()
    before = sum(len(t.decoder.generated) for t in tickets if t.decoder is not None)
    t0 = time.perf_counter()
    steps = 0
    while engine.busy:
        engine.tick()
        steps += 1
    took = time.perf_counter() - t0
    for t in tickets:
        if t.error is not None:
            raise t.error
    tokens = sum(t.result.output_tokens for t in tickets) - before
    return took, tokens, steps, [t.result.raw_text for t in tickets]


def case(name: str, plain: Any, spec: Any, B: int, temperature: float, max_tokens: int,
         repeats: int) -> dict[str, Any]:  # fmt: skip
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    step_ms: dict[str, list[float]] = {"plain": [], "spec": []}
    same = True
    counts = spec.spec.counts
    proposed, accepted = counts.proposed, counts.accepted
    for _ in range(repeats):
        outs = {}
        for label, engine in (("plain", plain), ("spec", spec)):
            reqs = _requests(engine, name, B, temperature, max_tokens)
            took, tokens, steps, outs[label] = _decode(engine, reqs)
            rates[label].append(tokens / took)
            step_ms[label].append(1000 * took / max(steps, 1))
        same &= outs["plain"] == outs["spec"]
    drafts = counts.proposed - proposed
    row = {
        "model": name, "B": B, "temperature": temperature,
        "plain_tok_s": round(statistics.median(rates["plain"]), 1),
        "spec_tok_s": round(statistics.median(rates["spec"]), 1),
        "plain_step_ms": round(statistics.median(step_ms["plain"]), 2),
        "spec_step_ms": round(statistics.median(step_ms["spec"]), 2),
        "spec_tok_s_range": [round(min(rates["spec"]), 1), round(max(rates["spec"]), 1)],
        "plain_tok_s_range": [round(min(rates["plain"]), 1), round(max(rates["plain"]), 1)],
        "drafts": drafts,
        "acceptance": round((counts.accepted - accepted) / drafts, 3) if drafts else None,
    }  # fmt: skip
    row["ratio"] = round(row["spec_tok_s"] / row["plain_tok_s"], 3)
    if temperature == 0:
        row["greedy_outputs_identical"] = same
    print(f"  {name} B={B} T={temperature}: plain {row['plain_tok_s']} tok/s "
          f"({row['plain_step_ms']} ms a step), speculative {row['spec_tok_s']} "
          f"({row['spec_step_ms']} ms) = {row['ratio']}x, acceptance {row['acceptance']}"
          + (f", identical {same}" if temperature == 0 else ""),
          flush=True)  # fmt: skip
    return row


def main(quick: bool = False) -> dict[str, Any]:
    stamp = datetime.now().strftime("%Y-%m-%d-%H%M")

    rows = []
    plan = [("demo", 1024, (0.0, 1.0), 256), ("bench-192m", 512, (0.0,), 24 if quick else 48)]
    for name, max_len, temps, max_tokens in plan:
        plain, spec = _engines(name, max_len)
        for engine in (plain, spec):  # compile every batch size outside the timing
            for B in SIZES:
                _decode(engine, _requests(engine, name, B, 0.0, 4))
        for B in SIZES[:1] if quick else SIZES:
            for T in temps:
                rows.append(case(name, plain, spec, B, T, max_tokens,
                                 1 if quick else REPEATS[name]))  # fmt: skip
    out = {"rows": rows, "repeats": REPEATS, "stamp": stamp}
    write_json("speculative", out, quick)
    return out


if __name__ == "__main__":
    main()
