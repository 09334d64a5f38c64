"""Time to first token of a Codex-shaped tool turn, by continuation path (issue 15).

The request is what Codex CLI sends on its second turn (`store: false`, the full visible
history every time): a developer message grown to ~N tokens (Codex's base prompt is
~17.5 KB, its tools another ~17 KB), `exec_command`, the user's task, the reasoning item and
`function_call` the server returned (the reasoning sealed in `encrypted_content`), and the
`function_call_output`. It is served three ways on the tiny model, parsed by
`parse_responses_request` as `/v1/responses` parses it:

* live call_id   — the engine just sampled the call; the output's call_id selects it and
  only EOS + the output turn + `<｜Assistant｜><think>` is prefilled;
* visible prefix — the same live state without its call binding, the replay without the
  reasoning item: the session's remembered visible transcript matches;
* cold           — nothing live.

TTFT = prefill + the first decode step (`max_tokens=1`), best of two for the live paths.
The part also counts programs compiled after warm-up (it should stay 0: a live continuation
runs on a state taken out of the batch, which warm-up must have compiled for).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from bench.continuation import _system

PATHS = ("live_call_id", "visible_prefix", "cold")
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output or a session ID.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                   "required": ["cmd"]},
}  # fmt: skip
CALL = (
    'Let me look.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="exec_command">\n'
    '<｜DSML｜parameter name="cmd" string="true">ls -la</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


def measure(engine: Any, tok: Any, n: int) -> dict:
    from ds4jax.chat.responses import parse_responses_request
    from ds4jax.chat.segments import template
    from ds4jax.continuation.reasoning_seal import ReasoningSeal
    from ds4jax.continuation.types import source_label

    seal = ReasoningSeal.fresh()

    def prepared(body: dict, max_tokens: int = 1):
        r = parse_responses_request(body, unseal=seal.open)
        return engine.prepare_request(r.request, max_tokens=max_tokens, api="responses")

    first = {"input": [{"type": "message", "role": "developer", "content": _system(tok, n)},
                       {"type": "message", "role": "user", "content": "list the files"}],
             "tools": [EXEC], "store": False, "reasoning": {"summary": "auto"}}  # fmt: skip
    engine.reset()
    res = engine.run(prepared(first, 200), forced_tokens=tok.encode_segments(template(CALL)))
    live, tool_binding, visible = engine.live, engine.bindings.tool, engine.bindings.thinking
    call_id = res.tool_ids[0]
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "Let me look."}],
        "encrypted_content": seal.seal("Let me look."),
    }
    call = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": call_id,
        "name": "exec_command",
        "arguments": '{"cmd":"ls -la"}',
        "status": "completed",
    }
    output = {"type": "function_call_output", "call_id": call_id, "output": "a.txt\nb.txt\n"}
    full = dict(first, input=[*first["input"], reasoning, call, output])
    without_reasoning = dict(first, input=[*first["input"], call, output])  # fmt: skip

    def live_call_id() -> Any:
        engine.live, engine.bindings.tool, engine.bindings.thinking = live, tool_binding, None
        return prepared(full)

    def visible_prefix() -> Any:
        engine.live, engine.bindings.tool, engine.bindings.thinking = live, None, visible
        return prepared(without_reasoning)

    def cold() -> Any:
        engine.reset()
        return prepared(full)

    row: dict = {}
    for name, setup in (("live_call_id", live_call_id), ("visible_prefix", visible_prefix),
                        ("cold", cold)):  # fmt: skip
        runs = []
        for _ in range(1 if name == "cold" else 2):
            req = setup()
            t = time.perf_counter()
            r = engine.run(req)
            runs.append((time.perf_counter() - t, source_label(r.source, "responses"), r.prefilled))
        seconds, source, prefilled = min(runs)
        row["history_tokens"] = len(req.view.tokens)
        row[name] = {"source": source, "prefilled": prefilled, "ttft_s": round(seconds, 4)}
        print(f"   {name:<15} {seconds:8.3f} s  ({prefilled} tok prefilled, {source})",
              flush=True)  # fmt: skip
    return {"history_tokens": row.pop("history_tokens"), **row}


def main(quick: bool = False) -> dict:
    from bench.disk import use_compile_cache
    from bench.report import write_json
    from ds4jax.chat.tokenizer import V4Tokenizer
    from ds4jax.config import load_config
    from ds4jax.engine import Engine
    from ds4jax.model import batch as mb
    from ds4jax.model.forward import forward_chunk
    from ds4jax.model.params import init_params

    use_compile_cache()
    sizes = [2048] if quick else [20000]
    cfg = load_config("tiny")
    tok = V4Tokenizer()
    engine = Engine(cfg, init_params(cfg, 0), tok, max_len=max(sizes) + 1024)
    t0 = time.perf_counter()
    engine.warm_up()
    print(f"warm-up (compile) {time.perf_counter() - t0:.1f}s", flush=True)

    def compiled() -> int:
        return forward_chunk._cache_size() + mb.step._cache_size()

    before = compiled()
    rows = []
    for n in sizes:
        print(f"-- Codex-shaped history ~{n} tokens", flush=True)
        rows.append(measure(engine, tok, n))
    recompiles = compiled() - before  # a live continuation must reuse warm-up's programs
    print(f"recompiles after warm-up: {recompiles}", flush=True)
    last = rows[-1]
    summary = {f"cold_over_{p}": round(last["cold"]["ttft_s"] / last[p]["ttft_s"], 1)
               for p in ("live_call_id", "visible_prefix")}  # fmt: skip
    print(f"at {last['history_tokens']} tokens: cold/live call_id "
          f"{summary['cold_over_live_call_id']}×, cold/visible prefix "
          f"{summary['cold_over_visible_prefix']}×", flush=True)  # fmt: skip
    out = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick, "rows": rows,
           "summary": summary, "model": "tiny (random weights), CPU",
           "recompiles_after_warmup": recompiles}  # fmt: skip
    write_json("responses", out, quick)
    return out


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
