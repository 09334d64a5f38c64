"""The stateless side: the replay kinds (`KINDS`), each built from a live trajectory as the
client would send it back (`build_replays`), their logits continued from the shared prompt
state, and one conversation measured against its live state (`measure_conversation`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.dsml_render import render_tool_calls
from ds4jax.chat.render import render
from ds4jax.chat.segments import template
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.continuation.evidence import attach_tool_memory
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.continuation.types import CacheSource
from ds4jax.engine import Engine
from ds4jax.fidelity.measures import common_prefix, entropy, kl_divergence, top1_agreement
from ds4jax.fidelity.trajectory import Settings, Trajectory, live_trajectory
from ds4jax.model.forward import prefill
from ds4jax.model.state import DecodeState

#: Replay kinds, by the factors they change: a = reasoning dropped, b = tool JSON re-serialised,
#: c = BPE retokenized.
KINDS: tuple[str, ...] = ("exact", "a", "b", "c", "a+c", "b+c", "a+b+c")
KIND_LABELS: dict[str, str] = {
    "exact": "live ids replayed (control: numerics only)",
    "a": "hidden reasoning dropped (sampled ids kept)",
    "b": "tool JSON re-serialised (sampled ids kept)",
    "c": "same text, BPE retokenized (ds4jax fallback, client keeps thinking)",
    "a+c": "reasoning dropped, exact DSML bytes (ds4jax fallback, client drops thinking)",
    "b+c": "stateless server, client keeps thinking",
    "a+b+c": "stateless server, client drops thinking",
}


@dataclass
class KindResult:
    kind: str
    ids: tuple[int, ...]
    shared_prefix: int
    kl: np.ndarray  # [positions + 1]
    top1: np.ndarray  # [positions + 1] bool


@dataclass
class ConversationResult:
    trajectory: Trajectory
    kinds: dict[str, KindResult]
    live_entropy: float  # at the first assistant position, nats
    #: Whether the client's JSON, rendered canonically, differs from the sampled DSML bytes.
    dsml_changed: bool
    #: Whether the sampled reasoning / DSML ids differ from the canonical tokenization of
    #: their text.
    reasoning_noncanonical: bool
    dsml_noncanonical: bool
    #: The live next-token logits at the first assistant position (for the reference row).
    first_logits: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))


def _render_ids(tok: Tokenizer, body: dict[str, Any], memory: ToolMemory | None) -> tuple[int, ...]:
    """The client's request rendered and tokenized as a stateless server would; with
    `memory`, the sampled DSML bytes are replayed by tool id (ds4jax's tool memory)."""
    conv = parse_messages_request(body).conversation
    if memory is not None and not attach_tool_memory(conv, memory.block_for):
        raise RuntimeError("tool memory did not cover the replayed call")
    return tuple(tok.encode_segments(render(conv)))


def _without_thinking(body: dict[str, Any]) -> dict[str, Any]:
    messages = []
    for m in body["messages"]:
        if m["role"] == "assistant" and isinstance(m["content"], list):
            m = dict(m, content=[b for b in m["content"] if b["type"] != "thinking"])
        messages.append(m)
    return dict(body, messages=messages)


def splice_ids(
    traj: Trajectory, *, reasoning: bool = True, call: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The live ids with the reasoning removed (`reasoning=False`) and/or the sampled DSML ids
    replaced by `call` (ids of the DSML block, without `</think>`). The cuts sit at template
    specials (`<think>`, `</think>`, EOS) and the tokenizer never merges across a special,
    so a splice is what the renderer gives for that text where the rest keeps its sampled
    ids: one factor changed, the others held."""
    p, r = len(traj.prompt_ids), len(traj.reasoning_ids)
    live = traj.live_ids
    end = p + r + len(traj.call_ids)
    think_end, block = live[p + r : p + r + 1], live[p + r + 1 : end]
    return (
        live[:p]
        + (live[p : p + r] if reasoning else ())
        + think_end
        + (tuple(call) if call is not None else block)
        + live[end:]
    )


def canonical_call_ids(tok: Tokenizer, traj: Trajectory) -> tuple[int, ...]:
    """The DSML block a stateless server renders from the client's `tool_use` JSON."""
    conv = parse_messages_request(traj.client_body).conversation
    calls = next(m for m in conv.messages if m.tool_calls).tool_calls
    return tuple(tok.encode_segments(render_tool_calls(calls)))


def build_replays(engine: Engine, traj: Trajectory) -> dict[str, tuple[int, ...]]:
    """The prompt of the tool-result turn for every kind in `KINDS`: `exact` the live ids,
    `a` and `b` splices of them (`splice_ids`), the `…c` kinds full renders of the client's
    request by the real renderer and tokenizer (with the sampled DSML bytes replayed by tool
    id where the kind keeps them, as ds4jax's tool memory does)."""
    tok = engine.tokenizer
    memory = ToolMemory()
    memory.remember(_tool_use_ids(traj.client_body), traj.raw_dsml)
    body, dropped = traj.client_body, _without_thinking(traj.client_body)
    return {
        "exact": traj.live_ids,
        "a": splice_ids(traj, reasoning=False),
        "b": splice_ids(traj, call=canonical_call_ids(tok, traj)),
        "c": _render_ids(tok, body, memory),
        "a+c": _render_ids(tok, dropped, memory),
        "b+c": _render_ids(tok, body, None),
        "a+b+c": _render_ids(tok, dropped, None),
    }


def _tool_use_ids(body: dict[str, Any]) -> list[str]:
    return [
        b["id"]
        for m in body["messages"]
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_use"
    ]


def replay_logits(
    engine: Engine,
    prompt_state: DecodeState,
    prompt_len: int,
    ids: Sequence[int],
    continuation: Sequence[int],
) -> np.ndarray:
    """Next-token logits [len(continuation) + 1, vocab] of a replay: after its prompt, then
    after each teacher-forced continuation token. Continues the shared prompt state."""
    state, _ = prefill(
        engine.params, prompt_state, list(ids[prompt_len:]), engine.cfg,
        chunk_sizes=engine.chunk_sizes,
    )  # fmt: skip
    out = [np.asarray(state.logits)[None]]
    if continuation:
        _, rest = prefill(
            engine.params, state, list(continuation), engine.cfg,
            chunk_sizes=engine.chunk_sizes, all_logits=True,
        )  # fmt: skip
        out.append(np.asarray(rest))
    return np.concatenate(out)


def measure_conversation(engine: Engine, index: int, settings: Settings) -> ConversationResult:
    """One conversation: the live trajectory, every replay kind, and their comparison."""
    traj, prompt_state, live_logits = live_trajectory(engine, index, settings)
    if traj.source != CacheSource.LIVE_TOOL:
        raise RuntimeError(f"conversation {index}: the tool result took {traj.source.value}")
    replays = build_replays(engine, traj)
    p = len(traj.prompt_ids)
    kinds: dict[str, KindResult] = {}
    for kind, ids in replays.items():
        if ids[:p] != traj.prompt_ids:
            raise RuntimeError(f"conversation {index}: replay {kind} does not share the prompt")
        logits = replay_logits(engine, prompt_state, p, ids, traj.continuation)
        kinds[kind] = KindResult(
            kind=kind,
            ids=ids,
            shared_prefix=common_prefix(ids, traj.live_ids),
            kl=kl_divergence(live_logits, logits),
            top1=top1_agreement(live_logits, logits),
        )
    tok = engine.tokenizer
    return ConversationResult(
        trajectory=traj,
        kinds=kinds,
        live_entropy=float(entropy(live_logits[0])),
        dsml_changed=tok.decode(replays["b"]) != tok.decode(replays["exact"]),
        reasoning_noncanonical=list(traj.reasoning_ids)
        != tok.encode_text(tok.decode(traj.reasoning_ids)),
        dsml_noncanonical=list(traj.call_ids)
        != tok.encode_segments(template(tok.decode(traj.call_ids))),
        first_logits=live_logits[0],
    )
