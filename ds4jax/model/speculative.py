"""Greedy speculative decoding with the model's own MTP block (issue 29), one sequence.

Each step verifies the pending token and one draft as a 2-token chunk, keeps the draft
when the model's argmax at the pending token's position agrees, and steps a rejected
draft's position back by the state's length (`state.rewind`) — never by replaying. The MTP
block then runs over the positions the step verified, with the token after each: that
extends its own window state and gives the next draft from the last one, so its state
never holds a rejected position and needs no rewind of its own. The token stream is plain
greedy decoding's whatever the drafts are, since a 2-token chunk computes the logits of two
one-token steps (prefill = decode, `tests/model/test_prefill_decode.py`).

Not yet here (issue 29's rest): batched rows, the engine and its APIs, sampling
(rejection sampling), the gate by load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.model.forward import CHUNK_SIZES, forward_chunk, mtp_chunk, plan_chunks
from ds4jax.model.params import Params
from ds4jax.model.state import DecodeState, init_state, rewind


@partial(jax.jit, static_argnames=("cfg",))
def verify(
    params: Params, state: DecodeState, token: jax.Array, draft: jax.Array, *, cfg: Config
) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
    """`token` (the pending one, at n = `state.pos`) and `draft` (at n + 1) evaluated as
    one chunk. Returns (the state after what it kept, the tokens it decided [2] of which
    the first `count` are real, count — 2 when the draft was the model's choice — and the
    chunk's streams [2, hc, D])."""
    n = state.pos
    new, logits, X = forward_chunk(params, state, jnp.stack([token, draft]), 2, cfg=cfg,
                                   all_logits=True, streams=True)  # fmt: skip
    a, b = jnp.argmax(logits[0]).astype(jnp.int32), jnp.argmax(logits[1]).astype(jnp.int32)
    ok = a == draft
    count = jnp.where(ok, 2, 1).astype(jnp.int32)
    # rejected: back to n + 1, whose next-token logits the chunk's first position gave
    state = rewind(new, n + count, jnp.where(ok, logits[1], logits[0]).astype(jnp.float32))
    return state, jnp.stack([a, b]), count, X


@partial(jax.jit, static_argnames=("cfg",))
def next_draft(params: Params, mtp: Any, X: jax.Array, decided: jax.Array, n: jax.Array,
               count: jax.Array, *, cfg: Config) -> tuple[Any, jax.Array]:  # fmt: skip
    """The MTP block over the `count` positions a step kept (from `n`, each with the token
    after it): (its window state, its draft for the position after them)."""
    mlog, _, mtp = mtp_chunk(params, X, decided, mtp, n, count, cfg=cfg)
    return mtp, jnp.argmax(mlog[count - 1]).astype(jnp.int32)


def spec_step(
    params: Params, state: DecodeState, mtp: Any, token: jax.Array, draft: jax.Array, *,
    cfg: Config,
) -> tuple[DecodeState, Any, jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """One step: `verify`, then `next_draft` (two programs: as one, XLA:CPU ran the pair
    5× slower than apart — 180 against 36 ms on bench-192m, measured). Returns (state,
    MTP state, decided tokens [2], count, the next draft)."""
    n = state.pos
    state, decided, count, X = verify(params, state, token, draft, cfg=cfg)
    mtp, nxt = next_draft(params, mtp, X, decided, n, count, cfg=cfg)
    return state, mtp, decided, count, nxt


@dataclass
class SpecRun:
    """A speculative run's tokens and what its drafts did."""

    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


def generate_greedy(
    params: Params, cfg: Config, prompt: Sequence[int], n: int, max_len: int, *,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    propose: Callable[[int, int], int] | None = None,
) -> SpecRun:  # fmt: skip
    """`n` greedy tokens after `prompt` by speculative steps. The prompt is prefilled
    with its streams kept, and the MTP block runs over it (each position with the token
    after it, the last with the first sampled one) to make the first draft. `propose`
    (tests): `propose(position, mtp_draft)` replaces a draft, to force accepts and
    rejections where wanted."""
    toks = np.asarray(prompt, np.int32)
    state = init_state(cfg, max_len)
    streams = []
    for size, valid in plan_chunks(len(toks), chunk_sizes):
        done = sum(len(x) for x in streams)
        chunk = np.zeros(size, np.int32)
        chunk[:valid] = toks[done : done + valid]
        state, _, X = forward_chunk(params, state, chunk, valid, cfg=cfg, streams=True)
        streams.append(X[:valid])
    H = jnp.concatenate(streams)
    token = int(jnp.argmax(state.logits))
    after = np.append(toks[1:], token).astype(np.int32)  # the token after each position
    mtp = init_state(cfg.mtp_block(), max_len).layers[0]
    done = 0
    for size, valid in plan_chunks(len(toks), chunk_sizes):
        h = jnp.zeros((size, *H.shape[1:]), H.dtype).at[:valid].set(H[done : done + valid])
        t = np.zeros(size, np.int32)
        t[:valid] = after[done : done + valid]
        mlog, _, mtp = mtp_chunk(params, h, t, mtp, done, valid, cfg=cfg)
        done += valid
    draft = int(jnp.argmax(mlog[valid - 1]))
    run = SpecRun(tokens=[token])
    while len(run.tokens) < n:
        pos = int(state.pos) + 1  # the draft's position
        if propose is not None:
            draft = propose(pos, draft)
        state, mtp, decided, count, nxt = spec_step(params, state, mtp, np.int32(token),
                                                    np.int32(draft), cfg=cfg)  # fmt: skip
        c = int(count)
        run.steps += 1
        run.accepted += c == 2
        run.tokens += [int(x) for x in np.asarray(decided)[:c]]
        token, draft = run.tokens[-1], int(nxt)
    run.tokens = run.tokens[:n]
    return run
