"""Score the demo model on held-out prompts: `python -m ds4jax.demo.evaluate`.

Each prompt runs the agent loop a client runs against `/v1/messages`, through the engine
the server uses: request 1 (greedy) must produce one parseable call of the right tool with
the right arguments; the client executes it (`corpus.run_tool`) and sends request 2 with
the sampled assistant turn and the tool result, which must continue the live state and
answer with text containing the result.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds4jax.chat.anthropic import parse_messages_request, response_content
from ds4jax.continuation.types import CacheSource
from ds4jax.demo.corpus import Task, held_out_tasks, request_body, run_tool, training_bodies
from ds4jax.engine import Engine, Result

#: Seed of the held-out draw (training uses the seed in the checkpoint's training.json).
HELD_OUT_SEED = 1_000_003


@dataclass
class Outcome:
    task: Task
    call: dict[str, Any] | None  # {"name", "input"} of the single call, when exactly one
    call_ok: bool
    answer: str
    answer_ok: bool
    continued_live: bool
    cache_read: int  # request 2's reused tokens
    first_total: int  # request 1's prompt + output tokens

    @property
    def ok(self) -> bool:
        return self.call_ok and self.answer_ok


def _serve(engine: Engine, body: dict[str, Any]) -> Result:
    req = parse_messages_request(body, max_context=engine.max_len)
    return engine.run(engine.prepare_request(req))


def run_loop(engine: Engine, task: Task, *, thinking: bool = True) -> Outcome:
    body = request_body(task, thinking=thinking, system=None)
    first = _serve(engine, body)
    calls = first.message.tool_calls
    call = {"name": calls[0].name, "input": calls[0].arguments} if len(calls) == 1 else None
    call_ok = call is not None and call["name"] == task.tool and call["input"] == task.args
    answer, answer_ok, live, cache_read = "", False, False, 0
    if call is not None and first.tool_ids:
        try:
            result = run_tool(call["name"], call["input"])
        except (KeyError, ValueError, TypeError) as err:  # a malformed call: report the error
            result = f"Error: {err}"
        back = {"type": "tool_result", "tool_use_id": first.tool_ids[0], "content": result}
        body["messages"] += [
            {"role": "assistant", "content": response_content(first.message, first.tool_ids)},
            {"role": "user", "content": [back]},
        ]
        second = _serve(engine, body)
        answer = second.message.content
        answer_ok = call_ok and result in answer
        live = second.source is CacheSource.LIVE_TOOL
        cache_read = second.cached
    return Outcome(
        task, call, call_ok, answer, answer_ok, live, cache_read,
        first.prompt_tokens + first.output_tokens,
    )  # fmt: skip


def training_prompts(model_dir: Path) -> set[str]:
    """The user prompts the checkpoint was trained on (regenerated from its settings)."""
    settings = json.loads((model_dir / "training.json").read_text())["settings"]
    bodies = training_bodies(settings["examples"], settings["seed"])
    return {b["messages"][0]["content"] for b in bodies}


def main(argv: list[str] | None = None) -> int:
    from ds4jax.demo.train import DEMO_DIR
    from ds4jax.model.checkpoint import load_model, resolve_model_dir

    ap = argparse.ArgumentParser(prog="python -m ds4jax.demo.evaluate", description=__doc__)
    ap.add_argument("--model", default=str(DEMO_DIR))
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--thinking", choices=("on", "off"), default="on")
    args = ap.parse_args(argv)
    cfg, params, tokenizer, _ = load_model(args.model)
    engine = Engine(cfg, params, tokenizer, max_len=1024)
    seen = training_prompts(resolve_model_dir(args.model))
    tasks = held_out_tasks(args.n, HELD_OUT_SEED, seen)
    outcomes = [run_loop(engine, t, thinking=args.thinking == "on") for t in tasks]
    for o in outcomes:
        mark = "ok " if o.ok else "BAD"
        print(f"{mark} {o.task.prompt!r} → {o.call} → {o.answer!r} (live={o.continued_live})")
    calls = sum(o.call_ok for o in outcomes)
    both = sum(o.ok for o in outcomes)
    print(f"right call {calls}/{len(outcomes)}; right call and answer {both}/{len(outcomes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
