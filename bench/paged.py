"""Retained-state bytes with frontiers kept dense and kept in pages (issue 26), side by side.

Eight agents share one system prompt (a sub-agent's situation), each asks its own ~2k-token
question, then each retries it: the same requests through two engines that differ only in
`paged_pages`, at two contexts. Reported: the bytes the pool counts for its retained states
(`Pool.state_bytes`: a dense state its capacity; paged states their distinct pages plus a
small part each), the pages in use, and whether the replies agreed. Bytes, not seconds: the
figures do not move with the machine's load.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from bench.report import write_json

AGENTS = 8


def _engine(ctx: int, paged: bool) -> Any:
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.kvstore.pages import pages_for
    from ds4jax.model.params import init_params

    cfg = load_config("tiny")
    pages = {"paged_pages": 3 * AGENTS * pages_for(ctx) + 1} if paged else {}
    return Engine(cfg, init_params(cfg, 0), V4Tokenizer(), max_len=ctx, sessions=AGENTS,
                  fork_points=True, max_batch=1, chunk_sizes=(64, 512), **pages)  # fmt: skip


def run(ctx: int, paged: bool, words: int) -> dict[str, Any]:
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.engine import SamplingParams

    engine = _engine(ctx, paged)
    system = "You are one of several agents working on the same repository. " * 30
    replies = []
    for _ in range(2):  # the questions, then their retries
        for i in range(AGENTS):
            question = f"Agent {i}: " + " ".join(f"word{i}_{k}" for k in range(words))
            body = {"system": system, "thinking": {"type": "disabled"},
                    "messages": [{"role": "user", "content": question}]}  # fmt: skip
            req = engine.prepare_request(parse_messages_request(body), max_tokens=4,
                                         sampling=SamplingParams(temperature=0.0))  # fmt: skip
            res = engine.run(req)
            replies.append((res.source.value, res.raw_text, res.prompt_tokens))
    row = {"context": ctx, "paged": paged, "state_bytes": engine.pool.state_bytes(),
           "prompt_tokens": replies[0][2], "frontiers": engine.pool.in_use()
           + len(engine.pool.forks)}  # fmt: skip
    if paged:
        engine.pages._drain()
        row["pages_used"] = engine.pages.pool.used
        row["page_bytes"] = engine.pages.page_nbytes
    return {"row": row, "replies": replies}


def main(quick: bool = False) -> dict[str, Any]:
    words = 150 if quick else 600
    rows, agree = [], []
    for ctx in (2048, 8192) if quick else (4096, 32768):
        dense, paged = run(ctx, False, words), run(ctx, True, words)
        agree.append(dense["replies"] == paged["replies"])
        rows += [dense["row"], paged["row"]]
        d, p = dense["row"]["state_bytes"], paged["row"]["state_bytes"]
        n = dense["row"]["prompt_tokens"]
        print(f"   ctx {ctx}: {AGENTS} agents x ~{n} tokens + retries: dense "
              f"{d / 2**20:.1f} MiB, paged {p / 2**20:.1f} MiB ({d / p:.1f}x), "
              f"{paged['row']['pages_used']} pages; same replies: {agree[-1]}",
              flush=True)  # fmt: skip
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick,
           "rows": rows, "same_replies": all(agree)}  # fmt: skip
    write_json("paged", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
