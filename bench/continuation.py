"""Time to first token of a tool-result turn, by continuation path, vs history length.

For each history length (a system prompt grown to ~N tokens, a teacher-forced tool call,
then the client's tool-result request) the same request is served four ways on the tiny
model:

* live tool ids — the engine just sampled the call (the fast path);
* token prefix  — the live state is the request's own tokens up to the tool result;
* text prefix   — the live tokens spell the history but tokenize differently;
* cold          — nothing live.

Reported: prefilled tokens and TTFT (prefill + the first decode step). The goal: the live path
prefills only the suffix, is flat in history length, and cold/live ≥ 20× at 16k.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
CALL = (
    'Let me look.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def _system(tok, n_tokens: int) -> str:
    words = "the engine keeps the sampled state as the truth and appends only the suffix ".split()
    text, i = [], 0
    while len(tok.encode_text(" ".join(text))) < n_tokens:
        text.extend(words[j % len(words)] for j in range(i, i + 200))
        i += 200
    return " ".join(text)


def main(quick: bool = False) -> dict:
    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.chat.segments import template
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.model.params import init_params

    sizes = [512, 2048] if quick else [1024, 4096, 16384]
    cfg = load_config("tiny")
    tok = V4Tokenizer()
    engine = Engine(cfg, init_params(cfg, 0), tok, max_len=max(sizes) + 1024)
    t0 = time.perf_counter()
    engine.warm_up()
    print(f"warm-up (compile) {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    for n in sizes:
        system = _system(tok, n)
        first = {"system": system, "tools": TOOLS, "messages": [{"role": "user", "content": "go"}]}

        def prepared(body, max_tokens=1, engine=engine):
            req = parse_messages_request(body)
            return engine.prepare(req.conversation, max_tokens=max_tokens, has_tools=True)

        forced = tok.encode_segments(template(CALL))
        engine.reset()
        res1 = engine.run(prepared(first, 200), forced_tokens=forced)
        tid = res1.tool_ids[0]
        follow = dict(
            first,
            messages=[
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": tid,
                            "name": "bash",
                            "input": {"command": "ls -la"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": tid, "content": "a.txt\nb.txt"}
                    ],
                },
            ],
        )
        live_after_call = engine.live
        bindings = engine.bindings.tool
        req = prepared(follow)

        def timed(setup, req=req) -> tuple[str, int, float]:
            setup()
            t = time.perf_counter()
            res = engine.run(req)  # one sampled token: prefill + first decode step
            return res.source.value, res.prefilled, time.perf_counter() - t

        def live_tool(live=live_after_call, binding=bindings):
            engine.live, engine.bindings.tool = live, binding

        def token_prefix(live=live_after_call):
            # the same live tokens without the tool binding: only the token prefix matches
            engine.live, engine.bindings.tool = live, None

        def text_prefix(first=first):
            # the same history text, its first word sampled as two tokens
            engine.reset()
            alt = tok.encode_text("Le") + tok.encode_text("t me look.")
            alt += tok.encode_segments(template(CALL[len("Let me look.") :]))
            engine.run(prepared(first, 200), forced_tokens=alt)
            engine.bindings.tool = None

        def cold():
            engine.reset()

        row = {"history_tokens": len(req.view.tokens)}
        for name, setup in [("live_tool", live_tool), ("token_prefix", token_prefix),
                            ("text_prefix", text_prefix), ("cold", cold)]:  # fmt: skip
            # best of two for the cheap paths (the first call of a size may still compile)
            runs = [timed(setup) for _ in range(1 if name == "cold" else 2)]
            source, prefilled, seconds = min(runs, key=lambda r: r[2])
            row[name] = {"source": source, "prefilled": prefilled, "ttft_s": round(seconds, 4)}
        rows.append(row)
        print(
            f"{row['history_tokens']:>6} tokens  "
            + "  ".join(
                f"{k}: {row[k]['ttft_s']:.3f}s ({row[k]['prefilled']} tok, {row[k]['source']})"
                for k in ("live_tool", "token_prefix", "text_prefix", "cold")
            ),
            flush=True,
        )
    live = [r["live_tool"]["ttft_s"] for r in rows]
    summary = {
        "live_flatness": round(max(live) / min(live), 3),
        "cold_over_live_at_largest": round(
            rows[-1]["cold"]["ttft_s"] / rows[-1]["live_tool"]["ttft_s"], 1
        ),
    }
    largest = rows[-1]["history_tokens"]
    print(
        f"live TTFT max/min over sizes {summary['live_flatness']}×; "
        f"cold/live at {largest} tokens {summary['cold_over_live_at_largest']}×"
    )
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick, "rows": rows,
           "summary": summary, "model": "tiny (random weights), CPU"}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    name = f"continuation-{datetime.now():%Y-%m-%d}{'-quick' if quick else ''}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
