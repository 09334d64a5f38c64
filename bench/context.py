"""Cost follows the tokens held, not `--ctx` (issue 26): the same ~2k-token conversation
served at `--ctx 8192` and `--ctx 1048576`, states made at the span of their tokens
(`model.state.spans`), beside the engine before spans (every state at the context's
capacity: `span_base=ctx`) at a context it can still run in this part's time, and at 8k
with fp8 states (`Config.state_dtype`: rows rounded to the release's record as made), and
with decode rows in pages (`paged_pages`: the step reads each row's rows through its page
table) at 8k and 1M; then four conversations decoding together (B=4), dense rows against
rows in pages.

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
PAGES = 1024  # the page pool of the paged cases: what they hold, with room
ROUNDS = 3  # B=4 rounds per engine, the median reported (one round is ~100 steps)


def batches(cfg: Any, params: Any, ctx: int, words: int, reply: int) -> list[dict[str, Any]]:
    """Aggregate decode tokens/s of four conversations decoding together (B=4), dense rows
    against rows in pages: tokens the steps made once all four rows were active, over the
    wall time of those steps. Both engines are built first and their rounds alternate
    (dense, paged, dense, …), so what the process went through before touches both alike;
    the median of `ROUNDS` rounds each (a round alone moves by 20% here)."""
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.engine import Engine, SamplingParams

    def make(paged: bool) -> Any:
        pool = {"paged_pages": PAGES} if paged else {}
        engine = Engine(cfg, params, V4Tokenizer(), max_len=ctx, sessions=4, max_batch=4,
                        chunk_sizes=(64, 512), **pool)  # fmt: skip
        engine.warm_up()
        return engine

    def round_(engine: Any) -> tuple[float, int]:
        engine.reset()
        for q in range(4):
            question = " ".join(f"w{q}x{j}" for j in range(words))
            body = {"thinking": {"type": "disabled"},
                    "messages": [{"role": "user", "content": question}]}  # fmt: skip
            greedy = SamplingParams(temperature=0.0)
            req = parse_messages_request(body)
            engine.submit(engine.prepare_request(req, max_tokens=reply, sampling=greedy))
        tokens, t0 = 0, None
        while engine.busy:
            active = engine.rows_active
            if active == 4 and t0 is None and not engine._prefilling:
                t0 = time.perf_counter()
            engine.tick()
            if t0 is not None:
                tokens += active
        return tokens / (time.perf_counter() - t0), tokens

    engines = {False: make(False), True: make(True)}
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens = 0
    for k in range(ROUNDS + 1):  # the first round compiles what warm-up did not
        for paged, engine in engines.items():
            rate, tokens = round_(engine)
            if k:
                rates[paged].append(rate)
    return [{"context": ctx, "paged_rows": paged, "rows": 4, "tokens": tokens,
             "rounds_tok_s": [round(r, 2) for r in rs],
             "aggregate_decode_tok_s": round(sorted(rs)[len(rs) // 2], 2)}
            for paged, rs in rates.items()]  # fmt: skip


def run(cfg: Any, params: Any, ctx: int, words: int, reply: int, before: bool,
        dtype: str = "f32", paged: bool = False) -> dict[str, Any]:  # fmt: skip
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.engine import Engine, SamplingParams
    from ds4jax.model.state import holds

    kw: dict[str, Any] = {"span_base": ctx} if before else {}
    if paged:
        kw["paged_pages"] = PAGES
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
    span = (engine.spans[0] if paged else  # a paged frontier has no capacity: its pages
            next(s for s in engine.spans if holds(cfg, state, s)))  # fmt: skip
    return {
        "context": ctx, "spans": not before, "state_dtype": dtype, "paged_rows": paged,
        "warm_up_s": round(warm, 2),
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
    rows += [run(cfg, params, c, words, reply, False, "f32", paged=True) for c in (8192, 1 << 20)]
    first = rows[0]["text"]
    for r in rows:
        r["same_reply"] = r.pop("text") == first
        print(f"   {name} ctx {r['context']:>7} {'spans ' if r['spans'] else 'before'} "
              f"{r['state_dtype']}{' paged rows' if r['paged_rows'] else ''}: "
              f"prompt {r['prompt_tokens']} tokens at {r['prefill_tok_s']} tok/s, decode "
              f"{r['decode_tok_s']} tok/s, state span {r['state_span']} "
              f"({r['state_bytes'] / 2**20:.1f} MiB), warm-up {r['warm_up_s']} s, "
              f"same reply: {r['same_reply']}", flush=True)  # fmt: skip
    ratio = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
    print(f"   decode at ctx 1M / ctx 8k: {ratio:.2f}", flush=True)
    paged = rows[-2]["decode_tok_s"] / rows[0]["decode_tok_s"]
    print(f"   decode, rows in pages / dense rows at ctx 8k: {paged:.2f}", flush=True)
    b4 = batches(cfg, params, 8192, words // 2, 4 * reply)
    for b in b4:
        print(
            f"   {name} B=4 {'paged' if b['paged_rows'] else 'dense'} rows: "
            f"{b['aggregate_decode_tok_s']} tok/s in all",
            flush=True,
        )
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick, "model": name,
           "rows": rows, "batches": b4, "decode_1m_over_8k": round(ratio, 3),
           "decode_paged_over_dense_8k": round(paged, 3)}  # fmt: skip
    write_json("context", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
