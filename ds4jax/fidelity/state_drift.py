"""State-dtype drift (issue 26): how far holding the decode state in bf16 or fp8
(`Config.state_dtype`) moves the model's next-token distributions from an f32 state, along
demo tool loops.

Why teacher-forced: both states read the same tokens, so every difference is the state's
rounding, not a different sampled path that would compound it. The same params and forward
serve both; only `state_dtype` is replaced in the config, so each KV row is rounded as it is
made, as the engine's states of that dtype are.

Why the demo corpus's tool loops (`demo_loop`): they are the conversations the demo model
was trained to serve — a user turn, the assistant's reasoning and DSML calls, the tool
results, the answer that quotes them, a follow-up round — rendered as the live state
evaluates them (a conversation with tools keeps its reasoning). On the trained model greedy
decoding reproduces them (`forced_top1`, the f32 argmax = the forced token at the assistant's
positions, says how closely), so they stand for its own loops and cost no sampling. The
measures are `measures.kl_divergence` and `measures.top1_agreement`, over every position and
over the assistant's (the predictions a server samples from; the user's text and the tool
results are the client's, not the model's to predict).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ds4jax.chat.render import render
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.demo.corpus import Task, held_out_tasks, request_body, round_turns
from ds4jax.demo.evaluate import HELD_OUT_SEED
from ds4jax.demo.train import assistant_mask, finished_conversation
from ds4jax.engine import Engine
from ds4jax.fidelity.measures import kl_divergence, top1_agreement
from ds4jax.model.forward import prefill
from ds4jax.model.state import init_state, span_for

#: The state dtypes compared with f32.
DTYPES: tuple[str, ...] = ("bf16", "fp8")
#: The demo's kinds of task that make tool calls: the loops compared.
LOOP_KINDS: tuple[str, ...] = ("single", "parallel", "followup")
#: Rows of logits compared at a time: bounds the float64 temporaries on a large vocabulary.
_BLOCK = 64


def demo_loop(tok: Tokenizer, task: Task, *, thinking: bool = True) -> tuple[list[int], np.ndarray]:
    """(ids, assistant mask) of a demo task's whole tool loop as the client holds it at the
    end: every round's calls, their results and the answer (`corpus.round_turns`), rendered
    with the server's renderer as a finished conversation (the last EOS included)."""
    body = request_body(task, thinking=thinking, system=None)
    for k, rnd in enumerate(task.rounds):
        if k:
            body["messages"].append({"role": "user", "content": rnd.prompt})
        ids = [f"toolu_{k:02d}{i:030d}" for i in range(len(rnd.calls))]
        body["messages"] += round_turns(rnd, thinking=thinking, tool_ids=ids)
    ids = tok.encode_segments(render(finished_conversation(body)))
    return ids, assistant_mask(ids, tok).astype(bool)


def demo_loops(
    tok: Tokenizer,
    n: int,
    *,
    kinds: Sequence[str] = LOOP_KINDS,
    seed: int = HELD_OUT_SEED,
    thinking: bool = True,
) -> list[tuple[list[int], np.ndarray]]:
    """`demo_loop` of `n` held-out tasks of each of `kinds`: the evaluation's own draw
    (`demo.evaluate`), so the drift is measured on the conversations the scores are."""
    return [
        demo_loop(tok, task, thinking=thinking)
        for kind in kinds
        for task in held_out_tasks(n, seed, kind)
    ]


def teacher_forced_logits(
    engine: Engine, ids: Sequence[int], state_dtype: str, *, chunk: int = 64
) -> np.ndarray:
    """Next-token logits [len(ids), vocab] after each of `ids`, from an empty state of
    `state_dtype` with the engine's params and forward. The state has the capacity the
    engine gives that many tokens (its span) and is prefilled in chunks of one size, so a
    dtype compiles one program for loops of any length up to the span (chunked prefill is
    one-shot prefill to float rounding)."""
    cfg = engine.cfg.replace(state_dtype=state_dtype)
    state = init_state(cfg, span_for(engine.spans, len(ids)))
    _, logits = prefill(engine.params, state, list(ids), cfg, chunk_sizes=(chunk,), all_logits=True)
    return np.asarray(logits)


@dataclass(frozen=True)
class Drift:
    """One state dtype against f32, per position of the loops compared (position i: the
    prediction of token i + 1)."""

    dtype: str
    loops: int
    tokens: int  # the loops' tokens
    kl: np.ndarray  # [positions] KL(f32 ‖ dtype), nats
    top1: np.ndarray  # [positions] same argmax
    assistant: np.ndarray  # [positions] the next token is the assistant's
    forced_top1: np.ndarray  # [positions] the f32 argmax is the forced next token

    def summary(self, *, assistant: bool = True) -> dict[str, float]:
        """KL mean / max and top-1 agreement over the assistant's positions (or all)."""
        at = self.assistant if assistant else np.ones_like(self.assistant)
        kl = self.kl[at]
        return {
            "positions": int(at.sum()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "top1": float(self.top1[at].mean()),
            "forced_top1": float(self.forced_top1[at].mean()),
        }


def state_dtype_drift(
    engine: Engine,
    loops: Sequence[tuple[Sequence[int], np.ndarray]],
    dtypes: Sequence[str] = DTYPES,
    *,
    chunk: int = 64,
) -> dict[str, Drift]:
    """Each of `dtypes` against f32 along `loops` ((ids, assistant mask), e.g. `demo_loops`),
    every loop teacher-forced from an empty state (`teacher_forced_logits`); positions pooled
    over the loops. "f32" among `dtypes` is the control: a second f32 pass, identical to the
    first."""
    ref = [teacher_forced_logits(engine, ids, "f32", chunk=chunk) for ids, _ in loops]
    nexts = [np.asarray(ids[1:]) for ids, _ in loops]
    forced = np.concatenate([lg[:-1].argmax(-1) == n for lg, n in zip(ref, nexts, strict=True)])
    assistant = np.concatenate([np.asarray(mask[1:], bool) for _, mask in loops])
    tokens = sum(len(ids) for ids, _ in loops)
    out = {}
    for dtype in dtypes:
        kls, tops = [], []
        for (ids, _), p in zip(loops, ref, strict=True):
            q = teacher_forced_logits(engine, ids, dtype, chunk=chunk)
            for s in range(0, len(ids) - 1, _BLOCK):
                e = min(s + _BLOCK, len(ids) - 1)
                kls.append(kl_divergence(p[s:e], q[s:e]))
                tops.append(top1_agreement(p[s:e], q[s:e]))
        out[dtype] = Drift(
            dtype=dtype, loops=len(loops), tokens=tokens, kl=np.concatenate(kls),
            top1=np.concatenate(tops), assistant=assistant, forced_top1=forced,
        )  # fmt: skip
    return out


def format_drift(drifts: dict[str, Drift]) -> str:
    """A plain-text table of `state_dtype_drift`: per dtype, the assistant's positions and
    all positions."""
    head = f"{'state':<6} {'positions':<10} {'n':>6} {'KL mean':>10} {'KL max':>10} {'top-1':>7}"
    lines = [head, "-" * len(head)]
    for d in drifts.values():
        for name, assistant in (("assistant", True), ("all", False)):
            s = d.summary(assistant=assistant)
            lines.append(
                f"{d.dtype:<6} {name:<10} {s['positions']:>6} {s['kl_mean']:>10.3g} "
                f"{s['kl_max']:>10.3g} {s['top1']:>7.2%}"
            )
    d = next(iter(drifts.values()), None)
    if d is not None:
        s = d.summary()
        lines.append(
            f"\n{d.loops} loops, {d.tokens} tokens; the f32 argmax is the loop's own next token "
            f"at {s['forced_top1']:.2%} of the assistant's positions"
        )
    return "\n".join(lines)
