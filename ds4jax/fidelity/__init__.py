"""Continuation fidelity: how far stateless replays drift from the sampled live state.

ds4jax continues a tool loop from the state it sampled: the client's `tool_result` selects the
live frontier by tool id and only the tool-result suffix is prefilled. A stateless server
instead re-renders the JSON history the client sends back and prefills that. The two prompts
spell the same conversation but are not the same tokens:

* (a) **hidden reasoning dropped** — a client that does not send the thinking block back;
* (b) **tool JSON re-serialised** — the client replays `tool_use.input` as parsed JSON, so the
  DSML is rendered canonically from it, not replayed byte for byte (number formatting, key
  order, whitespace, unicode escapes, entities);
* (c) **BPE retokenized** — sampled ids are not always the canonical tokenization of their
  text, and a replay only has the text.

This package measures the effect on the model: for seeded conversations it builds the live
trajectory through the real `Engine` (a cold first request whose assistant turn is sampled
reasoning plus a forced DSML call, then the client's tool-result request, which must take the
live tool path), samples a continuation from the live state, and compares next-token
distributions (KL(live‖replay), top-1 agreement) at the first assistant position and at each
teacher-forced continuation position against replays built from what the client sends back,
rendered by the real renderer and tokenizer.

Replay kinds, by the factors they change (`KINDS`): `exact` (the live ids themselves: the
numerical floor), `a`, `b` (token splices of the live ids that isolate one factor each), `c`,
`a+c`, `b+c`, `a+b+c` (full renders of the client's request; `a+b+c` is what a stateless
server sees when the client drops thinking, and a splice `a+b` would be the same ids, since a
canonical DSML block has nothing left to retokenize).

Every replay shares the prompt (system, tools, user turn) token for token, so each one
continues from one prefilled prompt state — what any prefix-caching server would do; a cold
prefill of the whole gives the same logits (chunked prefill = one-shot prefill, to float
rounding with quant_sim off).

The package, by what each module holds: `measures` (KL, top-1 agreement, entropy, shared
prefix), `conversations` (the simulated agent, its tools and clients), `trajectory` (the model
and the live tool loop), `replays` (the replay kinds and one conversation measured),
`study` (`run` over many conversations, the summary table and factor counts), `state_drift`
(how far a bf16 or fp8 decode state moves the distributions from an f32 one, teacher-forced
along demo tool loops: issue 26's fidelity check).
"""

from __future__ import annotations

from ds4jax.fidelity.conversations import (
    CLIENTS,
    SYSTEM,
    TASKS,
    TOOLS,
    client_roundtrip,
    sampled_dsml,
)
from ds4jax.fidelity.measures import (
    common_prefix,
    entropy,
    kl_divergence,
    log_softmax,
    top1_agreement,
)
from ds4jax.fidelity.replays import (
    KIND_LABELS,
    KINDS,
    ConversationResult,
    KindResult,
    build_replays,
    canonical_call_ids,
    measure_conversation,
    replay_logits,
    splice_ids,
)
from ds4jax.fidelity.state_drift import (
    DTYPES,
    Drift,
    demo_loop,
    demo_loops,
    format_drift,
    state_dtype_drift,
    teacher_forced_logits,
)
from ds4jax.fidelity.study import (
    OTHER,
    KindSummary,
    Report,
    conclusions,
    factor_counts,
    format_table,
    run,
    summarize,
)
from ds4jax.fidelity.trajectory import (
    Settings,
    Trajectory,
    emittable,
    live_trajectory,
    load_model,
    sampled_ids,
)

__all__ = [
    "CLIENTS",
    "DTYPES",
    "KINDS",
    "KIND_LABELS",
    "OTHER",
    "SYSTEM",
    "TASKS",
    "TOOLS",
    "ConversationResult",
    "Drift",
    "KindResult",
    "KindSummary",
    "Report",
    "Settings",
    "Trajectory",
    "build_replays",
    "canonical_call_ids",
    "client_roundtrip",
    "common_prefix",
    "conclusions",
    "demo_loop",
    "demo_loops",
    "emittable",
    "entropy",
    "factor_counts",
    "format_drift",
    "format_table",
    "kl_divergence",
    "live_trajectory",
    "load_model",
    "log_softmax",
    "measure_conversation",
    "replay_logits",
    "run",
    "sampled_dsml",
    "sampled_ids",
    "splice_ids",
    "state_dtype_drift",
    "summarize",
    "teacher_forced_logits",
    "top1_agreement",
]
