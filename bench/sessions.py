"""Many conversations on one engine: what the session pool and fork points buy (issue 13).

Four measurements, each side by side in this run:

* **live rate** — six agents (the trained demo model, greedy) each run `add` tool loops,
  interleaved as a FIFO worker sees concurrent clients: every agent's call turn, then every
  agent's tool-result turn. Reported: the share of tool-result turns that continued live,
  for a pool of 1 session (the engine before the pool), 4 (the `serve` default) and 6.
* **retry** — a ~16k-token prompt sent twice, as a client retry or "regenerate" does:
  TTFT of the cold first request vs the retry (a fork point: nothing prefilled).
* **sub-agent** — a main agent's tool call, then a sub-agent with the same system prompt
  and tools (its own task, its own tool call), then the main agent's tool-result turn.
  Its TTFT with the sub-agent in between vs with nothing in between: one session without
  fork points (the engine before the pool), one session with them, and 4 sessions.
* **memory** — bytes of one retained state (a resident session or a fork point cost the
  same: a state of the capacity of the context) for the DeepSeek V4 Flash shapes, by
  context, from `jax.eval_shape` (nothing is allocated).

TTFT = prefill + the first decode step (`max_tokens=1`). The tiny config (random weights)
serves the retry and sub-agent parts, as in `bench.continuation`.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from bench.continuation import CALL, TOOLS, _follow_up, _system
from bench.report import write_json

POOL_SIZES = (1, 4, 6)
AGENTS = 6
FLASH_CONTEXTS = (8192, 65536, 262144, 1048576)


def _engine(cfg, params, tok, max_len: int, sessions: int, fork_points: bool = True):
    from ds4jax.engine import Engine

    return Engine(cfg, params, tok, max_len=max_len, sessions=sessions, fork_points=fork_points)


def pool_label(sessions: int, fork_points: bool) -> str:
    return f"{sessions} session{'s' if sessions > 1 else ''}" + (
        "" if fork_points else ", no fork points"
    )


def _prepared(engine, body: dict, max_tokens: int):
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.engine import SamplingParams

    return engine.prepare_request(parse_messages_request(body), max_tokens=max_tokens,
                                  sampling=SamplingParams(temperature=0.0))  # fmt: skip


def live_rate(loops: int) -> list[dict[str, Any]]:
    from ds4jax.chat.anthropic import response_content
    from ds4jax.chat.tokenizer import load_tokenizer
    from ds4jax.continuation.types import CacheSource
    from ds4jax.demo.corpus import TOOLS as DEMO_TOOLS
    from ds4jax.weights.checkpoint import load_model

    cfg, params, tok, _ = load_model("demo", load_tokenizer=load_tokenizer)
    rows = []
    for n in POOL_SIZES:
        engine = _engine(cfg, params, tok, 2048, n)
        engine.warm_up()
        live = turns = 0
        t0 = time.perf_counter()
        for k in range(loops):
            bodies, firsts = [], []
            for a in range(AGENTS):  # every agent's call turn …
                ask = f"What is {11 * a + k + 2} plus {7 * k + a}?"
                body = {"tools": DEMO_TOOLS, "messages": [{"role": "user", "content": ask}]}
                bodies.append(body)
                firsts.append(engine.run(_prepared(engine, body, 200)))
            for body, res in zip(bodies, firsts, strict=True):  # … then every tool result
                if not res.tool_ids:
                    continue  # the model answered without a call: no tool turn to count
                content = response_content(res.message, res.tool_ids)
                call = next(b for b in content if b["type"] == "tool_use")
                result = str(sum(call["input"].values()))
                answer = {"type": "tool_result", "tool_use_id": call["id"], "content": result}
                follow = dict(body, messages=[*body["messages"],
                                              {"role": "assistant", "content": content},
                                              {"role": "user", "content": [answer]}])  # fmt: skip
                res2 = engine.run(_prepared(engine, follow, 200))
                turns += 1
                live += res2.source is CacheSource.LIVE_TOOL
        seconds = time.perf_counter() - t0
        rows.append({"sessions": n, "agents": AGENTS, "loops_per_agent": loops,
                     "tool_turns": turns, "live_turns": live,
                     "live_share": round(live / turns, 3) if turns else None,
                     "seconds": round(seconds, 2)})  # fmt: skip
        print(f"   {n} sessions: {live}/{turns} tool-result turns live ({seconds:.1f} s)",
              flush=True)  # fmt: skip
    return rows


def retry(tok, cfg, params, n: int) -> dict[str, Any]:
    body = {"system": _system(tok, n), "tools": TOOLS,
            "messages": [{"role": "user", "content": "Review the change, please."}]}  # fmt: skip
    engine = _engine(cfg, params, tok, n + 1024, 4)
    engine.warm_up()
    req = _prepared(engine, body, 1)
    runs = []
    for _ in range(2):  # best of two: a fresh pool each time, so the first is always cold
        engine.reset()
        t = time.perf_counter()
        first = engine.run(req)
        cold_s = time.perf_counter() - t
        t = time.perf_counter()
        again = engine.run(req)
        runs.append((cold_s, time.perf_counter() - t, first, again))
    cold_s = min(r[0] for r in runs)
    retry_s = min(r[1] for r in runs)
    first, again = runs[-1][2], runs[-1][3]
    row = {"prompt_tokens": first.prompt_tokens, "cold_ttft_s": round(cold_s, 4),
           "retry_ttft_s": round(retry_s, 4), "retry_source": again.source.value,
           "retry_cached": again.cached, "retry_prefilled": again.prefilled}  # fmt: skip
    print(f"   {row['prompt_tokens']} tokens: cold {cold_s:.3f} s, retry {retry_s:.4f} s "
          f"({again.source.value}, {again.prefilled} prefilled)", flush=True)  # fmt: skip
    return row


def subagent(tok, cfg, params, n: int) -> list[dict[str, Any]]:
    from ds4jax.chat.segments import template

    system = _system(tok, n)
    call = tok.encode_segments(template(CALL))
    main = {"system": system, "tools": TOOLS, "messages": [{"role": "user", "content": "go"}]}
    sub = {"system": system, "tools": TOOLS,
           "messages": [{"role": "user", "content": "Find every caller of parse()."}]}  # fmt: skip
    rows = []
    for sessions, forks in ((1, False), (1, True), (4, True)):
        engine = _engine(cfg, params, tok, n + 1024, sessions, forks)
        engine.warm_up()
        row: dict[str, Any] = {"sessions": sessions, "fork_points": forks}
        for case in ("alone", "with_subagent"):
            best = None
            for _ in range(2):
                engine.reset()
                res = engine.run(_prepared(engine, main, 200), forced_tokens=call)
                if case == "with_subagent":
                    engine.run(_prepared(engine, sub, 200), forced_tokens=call)
                follow = _follow_up(main, res.tool_ids[0])
                t = time.perf_counter()
                back = engine.run(_prepared(engine, follow, 1))
                s = time.perf_counter() - t
                if best is None or s < best[0]:
                    best = (s, back)
            row[f"{case}_ttft_s"] = round(best[0], 4)
            row[f"{case}_source"] = best[1].source.value
            row[f"{case}_prefilled"] = best[1].prefilled
        row["history_tokens"] = best[1].prompt_tokens
        rows.append(row)
        print(f"   {pool_label(sessions, forks)}: main turn TTFT alone {row['alone_ttft_s']:.4f} s "
              f"({row['alone_source']}), after a sub-agent {row['with_subagent_ttft_s']:.4f} s "
              f"({row['with_subagent_source']})", flush=True)  # fmt: skip
    return rows


def memory() -> list[dict[str, Any]]:
    from ds4jax.config import load_config
    from ds4jax.model.state import capacity_bytes, state_bytes

    cfg = load_config("deepseek-v4-flash")
    rows = []
    for ctx in FLASH_CONTEXTS:
        nbytes = capacity_bytes(cfg, ctx)
        rows.append({"config": "deepseek-v4-flash", "context": ctx,
                     "bytes_per_session": nbytes, "bytes_per_fork_point": nbytes,
                     "live_bytes_when_full": state_bytes(cfg, ctx)})  # fmt: skip
        print(f"   context {ctx:>8}: {nbytes / 2**20:9.1f} MB per session or fork point",
              flush=True)  # fmt: skip
    return rows


def main(quick: bool = False) -> dict:
    from bench.disk import use_compile_cache
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params

    use_compile_cache()
    n = 2048 if quick else 16384
    print("-- live rate: six agents, interleaved tool loops (demo model)", flush=True)
    rate = live_rate(loops=1 if quick else 4)
    cfg = load_config("tiny")
    tok = V4Tokenizer()
    params = init_params(cfg, 0)
    print(f"-- retry of a ~{n}-token prompt (tiny model)", flush=True)
    rt = retry(tok, cfg, params, n)
    sub_n = 1024 if quick else 4096
    print(f"-- sub-agent sharing system + tools, ~{sub_n}-token system prompt", flush=True)
    sub = subagent(tok, cfg, params, sub_n)
    print("-- state bytes per session / fork point, DeepSeek V4 Flash shapes", flush=True)
    mem = memory()
    now = datetime.now()
    out = {"date": now.isoformat(timespec="seconds"), "quick": quick, "live_rate": rate,
           "retry": rt, "subagent": sub, "memory": mem}  # fmt: skip
    write_json("sessions", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
