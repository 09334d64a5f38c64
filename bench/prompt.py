"""Prompt path: rendering a Claude-Code-sized request (≈ 6k characters of system text, 24
tools) and tokenizing it through segments (special tokens from the template only) versus
the official pipeline's single `encode` of the joined string."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.render import render
from ds4jax.chat.segments import join
from ds4jax.chat.tokenizer import V4Tokenizer


def claude_code_like_request(turns: int = 20) -> dict:
    words = "read the file then search for the symbol and edit the function carefully ".split()
    system = " ".join(words[i % len(words)] for i in range(900))
    tools = [
        {
            "name": f"Tool{i}",
            "description": " ".join(words[(i + j) % len(words)] for j in range(300)),
            "input_schema": {
                "type": "object",
                "properties": {
                    f"arg{k}": {"type": "string", "description": "a parameter " * 10}
                    for k in range(6)
                },
                "required": ["arg0"],
            },
        }
        for i in range(24)
    ]
    messages: list[dict] = [{"role": "user", "content": "Fix the failing test in utils.py"}]
    for t in range(turns):
        tid = f"toolu_{t:032x}"
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should look at the code. " * 20},
                    {"type": "tool_use", "id": tid, "name": "Tool1", "input": {"arg0": f"f{t}"}},
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tid, "content": "line of code\n" * 80}
                ],
            }
        )
    return {"system": system, "tools": tools, "messages": messages, "max_tokens": 32000}


def best_of(fn: Callable[[], object], repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) if len(times) < 3 else statistics.median(sorted(times)[: repeat // 2 + 1])


def main(quick: bool = False) -> dict:
    tok = V4Tokenizer()
    body = claude_code_like_request()
    raw = json.dumps(body)
    segs = render(parse_messages_request(json.loads(raw)).conversation)
    text = join(segs)
    ids = tok.encode_segments(segs)
    assert ids == tok.encode_official(text), "segment path must equal the official ids here"
    repeat = 3 if quick else 7
    t_parse = best_of(lambda: render(parse_messages_request(json.loads(raw)).conversation), repeat)
    t_seg = best_of(lambda: tok.encode_segments(segs), repeat)
    t_off = best_of(lambda: tok.encode_official(text), repeat)
    print(f"request: {len(raw):,} JSON bytes -> {len(text):,} prompt chars, {len(ids):,} tokens")
    print(f"parse+render        {t_parse * 1e3:8.2f} ms")
    print(
        f"tokenize (segments) {t_seg * 1e3:8.2f} ms  {len(ids) / t_seg:12,.0f} tok/s  "
        f"(official single encode {t_off * 1e3:.2f} ms, ratio {t_seg / t_off:.2f}x)",
        flush=True,
    )
    return {
        "json_bytes": len(raw),
        "prompt_chars": len(text),
        "tokens": len(ids),
        "parse_render_s": t_parse,
        "tokenize_segments_s": t_seg,
        "tokenize_official_s": t_off,
    }


if __name__ == "__main__":
    main()
