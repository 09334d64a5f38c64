"""Batched decode: B resident sessions advance by one token in one jitted step.

Decode is memory-bound: one step reads every weight once whether it serves one row or
eight, so stepping the active sessions together multiplies throughput. The batch is a
`DecodeState` whose leaves carry a leading row axis (positions are per row), of a fixed
capacity; a session's frontier enters a row with `insert` and leaves with `extract`, both
jitted, `insert` donating the batch so it is updated in place. `step` advances the first
`size` rows, `size` from the fixed set `BATCH_SIZES` (rows past the active ones are
padding whose results nobody reads), so the number of active rows never compiles a new
program.

One step, per row: sample the next token from the row's logits with the row's own
parameters and key (`sampling.sample_rows`), or take the token the host forces (tool_choice,
a thinking budget, teacher forcing: `override` ≥ 0); evaluate it — except EOS, which is
sampled and never evaluated (the next turn's suffix starts with it), so such a row keeps
its state. Rows are independent, so each row's logits equal the
same session decoded alone, to float rounding: attention runs per row (`vmap`), while the
projections outside it and the MoE see the B tokens together (`forward_rows`).

`logprobs=True` (static: a second program per size, compiled only if a request asks) adds
each row's log-probabilities of the token it took and of its top `sampling.MAX_LOGPROBS`
(`Logprobs`, `sampling.logprob_rows`), from the same logits it sampled from; without it
the step is the program it always was.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from ds4jax.config import Config
from ds4jax.model import page_io
from ds4jax.model.forward import logits_of, run_layers
from ds4jax.model.layers import attention
from ds4jax.model.params import Params
from ds4jax.model.state import REWIND, DecodeState, init_state, rewind
from ds4jax.sampling import logprob_rows, sample_rows

BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8)

#: a `logprobs` step's last output: (the log-probability of each row's token [size], the
#: top `MAX_LOGPROBS` log-probabilities [size, K], their token ids [size, K])
Logprobs = tuple[jax.Array, jax.Array, jax.Array]


def bucket(n: int, sizes: tuple[int, ...] = BATCH_SIZES) -> int:
    """The smallest batch size that holds `n` rows."""
    for s in sorted(sizes):
        if s >= n:
            return s
    raise ValueError(f"{n} rows exceed the largest batch size {max(sizes)}")


def empty_batch(cfg: Config, max_len: int, rows: int, small: bool = False) -> DecodeState:
    """`rows` empty states (`small`: their small parts, for `paged_step`). Every leaf is
    strongly typed and committed to the default device, as `step` returns them, so the
    first step compiles the same program as every later one (on a mesh, `jax.device_put`
    the batch onto the mesh's sharding first)."""
    one = init_state(cfg, max_len)
    if small:
        one = page_io.small_part(one)
    batch = jax.tree.map(
        lambda x: jnp.array(jnp.broadcast_to(x, (rows, *x.shape)), dtype=x.dtype), one
    )
    return jax.device_put(batch, jax.local_devices()[0])


@partial(jax.jit, static_argnames=("cfg", "span", "rows"))
def with_rows(batch: DecodeState, *, cfg: Config, span: int, rows: int) -> DecodeState:
    """`batch` with `rows` rows: its first ones, or all of them and empty states (of `span`
    positions, as `empty_batch` makes them) after. A step of `size` rows on a batch of more
    copies those rows' whole states out of it and back (`step`'s slice and `put_rows`): the
    engine keeps its batch at the rows it steps instead."""
    have = jax.tree.leaves(batch)[0].shape[0]
    if rows <= have:
        return jax.tree.map(lambda x: x[:rows], batch)

    def grown(b: jax.Array, o: jax.Array) -> jax.Array:
        return jnp.concatenate([b, jnp.broadcast_to(o, (rows - have, *o.shape)).astype(b.dtype)])

    return jax.tree.map(grown, batch, init_state(cfg, span))


@partial(jax.jit, donate_argnums=0)
def insert(batch: DecodeState, row: jax.Array, state: DecodeState) -> DecodeState:
    return jax.tree.map(
        lambda b, s: jax.lax.dynamic_update_index_in_dim(b, s.astype(b.dtype), row, 0),
        batch,
        state,
    )


@jax.jit
def extract(batch: DecodeState, row: jax.Array) -> DecodeState:
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, row, 0, keepdims=False), batch)


#: a prompt chunk evaluated inside a decode step (`step`'s `chunk`): the prompt's state, its
#: tokens [C] (padded) and how many are real
Chunk = tuple[DecodeState, jax.Array, jax.Array]


def row_attention(cfg: Config, n: jax.Array, valid: jax.Array, T: int) -> Any:
    """Attention for T consecutive tokens of each of B rows (y [B·T, D], row-major): each
    row's chunk at its own positions n[row]…, of which the first `valid[row]` are real —
    `forward_chunk`'s attention, per row (`vmap`)."""

    def emits(ratio: int) -> jax.Array:  # some row completes a window: pool (else skip)
        return jnp.any((n + valid) // ratio > n // ratio)

    def seen(ratio: int) -> jax.Array:  # the most compressed rows a query of any row sees
        return jnp.max((n + valid) // ratio)

    def attend_rows(i: int, p: Params, ls, y: jax.Array):
        def one(ls_r, y_r, n_r, v_r):
            positions = n_r + jnp.arange(T, dtype=jnp.int32)
            return attention(cfg, i, p, ls_r, y_r, positions, n_r, v_r, emits, seen)

        out, ls = jax.vmap(one)(ls, y.reshape(n.shape[0], T, y.shape[-1]), n, valid)
        return out.reshape(-1, out.shape[-1]), ls

    return attend_rows


def forward_rows_chunks(params: Params, rows: DecodeState, tokens: jax.Array,
                        valid: jax.Array, cfg: Config,
                        ) -> tuple[Any, jax.Array, jax.Array]:  # fmt: skip
    """T tokens for each of B rows (`tokens` [B, T], the first `valid[row]` real): a
    speculative step's verification (`model.speculative`), the B·T tokens going through the
    MoE and the head together as `forward_rows`' B do. Returns (the rows' layer states
    with every valid token written, logits [B, T, vocab], streams [B, T, hc, D]); the
    caller sets each row's length and logits (where it accepted up to)."""
    B, T = tokens.shape
    attend = row_attention(cfg, rows.pos, valid.astype(jnp.int32), T)
    X, layers = run_layers(params, cfg, tokens.reshape(-1), rows.layers, attend, rows=True)
    logits = logits_of(params, cfg, X).astype(jnp.float32)
    return tuple(layers), logits.reshape(B, T, -1), X.reshape(B, T, *X.shape[1:])


def forward_rows(params: Params, rows: DecodeState, tokens: jax.Array, cfg: Config,
                 chunk: Chunk | None = None, valid: jax.Array | None = None,
                 ) -> tuple[DecodeState, DecodeState | None]:  # fmt: skip
    """One token for each of B sessions: attention per row (its own state and position,
    `vmap`), everything else over the B tokens together — so the MoE routes B tokens and
    every weight is read once per step, not once per row.

    `chunk`: a prompt's next C tokens ride along (a mixed step, issue 27): their attention
    is `forward_chunk`'s on the prompt's own state, and everything else — embedding,
    hyper-connections, the MoE, the head — runs over the B + C tokens together, so the chunk
    adds its attention and its share of the arithmetic to the step rather than a program of
    its own. `valid` [B] (0 or 1): a row with 0 writes nothing — its state and logits stay
    as they were, the way a padded chunk position writes nothing — so no select over the
    rows' whole states is needed after the step. Returns (rows, the prompt's state after
    the chunk or None)."""
    n = rows.pos
    B = tokens.shape[0]
    valid = jnp.ones(B, jnp.int32) if valid is None else valid.astype(jnp.int32)
    attend_rows = row_attention(cfg, n, valid, 1)

    def kept(logits: jax.Array) -> jax.Array:
        return jnp.where(valid[:, None] > 0, logits.astype(jnp.float32), rows.logits)

    if chunk is None:
        X, layers = run_layers(params, cfg, tokens, rows.layers, attend_rows, rows=True)
        logits = kept(logits_of(params, cfg, X))
        return DecodeState(layers=tuple(layers), pos=n + valid, logits=logits), None
    state, chunk_tokens, n_valid = chunk
    positions = state.pos + jnp.arange(chunk_tokens.shape[0], dtype=jnp.int32)

    def attend(i: int, p: Params, ls, y: jax.Array):
        a_rows, ls_rows = attend_rows(i, p, ls[0], y[:B])
        a_chunk, ls_chunk = attention(cfg, i, p, ls[1], y[B:], positions, state.pos, n_valid)
        return jnp.concatenate([a_rows, a_chunk]), (ls_rows, ls_chunk)

    X, layers = run_layers(params, cfg, jnp.concatenate([tokens, chunk_tokens]),
                           list(zip(rows.layers, state.layers, strict=True)), attend,
                           rows=True)  # fmt: skip
    last = jax.lax.dynamic_slice_in_dim(X, B + n_valid - 1, 1)
    logits = logits_of(params, cfg, jnp.concatenate([X[:B], last])).astype(jnp.float32)
    new_rows = DecodeState(layers=tuple(ls for ls, _ in layers), pos=n + valid,
                           logits=kept(logits[:B]))  # fmt: skip
    new_chunk = DecodeState(layers=tuple(ls for _, ls in layers), pos=state.pos + n_valid,
                            logits=logits[B])  # fmt: skip
    return new_rows, new_chunk


def _advance(
    params: Params, rows: DecodeState, override: jax.Array, key_data: jax.Array,
    temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
    eos_id: jax.Array, cfg: Config, chunk: Chunk | None = None, logprobs: bool = False,
) -> tuple[DecodeState, jax.Array, jax.Array, DecodeState | None, Logprobs | None]:  # fmt: skip
    """The step itself, on dense rows, whatever holds them (a dense batch, or pages read
    through the rows' tables): sample or force, evaluate (with `chunk` riding along);
    rows that sampled EOS are left as they were. `logprobs`: the `Logprobs` of the tokens
    taken (forced ones too: the model's distribution where they went), else None."""
    split = jax.vmap(jax.random.split)(jax.random.wrap_key_data(key_data))
    keys, sub = split[:, 0], split[:, 1]
    sampled = sample_rows(rows.logits, sub, temperature, top_k, top_p, min_p)
    tokens = jnp.where(override >= 0, override, sampled).astype(jnp.int32)
    scores = logprob_rows(rows.logits, tokens) if logprobs else None

    # a sampled EOS is not evaluated: that row writes nothing and keeps its logits
    new, prompt = forward_rows(params, rows, tokens, cfg, chunk, valid=tokens != eos_id)
    return new, tokens, jax.random.key_data(keys), prompt, scores


def put_rows(batch: DecodeState, new: DecodeState) -> DecodeState:
    return jax.tree.map(lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n, 0, 0), batch, new)


@partial(jax.jit, static_argnames=("cfg", "size", "logprobs"), donate_argnums=1)
def step(
    params: Params,
    batch: DecodeState,
    override: jax.Array,  # [size] int32: a forced token, or -1 to sample
    key_data: jax.Array,  # [size, 2] uint32: each row's PRNG key (`jax.random.key_data`)
    temperature: jax.Array,  # [size] float32; ≤ 0 = greedy
    top_k: jax.Array,  # [size] int32; 0 = off
    top_p: jax.Array,  # [size] float32; 1 = off
    min_p: jax.Array,  # [size] float32; 0 = off
    eos_id: jax.Array,
    chunk: Chunk | None = None,
    *,
    cfg: Config,
    size: int,
    logprobs: bool = False,
) -> tuple[Any, ...]:
    """Advance rows [0, size) by one token; returns (batch, tokens [size], next key data),
    and with `chunk` (a mixed step) the prompt's state after it too; the prompt's state is
    not donated (a retained frontier may be what it continues); with `logprobs`, the
    `Logprobs` last. Pass the per-row arguments as host (numpy) arrays: the same program
    then serves every call, whatever produced them."""
    rows = jax.tree.map(lambda x: x[:size], batch)
    new, tokens, keys, prompt, scores = _advance(
        params, rows, override, key_data, temperature, top_k, top_p, min_p, eos_id, cfg,
        chunk, logprobs,
    )  # fmt: skip
    out = (put_rows(batch, new), tokens, keys)
    out = out if chunk is None else (*out, prompt)
    return out if scores is None else (*out, scores)


#: tokens a `burst` may take per row: at most the state's rewind room past the first, so a
#: row whose decoder stops taking them early steps back (`rewind_row`)
BURST_STEPS = REWIND


@partial(jax.jit, static_argnames=("cfg", "size", "steps"), donate_argnums=1)
def burst(
    params: Params,
    batch: DecodeState,
    allowed: jax.Array,  # [size] int32: tokens each row may take (1…steps; 0: none)
    key_data: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    eos_id: jax.Array,
    *,
    cfg: Config,
    size: int,
    steps: int = BURST_STEPS,
) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
    """`steps` plain sampling steps of rows [0, size) in one program (a server's decode
    with nothing else to do: the host's per-call cost — ~1.1 ms of a ~9.5 ms step at B=1 on
    bench-192m — paid once for `steps` tokens). Row r samples its first `allowed[r]` tokens
    as `step` would, key by key; past them, or after it sampled EOS, it takes EOS (written
    nowhere: its state stays). Returns (batch, tokens [steps, size], each step's key data
    [steps, size, 2], each step's logits [steps, size, vocab]) — what a row needs to step
    back to any of its tokens when its decoder takes fewer (`rewind_row`)."""
    rows = jax.tree.map(lambda x: x[:size], batch)

    def one(carry: tuple[DecodeState, jax.Array, jax.Array], i: jax.Array):
        rows, keys, ended = carry
        off = ended | (i >= allowed)
        override = jnp.where(off, eos_id, -1).astype(jnp.int32)
        new, tokens, keys, _, _ = _advance(params, rows, override, keys, temperature, top_k,
                                           top_p, min_p, eos_id, cfg)  # fmt: skip
        return (new, keys, tokens == eos_id), (tokens, keys, new.logits)

    start = (rows, key_data, jnp.zeros(size, bool))
    (rows, _, _), (tokens, keys, logits) = jax.lax.scan(one, start, jnp.arange(steps))
    return put_rows(batch, rows), tokens, keys, logits


@partial(jax.jit, donate_argnums=0)
def rewind_row(batch: DecodeState, row: jax.Array, pos: jax.Array, logits: jax.Array):
    """Row `row` stepped back to `pos` with that position's next-token `logits`
    (`state.rewind` on that row, within its rewind room): a burst's tokens its decoder did
    not take."""
    return rewind(batch, batch.pos.at[row].set(pos), batch.logits.at[row].set(logits))


def by_shard(f: Any, shards: int, pool_pages: int, tables: jax.Array, *trees: Any) -> Any:
    """`f(local tables, *trees)` run on each of `shards` data shards (issue 28): the pool's
    pages and the batch's rows split into `shards` equal blocks, shard s holding pool pages
    [s·P, (s+1)·P) and rows [s·R, (s+1)·R). Tables hold global page ids and the null page
    0 for padding; each shard sees its own block with local ids (its first page, local 0,
    is its null page, never handed out). Written as a `vmap` over the shard axis, so with
    the pool and the rows split along the mesh's `data` axis every gather and scatter of a
    page stays on the devices holding it: no shard reads another's pages."""
    if shards == 1:
        return f(tables, *trees)
    if tables.shape[0] % shards or pool_pages % shards:
        raise ValueError(f"{tables.shape[0]} rows and {pool_pages} pages must split into "
                         f"{shards} data shards")  # fmt: skip
    rows = tables.shape[0] // shards
    offset = (jnp.arange(tables.shape[0], dtype=tables.dtype) // rows) * (pool_pages // shards)
    local = jnp.where(tables == 0, 0, tables - offset[:, None])
    split = lambda x: x.reshape(shards, x.shape[0] // shards, *x.shape[1:])  # noqa: E731
    out = jax.vmap(f)(split(local), *jax.tree.map(split, trees))
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), out)


def pool_pages(arrays: page_io.Arrays) -> int:
    return next(a.shape[0] for a in jax.tree.leaves(arrays))


_PAGED_STATIC = ("cfg", "size", "span", "shards", "logprobs")


@partial(jax.jit, static_argnames=_PAGED_STATIC, donate_argnums=(1, 2))
def paged_step(
    params: Params,
    batch: DecodeState,  # the rows' small parts (`page_io.small_part`)
    arrays: page_io.Arrays,  # the page pool (`model.pages.page_arrays`)
    tables: jax.Array,  # [size, pages of span] int32: each row's page table, null-padded
    override: jax.Array,
    key_data: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array,
    eos_id: jax.Array,
    chunk: Chunk | None = None,
    *,
    cfg: Config,
    size: int,
    span: int,
    shards: int = 1,
    logprobs: bool = False,
) -> tuple[Any, ...]:
    """`step` for rows whose long part lives in the page pool (issue 26, "batch rows hold
    no copies"): each row's compressed and indexer rows are read through its table inside
    the step, at the capacity of `span` (the batch's), and the row a step completes is
    written into the row's own tail page — which the host made the row's alone before the
    step (`kvstore.pages.PagePool.advance`). Admitting a session moves its small part
    only. The arithmetic is `step`'s on the same dense values (a state's rows are stored
    in its dtype as they are made, so pages give them back exactly): a paged row's tokens
    and state equal a dense row's bit for bit. Returns (small parts, pool, tokens, keys),
    and with `chunk` the prompt's state after it, with `logprobs` the `Logprobs` (as
    `step`).

    `shards` > 1 (issue 28): the pool and the rows are split into that many data shards
    (`by_shard`), each row's pages in its own shard's block; every shard reads and writes
    its own pages, and everything after the read — attention per row, the MoE over all the
    step's tokens, the head — is the same program as with one shard."""
    small = jax.tree.map(lambda x: x[:size], batch)
    P = pool_pages(arrays)
    rows = by_shard(lambda t, sm, ar: page_io.with_pages(sm, ar, t, cfg, span), shards, P,
                    tables, small, arrays)  # fmt: skip
    new, tokens, keys, prompt, scores = _advance(
        params, rows, override, key_data, temperature, top_k, top_p, min_p, eos_id, cfg,
        chunk, logprobs,
    )  # fmt: skip
    put = lambda t, ar, nw, n: page_io.put_new_rows(ar, nw, n, t, cfg, cfg.state_dtype)  # noqa: E731
    arrays = by_shard(put, shards, P, tables, arrays, new, small.pos)
    out = (put_rows(batch, page_io.small_part(new)), arrays, tokens, keys)
    out = out if chunk is None else (*out, prompt)
    return out if scores is None else (*out, scores)
