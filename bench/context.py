"""Cost follows the tokens held, not `--ctx` (issue 26): the same ~2k-token conversation
served at `--ctx 8192` and `--ctx 1048576`, states made at the span of their tokens
(`model.state.spans`), beside the engine before spans (every state at the context's
capacity: `span_base=ctx`) at a context it can still run in this part's time, and at 8k
with fp8 states (`Config.state_dtype`: rows rounded to the release's record as made).

Per case: prompt prefill tokens/s, decode tokens/s of the greedy reply (the batched step,
one row), the bytes of the retained states (`Pool.state_bytes`), the capacity (span) of
the session's state, and whether the reply equals the ctx-8k one. Figures are wall-clock on
this machine, all cases in one run; the ratio to read is ctx 1M / ctx 8k decode.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from bench.report import write_json

MODEL = "bench-192m"


def run(cfg: Any, params: Any, ctx: int, words: int, reply: int, before: bool,
        dtype: str = "f32") -> dict[str, Any]:  # fmt: skip
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.engine import Engine, SamplingParams
    from ds4jax.model.state import holds

    kw = {"span_base": ctx} if before else {}
    cfg = cfg.replace(state_dtype=dtype)
    engine = Engine(cfg, params, V4Tokenizer(), max_len=ctx, sessions=1, max_batch=1,
                    chunk_sizes=(64, 512), **kw)  # fmt: skip
    t0 = time.perf_counter()
    engine.warm_up()
    warm = time.perf_counter() - t0
    question = " ".join(f"word{k}" for k in range(words))
    body = {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": question}]}
    runs = []
    for _ in range(2):  # the first run compiles what warm-up did not (a longer span)
        engine.reset()
        req = engine.prepare_request(parse_messages_request(body), max_tokens=reply,
                                     sampling=SamplingParams(temperature=0.0))  # fmt: skip
        t = time.perf_counter()
        res = engine.run(req)
        runs.append((res, time.perf_counter() - t))
    res, wall = runs[-1]
    decode_s = wall - res.prefill_seconds
    state = engine.pool.sessions[res.session].live.state
    span = next(s for s in engine.spans if holds(cfg, state, s))
    return {
        "context": ctx, "spans": not before, "state_dtype": dtype, "warm_up_s": round(warm, 2),
        "prompt_tokens": res.prompt_tokens, "output_tokens": res.output_tokens,
        "prefill_tok_s": round(res.prefilled / res.prefill_seconds, 1),
        "decode_tok_s": round(res.output_tokens / decode_s, 2),
        "state_span": span, "state_bytes": engine.pool.state_bytes(), "text": res.raw_text,
    }  # fmt: skip


def main(quick: bool = False) -> dict[str, Any]:
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params

    name = "tiny" if quick else MODEL
    cfg = load_config(name)
    params = init_params(cfg, 0)
    words, reply = (300, 8) if quick else (700, 32)
    cases = [(8192, False, "f32"), (1 << 20, False, "f32"), (8192 if quick else 32768, True, "f32"),
             (8192, False, "fp8")]  # fmt: skip
    rows = [run(cfg, params, ctx, words, reply, before, d) for ctx, before, d in cases]
    first = rows[0]["text"]
    for r in rows:
        r["same_reply"] = r.pop("text") == first
        print(f"   {name} ctx {r['context']:>7} {'spans ' if r['spans'] else 'before'} "
              f"{r['state_dtype']}: "
              f"prompt {r['prompt_tokens']} tokens at {r['prefill_tok_s']} tok/s, decode "
              f"{r['decode_tok_s']} tok/s, state span {r['state_span']} "
              f"({r['state_bytes'] / 2**20:.1f} MiB), warm-up {r['warm_up_s']} s, "
              f"same reply: {r['same_reply']}", flush=True)  # fmt: skip
    ratio = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
    print(f"   decode at ctx 1M / ctx 8k: {ratio:.2f}", flush=True)
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick, "model": name,
           "rows": rows, "decode_1m_over_8k": round(ratio, 3)}  # fmt: skip
    write_json("context", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
