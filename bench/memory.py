"""Process memory as the issue 26 figures ask for it, on bench-192m (random weights):

* eight agents, each a ~2k-token conversation of its own, at `--ctx 1048576`: the growth of
  the process's resident memory (VmRSS) across the eight requests, and the retained-state
  bytes the pool counts; beside them what the same eight frontiers cost with every state at
  the context's capacity (`capacity_bytes`: the engine before spans could not warm up at
  1M, issue 26), with their fork points;
* eight retries of one long prompt with frontiers kept in pages (`--paged`): the pages and
  resident memory each retry adds (a retry forks the prompt end: its reply's tail page and
  a small part).

RSS is the whole process (XLA's buffers are host memory on CPU), read from /proc; it moves
with allocator reuse, so the pool's own counts are printed beside it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from bench.report import write_json

MODEL = "bench-192m"
AGENTS = 8


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _request(engine: Any, text: str, max_tokens: int) -> Any:
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.engine import SamplingParams

    body = {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": text}]}
    return engine.run(engine.prepare_request(parse_messages_request(body), max_tokens=max_tokens,
                                             sampling=SamplingParams(temperature=0.0)))  # fmt: skip


def agents(cfg: Any, params: Any, ctx: int, words: int) -> dict[str, Any]:
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.engine import Engine
    from ds4jax.model.state import capacity_bytes

    engine = Engine(cfg, params, V4Tokenizer(), max_len=ctx, sessions=AGENTS, fork_points=True,
                    chunk_sizes=(64, 512))  # fmt: skip
    engine.warm_up()
    _request(engine, "warm the programs up", 4)
    engine.reset()
    before = rss()
    prompts = []
    for i in range(AGENTS):
        text = f"Agent {i}: " + " ".join(f"w{i}x{k}" for k in range(words))
        prompts.append(_request(engine, text, 8).prompt_tokens)
    grown = rss() - before
    full = capacity_bytes(cfg, ctx)
    held = engine.pool.in_use() + len(engine.pool.forks)
    return {"context": ctx, "prompt_tokens": prompts, "rss_growth": grown,
            "state_bytes": engine.pool.state_bytes(), "frontiers": held,
            "full_capacity_bytes": held * full, "full_capacity_per_state": full}  # fmt: skip


def retries(cfg: Any, params: Any, ctx: int, words: int, n: int) -> dict[str, Any]:
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.engine import Engine

    engine = Engine(cfg, params, V4Tokenizer(), max_len=ctx, sessions=n + 1, fork_points=True,
                    chunk_sizes=(64, 512), paged_pages=4096)  # fmt: skip
    engine.warm_up()
    text = " ".join(f"line{k}" for k in range(words))
    first = _request(engine, text, 4)
    store = engine.pages
    store._drain()
    pages0, rss0 = store.pool.used, rss()
    sources = []
    for _ in range(n):
        res = _request(engine, text, 4)
        sources.append(res.source.value)
    store._drain()
    return {"context": ctx, "prompt_tokens": first.prompt_tokens, "retries": n,
            "sources": sources, "pages_added": store.pool.used - pages0,
            "page_bytes": store.page_nbytes, "small_bytes": store.small_nbytes,
            "rss_growth": rss() - rss0}  # fmt: skip


def main(quick: bool = False) -> dict[str, Any]:
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params

    name = "tiny" if quick else MODEL
    cfg = load_config(name)
    params = init_params(cfg, 0)
    ctx = 1 << 20
    a = agents(cfg, params, ctx, 200 if quick else 900)
    r = retries(cfg, params, ctx, 2000 if quick else 5200, 8)
    mib = 2**20
    print(f"   {name} ctx {ctx}: {AGENTS} agents x ~{a['prompt_tokens'][0]} tokens: RSS "
          f"+{a['rss_growth'] / mib:.1f} MiB, retained {a['state_bytes'] / mib:.1f} MiB in "
          f"{a['frontiers']} frontiers (at the context's capacity: "
          f"{a['full_capacity_bytes'] / mib:.0f} MiB, {a['full_capacity_per_state'] / mib:.0f} "
          f"MiB each)", flush=True)  # fmt: skip
    print(f"   {name} ctx {ctx}: {r['retries']} retries of a {r['prompt_tokens']}-token prompt "
          f"({set(r['sources'])}): +{r['pages_added']} pages of {r['page_bytes'] / mib:.2f} "
          f"MiB (+ a {r['small_bytes'] / mib:.2f} MiB small part each), RSS "
          f"+{r['rss_growth'] / mib:.1f} MiB", flush=True)  # fmt: skip
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick, "model": name,
           "agents": a, "retries": r}  # fmt: skip
    write_json("memory", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
