"""Moving a frontier's long part between a dense `DecodeState` and the page arrays (issue
26): the data path under `kvstore.pages`' bookkeeping, whatever the engine does with it
next (frontiers kept in pages at rest and materialized for a step, or steps reading pages
directly).

A `PagedFrontier` is a page table plus the small part of the state — everything but the
compressed and indexer rows: the window rings, the compressor frontiers, the logits and the
position. `write` stores the rows of the pages a table took over (`first` on: earlier ones
are shared, already written); `copy` carries out the `Copy`s growth asked for; `materialize`
rebuilds the dense state of any fixed capacity that holds the tokens. Each is one jitted
program per page, the page arrays (or the dense state) donated, so a write or a read costs
the pages it moves, not the pool or the capacity.

A shared partial page may hold rows another frontier appended past this one's end, and a
dense state is canonical (rows past the live ones are zero, `model.state`): `materialize`
keeps a page's rows below the frontier's own count only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.model.page_table import PAGE_TOKENS, Copy, PageTable
from ds4jax.model.pages import decode_index_rows, decode_rows, encode_index_rows, encode_rows
from ds4jax.model.state import DecodeState, capacity, init_state

Arrays = list[dict[str, Any] | None]  # `model.pages.page_arrays`


@dataclass(frozen=True)
class PagedFrontier:
    table: PageTable
    small: DecodeState  # the state with its `comp` and `idx` rows left out (None)

    @property
    def tokens(self) -> int:
        return self.table.tokens

    @property
    def logits(self) -> jax.Array:  # as a dense state's: the next-token distribution
        return self.small.logits

    @property
    def pos(self) -> jax.Array:
        return self.small.pos


def small_part(state: DecodeState) -> DecodeState:
    """`state` without its compressed and indexer rows: what a frontier keeps beside its
    pages."""
    return replace(state, layers=tuple(replace(ls, comp=None, idx=None) for ls in state.layers))


def _block(cfg: Config, layer: int) -> int:
    return PAGE_TOKENS // cfg.compress_ratios[layer]


@partial(jax.jit, static_argnames=("cfg", "dtype"), donate_argnums=0)
def _write_page(
    arrays: Arrays, state: DecodeState, page: jax.Array, block: jax.Array, *, cfg: Config,
    dtype: str,
) -> Arrays:  # fmt: skip
    out = []
    for i, (layer, ls) in enumerate(zip(arrays, state.layers, strict=True)):
        if layer is None:
            out.append(None)
            continue
        rows = block * _block(cfg, i) + jnp.arange(_block(cfg, i))
        # rows past the capacity read as zero: a page is written whole
        take = partial(jnp.take, indices=rows, axis=0, mode="fill", fill_value=0)
        new = {"comp": encode_rows(take(ls.comp), cfg.rope_dim, dtype)}
        if "idx" in layer:
            new["idx"] = encode_index_rows(take(ls.idx), dtype)
        out.append({k: {f: a.at[page].set(new[k][f]) for f, a in layer[k].items()} for k in layer})
    return out


def write(
    arrays: Arrays, state: DecodeState, table: PageTable, cfg: Config, dtype: str, first: int = 0
) -> Arrays:
    """`arrays` with the rows of `table.pages[first:]` taken from `state`, which holds
    `table.tokens` tokens."""
    for k in range(first, len(table.pages)):
        arrays = _write_page(arrays, state, np.int32(table.pages[k]), np.int32(k),
                             cfg=cfg, dtype=dtype)  # fmt: skip
    return arrays


@partial(jax.jit, donate_argnums=0)
def _copy_page(arrays: Arrays, src: jax.Array, dst: jax.Array) -> Arrays:
    return jax.tree.map(lambda a: a.at[dst].set(a[src]), arrays)


def _bits(a: jax.Array) -> jax.Array:
    """An array's bits as unsigned integers: equal exactly when the stored bytes are."""
    kind = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return a if a.dtype == kind else jax.lax.bitcast_convert_type(a, kind)


@jax.jit
def same_pages(arrays: Arrays, a: jax.Array, b: jax.Array) -> jax.Array:
    """Per pair i, whether pages `a[i]` and `b[i]` hold the same bytes in every layer."""
    eq = jnp.ones(a.shape, bool)
    for leaf in jax.tree.leaves(arrays):
        x, y = _bits(leaf[a]), _bits(leaf[b])
        eq &= jnp.all((x == y).reshape(a.shape[0], -1), axis=1)
    return eq


def copy(arrays: Arrays, copies: list[Copy]) -> Arrays:
    """Carry out the copies `PagePool.grow` asked for (whole pages: the rows past a copy's
    token count are never read through the new table, and the step rewrites them)."""
    for c in copies:
        arrays = _copy_page(arrays, np.int32(c.src), np.int32(c.dst))
    return arrays


@partial(jax.jit, static_argnames=("cfg",), donate_argnums=0)
def _read_page(
    dense: DecodeState, arrays: Arrays, page: jax.Array, block: jax.Array, tokens: jax.Array,
    *, cfg: Config,
) -> DecodeState:  # fmt: skip
    layers = []
    for i, (layer, ls) in enumerate(zip(arrays, dense.layers, strict=True)):
        if layer is None:
            layers.append(ls)
            continue
        size = _block(cfg, i)
        rows = block * size + jnp.arange(size)
        live = rows < tokens // cfg.compress_ratios[i]  # this frontier's rows only

        def put(dst: jax.Array, got: jax.Array, live=live, rows=rows) -> jax.Array:
            got = jnp.where(live[:, None], got, 0).astype(dst.dtype)
            return dst.at[rows].set(got, mode="drop")

        page_of = lambda part: {f: a[page] for f, a in part.items()}  # noqa: E731
        new = replace(ls, comp=put(ls.comp, decode_rows(page_of(layer["comp"]))))
        if "idx" in layer:
            new = replace(new, idx=put(ls.idx, decode_index_rows(page_of(layer["idx"]))))
        layers.append(new)
    return replace(dense, layers=tuple(layers))


def materialize(arrays: Arrays, frontier: PagedFrontier, cfg: Config, max_len: int) -> DecodeState:
    """The dense state of capacity `max_len` the frontier stands for."""
    if frontier.tokens > max_len:
        raise ValueError(f"{frontier.tokens} tokens do not fit a context of {max_len}")
    empty = init_state(cfg, max_len)
    small = jax.tree.map(jnp.copy, frontier.small)  # the reads donate what they fill
    dense = replace(
        small,
        layers=tuple(
            replace(s, comp=e.comp, idx=e.idx)
            for s, e in zip(small.layers, empty.layers, strict=True)
        ),
    )
    n = np.int32(frontier.tokens)
    for k, page in enumerate(frontier.table.pages):
        dense = _read_page(dense, arrays, np.int32(page), np.int32(k), n, cfg=cfg)
    return dense


def with_pages(small: DecodeState, arrays: Arrays, tables: jax.Array, cfg: Config,
               span: int) -> DecodeState:  # fmt: skip
    """Rows of small parts (`[B, …]`) with their compressed and indexer rows read through
    their page tables (`tables`: `[B, pages]`, unused entries the null page), at the
    capacity of `span`: the dense rows a step of that span attends over, built inside the
    step (traced), so no row's long part is held anywhere but in its pages. A row's pages
    past its own rows (a partial page another frontier appended into, the null page) read
    as zero, as in a canonical dense state."""
    layers = []
    for i, (layer, ls) in enumerate(zip(arrays, small.layers, strict=True)):
        if layer is None:
            layers.append(ls)
            continue
        cap = capacity(cfg, i, span)
        live = jnp.arange(cap)[None, :] < (small.pos // cfg.compress_ratios[i])[:, None]

        def read(part: dict[str, jax.Array], decode: Any, live=live, cap=cap) -> jax.Array:
            got = decode({f: a[tables] for f, a in part.items()})  # [B, pages, rows, width]
            got = got.reshape(got.shape[0], -1, got.shape[-1])
            have = got.shape[1]
            got = got[:, :cap] if have >= cap else jnp.pad(got, ((0, 0), (0, cap - have), (0, 0)))
            return jnp.where(live[..., None], got, 0)

        new = replace(ls, comp=read(layer["comp"], decode_rows))
        if "idx" in layer:
            new = replace(new, idx=read(layer["idx"], decode_index_rows))
        layers.append(new)
    return replace(small, layers=tuple(layers))


def put_new_rows(arrays: Arrays, rows: DecodeState, before: jax.Array, tables: jax.Array,
                 cfg: Config, dtype: str) -> Arrays:  # fmt: skip
    """`arrays` with the compressed and indexer row each row of the batch completed in a
    one-token step (`before`: its positions before the step; rows that did not advance,
    an EOS sampled or a padding row, have `rows.pos == before`), written into its own page
    through its table. One row a layer a batch row at most, and only rows the step made:
    the rows a shared page already holds are never written again."""
    n = before
    out = []
    for i, layer in enumerate(arrays):
        if layer is None:
            out.append(None)
            continue
        r, block = cfg.compress_ratios[i], _block(cfg, i)
        j = n // r  # the row a step at position n completes, when (n + 1) % r == 0
        page = jnp.take_along_axis(tables, (j // block)[:, None], axis=1)[:, 0]
        made = (rows.pos > n) & ((n + 1) % r == 0) & (page != 0)
        page = jnp.where(made, page, jnp.iinfo(jnp.int32).max)  # dropped below
        slot = j % block
        ls = rows.layers[i]

        def put(part: dict[str, jax.Array], dense: jax.Array, encode: Any,
                page=page, slot=slot, j=j) -> dict[str, jax.Array]:  # fmt: skip
            new = jnp.take_along_axis(dense, j[:, None, None], axis=1)[:, 0]  # [B, width]
            enc = encode(new)
            return {f: a.at[page, slot].set(enc[f].astype(a.dtype), mode="drop")
                    for f, a in part.items()}  # fmt: skip

        new = {"comp": put(layer["comp"], ls.comp, lambda v: encode_rows(v, cfg.rope_dim, dtype))}
        if "idx" in layer:
            new["idx"] = put(layer["idx"], ls.idx, lambda v: encode_index_rows(v, dtype))
        out.append(new)
    return out
