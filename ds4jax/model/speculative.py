"""Greedy speculative decoding with the model's own MTP block (issue 29), one sequence.

Each step verifies the pending token and one draft as a 2-token chunk, keeps the draft
when the model's argmax at the pending token's position agrees, and steps a rejected
draft's position back by the state's length (`state.rewind`) — never by replaying. The MTP
block then runs over the positions the step verified, with the token after each: that
extends its own window state and gives the next draft from the last one, so its state
never holds a rejected position and needs no rewind of its own. The token stream is plain
greedy decoding's whatever the drafts are, since a 2-token chunk computes the logits of two
one-token steps (prefill = decode, `tests/model/test_prefill_decode.py`).

Batched rows (`verify_rows`, `draft_rows`), what the engine runs (`ds4jax.speculation`):
the host's decoder runs one token ahead of the device. A row enters a step with its next
token `first` already decided (sampled by the step before, or forced), and `second`, the
token after it: the MTP block's draft, a forced token, or none. The step evaluates both
as a 2-token chunk per row; a forced second is kept, a draft is kept with the probability
the row's sampler gives it (`sampling.prob_rows`: 1 or 0 for a greedy row) — rejection
sampling with a point-mass draft, whose residual distribution is the row's own without
the draft, so the token drawn after a rejection bans it (`sample_rows(ban=)`) and every
token is distributed exactly as plain decoding's. The step also draws the token after
what it kept (`y`), so a step decides one or two tokens. Then, once the host knows the
token after each evaluated position (it may force another than `y`), `draft_rows` runs
the MTP block over those positions, which gives the next step's drafts.
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
from ds4jax.model import page_io
from ds4jax.model.batch import forward_rows_chunks, put_rows, row_attention
from ds4jax.model.forward import (
    CHUNK_SIZES,
    forward_chunk,
    mtp_chunk,
    mtp_forward,
    plan_chunks,
    prefill,
)
from ds4jax.model.params import Params
from ds4jax.model.state import DecodeState, init_state, rewind
from ds4jax.sampling import argmax, prob_rows, sample_rows


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
    state, _, H = prefill(params, init_state(cfg, max_len), toks, cfg, chunk_sizes=chunk_sizes,
                          streams=True)  # fmt: skip
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


#: a speculative step's per-row arguments after the batch: first [size] int32 (each row's
#: next token, or −1 to sample it here), second [size] int32 (a forced token after it, or
#: −1: none), drafts [rows] int32 (`draft_rows`' drafts, −1: none), use_draft [size] bool
#: (the row's draft goes after its next token instead), key data [size, 2] uint32, the
#: sampling arrays (temperature, top_k, top_p, min_p) and the EOS id
Verify = tuple[jax.Array, ...]


def _verify(params: Params, rows: DecodeState, first: jax.Array, second: jax.Array,
            drafts: jax.Array, use_draft: jax.Array, key_data: jax.Array,
            temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
            eos_id: jax.Array, cfg: Config) -> tuple[DecodeState, Verify]:  # fmt: skip
    """The step on dense rows, whatever holds them (a dense batch, or pages read through
    the rows' tables). Returns (the rows after it, (`first` as evaluated — sampled where it
    was −1 —, the second token or −1, whether it was kept, the token drawn after what was
    kept, next key data, the streams of the two positions [size, 2, hc, D]))."""
    size = first.shape[0]
    forced = second >= 0
    second = jnp.where(use_draft, drafts[:size], second)
    split = jax.vmap(lambda k: jax.random.split(k, 4))(jax.random.wrap_key_data(key_data))
    keys, k_first, k_test, k_next = (split[:, i] for i in range(4))
    sampling = (temperature, top_k, top_p, min_p)
    t = jnp.where(first >= 0, first, sample_rows(rows.logits, k_first, *sampling))
    t = t.astype(jnp.int32)
    has_x = second >= 0
    x = jnp.maximum(second, 0).astype(jnp.int32)
    live = t != eos_id
    eval_x = has_x & live & (x != eos_id)
    layers, logits, X = forward_rows_chunks(params, rows, jnp.stack([t, x], axis=1),
                                            live.astype(jnp.int32) + eval_x, cfg)  # fmt: skip
    u = jax.vmap(jax.random.uniform)(k_test)
    kept = has_x & live & (forced | (u < prob_rows(logits[:, 0], x, *sampling)))
    two = kept & eval_x
    after = jnp.where(two[:, None], logits[:, 1], logits[:, 0])
    y = sample_rows(after, k_next, *sampling, ban=jnp.where(has_x & ~kept, x, -1))
    new = DecodeState(
        layers=layers,
        pos=rows.pos + live.astype(jnp.int32) + two.astype(jnp.int32),
        logits=jnp.where(live[:, None], after, rows.logits),
    )
    return new, (t, second, kept, y, jax.random.key_data(keys), X)


@partial(jax.jit, static_argnames=("cfg", "size"), donate_argnums=1)
def verify_rows(params: Params, batch: DecodeState, *args: jax.Array, cfg: Config,
                size: int) -> tuple[DecodeState, Verify]:  # fmt: skip
    """One speculative step of the dense batch's rows [0, size) (`args`: `Verify`'s).
    Returns (batch, `_verify`'s outputs). A forced second is kept without a test. An EOS is
    never evaluated (as in `model.batch.step`): a row whose first token is EOS writes
    nothing, and an EOS second is tested on the first position's logits alone."""
    new, out = _verify(params, jax.tree.map(lambda x: x[:size], batch), *args, cfg)
    return put_rows(batch, new), out


@partial(jax.jit, static_argnames=("cfg", "size", "span"), donate_argnums=(1, 2))
def paged_verify_rows(params: Params, batch: DecodeState, arrays: page_io.Arrays,
                      tables: jax.Array, *args: jax.Array, cfg: Config, size: int,
                      span: int) -> tuple[DecodeState, page_io.Arrays, Verify]:  # fmt: skip
    """`verify_rows` for rows whose long part lives in the page pool (as
    `model.batch.paged_step`; each table grown by two tokens, its tail its own): the rows
    are read through their tables, and the compressed and indexer rows a kept position
    completed are written into the row's pages — a rejected position's never (at most
    one per layer a step: no ratio is below 2). Returns (small parts, pool, `_verify`'s
    outputs)."""
    small = jax.tree.map(lambda x: x[:size], batch)
    rows = page_io.with_pages(small, arrays, tables, cfg, span)
    new, out = _verify(params, rows, *args, cfg)
    for at in (small.pos, small.pos + 1):  # each position the step may have kept
        arrays = page_io.put_new_rows(arrays, new, at, tables, cfg, cfg.state_dtype)
    return put_rows(batch, page_io.small_part(new)), arrays, out


@partial(jax.jit, static_argnames=("cfg", "size"), donate_argnums=(1, 2))
def draft_rows(
    params: Params,
    mtp: Any,  # the rows' MTP window states (a `LayerState` of `cfg.mtp_block()`, batched)
    drafts: jax.Array,  # [rows] int32: each row's draft for its next step (−1: none)
    X: jax.Array,  # [size, 2, hc, D]: `verify_rows`' streams
    after: jax.Array,  # [size, 2] int32: the token after each of those positions
    count: jax.Array,  # [size] int32: how many of the two positions to run (0, 1, 2)
    n: jax.Array,  # [size] int32: the first one's position in the block's own count
    *,
    cfg: Config,
    size: int,
) -> tuple[Any, jax.Array]:
    """The MTP block over the positions a step kept, each row from its own position `n`
    (counted from where its window started: the block attends by relative position, so a
    row's window can start at any turn's first speculative step); the draft of each row
    with `count` > 0 comes from its last one. Returns (window states, drafts)."""
    state = jax.tree.map(lambda x: x[:size], mtp)
    attend = row_attention(cfg.mtp_block(), n, count, 2)
    hc, D = X.shape[2:]
    last = jnp.maximum(count - 1, 0)

    def pick(Y: jax.Array) -> jax.Array:  # each row's last position run: its draft's
        return jnp.take_along_axis(Y.reshape(size, 2, hc, D), last[:, None, None, None],
                                   axis=1)[:, 0]  # fmt: skip

    logits, _, state = mtp_forward(params, X.reshape(-1, hc, D), after.reshape(-1), state,
                                   attend, cfg, rows=True, pick=pick)  # fmt: skip
    new = jnp.where(count > 0, argmax(logits), -1).astype(jnp.int32)
    return put_rows(mtp, state), drafts.at[:size].set(new)
