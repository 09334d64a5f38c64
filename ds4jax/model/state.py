"""The decode state: everything the model needs to continue from position `pos`.

A live frontier is this pytree plus its token ids; nothing else is hidden anywhere. Per
layer it holds exactly what spec §3.1 lists: the raw sliding-window ring, the compressed
rows (capacity from the maximum context), the compressor frontier (kv and score), and for
CSA layers the indexer rows and the indexer frontier. Shapes are static, so one compiled
forward serves every length.

Every per-position buffer is a ring with `REWIND` slots more than the model reads: the
raw window holds the last `sliding_window + REWIND` positions (slot = position mod its
size) and a compressor frontier, for ratio r with overlap factor c (2 for CSA, 1 for HCA),
the last c·r + REWIND positions (slot = position mod c·r + REWIND), slots of positions < 0
holding (0, −∞). What the model reads of a frontier — the positions from r·⌊n/r⌋ − (c−1)·r
to n (spec §3.3) — is gathered from the ring by position. So a frontier steps back up to
`REWIND` positions by resetting its length (`rewind`): the rows of the positions it steps
back to were not overwritten, and the rows past its length are masked by position until
it writes them again — how draft tokens are rejected inside a verification step
(`speculative-decoding.md`), never a cache for mismatched requests. A state that never
stepped back is a function of its tokens alone: prefill and decode leave identical states,
and two states of the same tokens compare equal leaf by leaf.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config

#: positions a frontier can step back by resetting its length (draft verification): the
#: room every per-position ring has beyond what the model reads
REWIND = 4


@jax.tree_util.register_dataclass
@dataclass
class LayerState:
    raw: jax.Array  # [W + REWIND, head_dim] ring, slot = position mod its size
    comp: jax.Array | None = None  # [capacity, head_dim]
    comp_kv: jax.Array | None = None  # [c·r + REWIND, c·head_dim] ring, as `raw`
    comp_score: jax.Array | None = None  # [c·r + REWIND, c·head_dim], ape included
    idx: jax.Array | None = None  # [capacity, index_head_dim]
    idx_kv: jax.Array | None = None  # [2·r + REWIND, 2·index_head_dim] ring
    idx_score: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    layers: tuple[LayerState, ...]
    pos: jax.Array  # int32 scalar: tokens evaluated so far (= next position)
    logits: jax.Array  # [vocab] float32: the distribution for the next token

    @property
    def num_tokens(self) -> jax.Array:
        return self.pos

    @property
    def nbytes(self) -> int:
        """Bytes its arrays occupy (its capacity: `spans`), what a retained state costs."""
        return allocated_bytes(self)


def window(cfg: Config) -> int:
    """Slots of the raw window ring: the sliding window and the rewind room, the same for
    every context."""
    return cfg.sliding_window + REWIND


def frontier_rows(cfg: Config, layer: int, index: bool = False) -> int:
    """Slots of a compressor's frontier ring (the indexer's with `index`): the c·r positions
    it pools and the rewind room."""
    c = 2 if index else overlap(cfg, layer)
    return c * cfg.compress_ratios[layer] + REWIND


def overlap(cfg: Config, layer: int) -> int:
    return 2 if cfg.layer_kind(layer) == "csa" else 1


def capacity(cfg: Config, layer: int, max_len: int) -> int:
    r = cfg.compress_ratios[layer]
    return max_len // r + 1


def init_state(cfg: Config, max_len: int, dtype: jnp.dtype = jnp.float32) -> DecodeState:
    """An empty state able to hold `max_len` tokens."""
    layers = []
    for i in range(cfg.num_layers):
        raw = jnp.zeros((window(cfg), cfg.head_dim), dtype)
        kind = cfg.layer_kind(i)
        if kind == "sliding":
            layers.append(LayerState(raw))
            continue
        c = overlap(cfg, i)
        cap = capacity(cfg, i, max_len)
        ls = LayerState(
            raw,
            comp=jnp.zeros((cap, cfg.head_dim), dtype),
            comp_kv=jnp.zeros((frontier_rows(cfg, i), c * cfg.head_dim), dtype),
            comp_score=jnp.full((frontier_rows(cfg, i), c * cfg.head_dim), -jnp.inf, dtype),
        )
        if kind == "csa":
            rows = frontier_rows(cfg, i, index=True)
            ls.idx = jnp.zeros((cap, cfg.index_head_dim), dtype)
            ls.idx_kv = jnp.zeros((rows, 2 * cfg.index_head_dim), dtype)
            ls.idx_score = jnp.full((rows, 2 * cfg.index_head_dim), -jnp.inf, dtype)
        layers.append(ls)
    return DecodeState(
        layers=tuple(layers),
        pos=jnp.zeros((), jnp.int32),
        logits=jnp.zeros((cfg.vocab_size,), jnp.float32),
    )


def rewind(state: DecodeState, pos: jax.Array | int, logits: jax.Array) -> DecodeState:
    """`state` stepped back to `pos` (at most `REWIND` positions before its own), with the
    next-token `logits` of that position, which the step that went past it computed. Only
    the length changes: the rows of the positions past `pos` stay in the rings, masked by
    position, until the state writes those positions again. The caller checks the bound
    (a jitted step cannot raise): past it the state reads overwritten rows."""
    return replace(state, pos=jnp.asarray(pos, jnp.int32), logits=logits)


#: the capacity a state starts with (tokens); a state grows to the next span when its
#: conversation reaches the end of its own (`spans`)
SPAN_BASE = 4096


def spans(cfg: Config, max_len: int, base: int = SPAN_BASE) -> tuple[int, ...]:
    """The capacities a state of this context takes, smallest first: `base` doubled until
    `max_len`, which ends the list. A state is made with the smallest span that holds its
    tokens and grows (`resize`) as the conversation does, so what it costs, in memory and in
    attention, follows the tokens held (within 2x) and not `--ctx`; `--ctx` only caps the
    conversation, and the set is fixed, so a conversation's length never compiles a program
    outside it. No span is shorter than the sliding window, so every span has the same
    window ring and a resize moves compressed rows only."""
    first = max(base, cfg.sliding_window)
    out = []
    while first < max_len:
        out.append(first)
        first *= 2
    return (*out, max_len)


def span_for(span_set: tuple[int, ...], tokens: int) -> int:
    """The smallest span that holds `tokens` tokens (a state of span S holds fewer than S)."""
    for s in span_set:
        if s > tokens:
            return s
    raise ValueError(f"{tokens} tokens do not fit a context of {span_set[-1]}")


def holds(cfg: Config, state: DecodeState, span: int) -> bool:
    """Whether `state` (one state or a batch of them) has the capacity of `span`."""
    return all(
        ls.comp.shape[-2] == capacity(cfg, i, span)
        for i, ls in enumerate(state.layers)
        if ls.comp is not None
    )


@partial(jax.jit, static_argnames=("cfg", "span"))
def resize(state: DecodeState, *, cfg: Config, span: int) -> DecodeState:
    """`state` (or a batch of states: any leading axes) with the compressed and indexer rows
    of capacity `span`: zero rows appended, or rows past it dropped — which are zero in a
    state of fewer than `span` tokens (canonical, above), so a shrink loses nothing."""

    def fit(rows: jax.Array | None, layer: int) -> jax.Array | None:
        if rows is None:
            return None
        cap, have = capacity(cfg, layer, span), rows.shape[-2]
        if cap <= have:
            return rows[..., :cap, :]
        pad = [(0, 0)] * rows.ndim
        pad[-2] = (0, cap - have)
        return jnp.pad(rows, pad)

    layers = tuple(
        replace(ls, comp=fit(ls.comp, i), idx=fit(ls.idx, i)) for i, ls in enumerate(state.layers)
    )
    return replace(state, layers=layers)


@functools.lru_cache(maxsize=64)
def capacity_bytes(cfg: Config, max_len: int) -> int:
    """Bytes one state of this context occupies, whatever its position: what a resident
    session or a fork point costs. Computed from shapes, nothing is allocated; cached, as
    the engine asks it for every request's span (tracing Flash's state takes ~50 ms)."""
    shapes = jax.eval_shape(lambda: init_state(cfg, max_len))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def state_bytes(cfg: Config, length: int, bytes_per_value: int = 4) -> int:
    """Bytes of *live* state after `length` tokens (what a snapshot must carry), excluding
    the token ids: raw rows, compressed and indexer rows, frontiers, next-token logits."""
    n = length
    total = cfg.vocab_size * 4
    for i in range(cfg.num_layers):
        total += min(n, window(cfg)) * cfg.head_dim * bytes_per_value
        kind = cfg.layer_kind(i)
        if kind == "sliding":
            continue
        r, c = cfg.compress_ratios[i], overlap(cfg, i)
        total += (n // r) * cfg.head_dim * bytes_per_value
        total += 2 * frontier_rows(cfg, i) * (c * cfg.head_dim) * bytes_per_value
        if kind == "csa":
            total += (n // r) * cfg.index_head_dim * bytes_per_value
            total += 2 * frontier_rows(cfg, i, True) * (2 * cfg.index_head_dim) * bytes_per_value
    return total


def dense_kv_bytes(cfg: Config, length: int, bytes_per_value: int = 4) -> int:
    """A dense per-token cache of the same width (one head_dim row per token per layer) —
    the baseline `state_bytes` is compared with."""
    return cfg.num_layers * length * cfg.head_dim * bytes_per_value + cfg.vocab_size * 4


def allocated_bytes(state: DecodeState) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state)))
