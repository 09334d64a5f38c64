"""The device side of paged state (issue 26): the per-layer page arrays in each state
dtype, and the small per-session part — shapes only, so that what a page and a session
cost is counted on the arrays the pool will hold, never by a formula kept beside them.

A page (`model.page_table.PAGE_TOKENS` = 256 tokens) holds, per compressed layer, the rows
those tokens complete: 256 / ratio rows (64 for CSA, 2 for HCA), and for CSA layers as many
indexer rows. `--state-dtype`:
- `f32`, `bf16`: a row is `head_dim` values of that dtype (indexer rows `index_head_dim`);
- `fp8`: the release's record, as vLLM (`fp8_ds_mla`) and SGLang store it — the
  `head_dim - rope_dim` non-RoPE values as FP8 E4M3 with one UE8M0 (power-of-two exponent)
  byte per 64 of them, padded to 8 bytes, and the `rope_dim` RoPE values in BF16: 584 B a
  row at Flash's 512 dims; indexer keys FP8 with one f32 scale per row (132 B).

The per-session part is what does not grow with the context: the sliding-window ring (in
the state dtype, as rows of the same record), the compressors' frontiers (f32: they are
sums in progress, not rows), the next-token logits and the position. The window ring and
the compressor frontiers are the model's own rings (`model.state`), with their `REWIND`
positions of room to step back over rejected draft tokens by resetting the length.
"""

from __future__ import annotations

import functools
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.model.page_table import PAGE_TOKENS
from ds4jax.model.quant_sim import fp8_decode, fp8_encode
from ds4jax.model.state import frontier_rows, overlap, window

STATE_DTYPES = ("f32", "bf16", "fp8")
PLAIN = {"f32": jnp.float32, "bf16": jnp.bfloat16}  # rows stored as plain values
#: values per UE8M0 scale byte in an fp8 record (the release's quantization group)
FP8_GROUP = 64


def _rows(lead: tuple[int, ...], width: int, rope: int, dtype: str) -> dict[str, Any]:
    """`lead` rows of `width` values (the last `rope` of them RoPE dims) as `dtype` stores
    them: zeros in `encode_rows`' own layout, so the layout is written once."""
    return _zeros_like(lambda: encode_rows(jnp.zeros((*lead, width), jnp.float32), rope, dtype))


def _index_rows(lead: tuple[int, ...], width: int, dtype: str) -> dict[str, Any]:
    return _zeros_like(lambda: encode_index_rows(jnp.zeros((*lead, width), jnp.float32), dtype))


def _zeros_like(encode: Any) -> dict[str, Any]:
    return {k: jnp.zeros(x.shape, x.dtype) for k, x in jax.eval_shape(encode).items()}


def encode_rows(rows: jax.Array, rope: int, dtype: str) -> dict[str, jax.Array]:
    """Float32 rows (`[..., width]`, the last `rope` dims RoPE) in `_rows`' layout: the same
    quantizer as the model's FP8 simulation (`quant_sim.fp8_encode`), so rows the official
    graph produced (`Config.quant_sim` on) keep their non-RoPE values exactly."""
    if dtype != "fp8":
        return {"value": rows.astype(PLAIN[dtype])}
    nope = rows.shape[-1] - rope
    codes, exps = fp8_encode(rows[..., :nope], FP8_GROUP)
    pad = -exps.shape[-1] % 8
    exps = jnp.concatenate([exps, jnp.zeros((*exps.shape[:-1], pad), jnp.uint8)], axis=-1)
    return {"nope": codes, "scale": exps, "rope": rows[..., nope:].astype(jnp.bfloat16)}


def decode_rows(stored: dict[str, jax.Array]) -> jax.Array:
    """The float32 rows `encode_rows` stored."""
    if "value" in stored:
        return stored["value"].astype(jnp.float32)
    nope = stored["nope"]
    exps = stored["scale"][..., : math.ceil(nope.shape[-1] / FP8_GROUP)]
    return jnp.concatenate(
        [fp8_decode(nope, exps, FP8_GROUP), stored["rope"].astype(jnp.float32)], axis=-1
    )


def encode_index_rows(rows: jax.Array, dtype: str) -> dict[str, jax.Array]:
    """Indexer rows in `_index_rows`' layout; fp8: E4M3 with one float32 scale per row,
    the release's indexer key cache. The scale is amax / 448 rounded up to a power of two
    (as the KV record's): then a decoded row encodes to itself, so the rows a state holds
    (`Config.state_dtype`, rounded as they are made) are stored and read back exactly."""
    if dtype != "fp8":
        return encode_rows(rows, 0, dtype)
    amax = jnp.maximum(jnp.max(jnp.abs(rows), axis=-1), 1e-12)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / 448.0)))
    return {"key": (rows / scale[..., None]).astype(jnp.float8_e4m3fn), "scale": scale}


def decode_index_rows(stored: dict[str, jax.Array]) -> jax.Array:
    if "value" in stored:
        return decode_rows(stored)
    return stored["key"].astype(jnp.float32) * stored["scale"][..., None]


def rows_to_bytes(rows: Any, rope: int, dtype: str, index: bool = False) -> np.ndarray:
    """Rows `[n, width]` as their records' bytes `[n, record bytes]` (uint8): the layout a
    disk checkpoint stores them in, in the state dtype (`kvstore.payload`)."""
    return np.asarray(records(jnp.asarray(rows, jnp.float32), rope, dtype, index))


def rows_from_bytes(data: np.ndarray, width: int, rope: int, dtype: str,
                    index: bool = False) -> np.ndarray:  # fmt: skip
    """The float32 rows `rows_to_bytes` stored (`width` values each)."""
    return np.asarray(from_records(jnp.asarray(data), width, rope, dtype, index))


@partial(jax.jit, static_argnames=("rope", "dtype", "index"))
def records(rows: jax.Array, rope: int, dtype: str, index: bool = False) -> jax.Array:
    """`rows_to_bytes` as one compiled program (a checkpoint encodes every layer's rows:
    op by op on the host it cost more than the write): each part of the record, in name
    order, as its little-endian bytes."""
    enc = encode_index_rows(rows, dtype) if index else encode_rows(rows, rope, dtype)
    n = rows.shape[0]
    return jnp.concatenate(
        [jax.lax.bitcast_convert_type(enc[k], jnp.uint8).reshape(n, -1) for k in sorted(enc)],
        axis=-1,
    )


@partial(jax.jit, static_argnames=("width", "rope", "dtype", "index"))
def from_records(data: jax.Array, width: int, rope: int, dtype: str,
                 index: bool = False) -> jax.Array:  # fmt: skip
    """The float32 rows of `records`' bytes `[n, record bytes]`."""
    parts, off = {}, 0
    n = data.shape[0]
    spec = record_spec(width, rope, dtype, index)
    if (size := record_size(spec)) != data.shape[-1]:
        raise ValueError(f"{data.shape[-1]} bytes a row, the {dtype} record has {size}")
    for k, like in spec:
        size = _part_bytes(like)
        raw = data[:, off : off + size].reshape(n, -1, like.dtype.itemsize)
        if like.dtype.itemsize == 1:
            raw = raw[..., 0]
        parts[k] = jax.lax.bitcast_convert_type(raw, like.dtype).reshape(n, *like.shape[1:])
        off += size
    return (decode_index_rows if index else decode_rows)(parts)


@functools.lru_cache(maxsize=64)
def record_spec(width: int, rope: int, dtype: str, index: bool) -> tuple[tuple[str, Any], ...]:
    """A record's parts (name, shape and dtype of one row's), in storage order: traced once
    per layout, not once per layer of every load."""

    def spec() -> dict[str, Any]:
        zero = jnp.zeros((1, width), jnp.float32)
        return encode_index_rows(zero, dtype) if index else encode_rows(zero, rope, dtype)

    return tuple(sorted(jax.eval_shape(spec).items()))


def record_size(spec: tuple[tuple[str, Any], ...]) -> int:
    """Bytes of one record of `record_spec`'s layout."""
    return sum(_part_bytes(like) for _k, like in spec)


def _part_bytes(like: Any) -> int:
    """Bytes of one row's part (`like`: the part of a one-row record)."""
    return int(np.prod(like.shape[1:], dtype=np.int64)) * like.dtype.itemsize


def _check(dtype: str) -> None:
    if dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype must be one of {', '.join(STATE_DTYPES)}, not {dtype!r}")


def page_arrays(cfg: Config, num_pages: int, dtype: str) -> list[dict[str, Any] | None]:
    """Per layer, the page arrays of a pool of `num_pages` pages (None for a layer with no
    compressed rows): `comp` rows, and for CSA layers `idx` rows, each `[pages, rows]`."""
    _check(dtype)
    out: list[dict[str, Any] | None] = []
    for i in range(cfg.num_layers):
        kind = cfg.layer_kind(i)
        if kind == "sliding":
            out.append(None)
            continue
        rows = PAGE_TOKENS // cfg.compress_ratios[i]
        layer = {"comp": _rows((num_pages, rows), cfg.head_dim, cfg.rope_dim, dtype)}
        if kind == "csa":
            layer["idx"] = _index_rows((num_pages, rows), cfg.index_head_dim, dtype)
        out.append(layer)
    return out


def session_arrays(cfg: Config, dtype: str) -> dict[str, Any]:
    """The per-session part of a frontier: window rings, compressor frontiers, logits."""
    _check(dtype)
    layers = []
    for i in range(cfg.num_layers):
        ring = window(cfg)
        layer: dict[str, Any] = {"raw": _rows((ring,), cfg.head_dim, cfg.rope_dim, dtype)}
        kind = cfg.layer_kind(i)
        if kind != "sliding":
            c = overlap(cfg, i)
            shape = (frontier_rows(cfg, i), c * cfg.head_dim)
            layer["comp_kv"] = jnp.zeros(shape, jnp.float32)
            layer["comp_score"] = jnp.zeros(shape, jnp.float32)
            if kind == "csa":
                shape = (frontier_rows(cfg, i, index=True), 2 * cfg.index_head_dim)
                layer["idx_kv"] = jnp.zeros(shape, jnp.float32)
                layer["idx_score"] = jnp.zeros(shape, jnp.float32)
        layers.append(layer)
    return {"layers": layers, "logits": jnp.zeros((cfg.vocab_size,), jnp.float32),
            "pos": jnp.zeros((), jnp.int32)}  # fmt: skip


def _nbytes(make: Any) -> int:
    shapes = jax.eval_shape(make)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def page_bytes(cfg: Config, dtype: str) -> int:
    """Bytes one page takes over every layer (nothing is allocated)."""
    return _nbytes(lambda: page_arrays(cfg, 1, dtype))


def bytes_per_token(cfg: Config, dtype: str) -> float:
    return page_bytes(cfg, dtype) / PAGE_TOKENS


def session_bytes(cfg: Config, dtype: str) -> int:
    """Bytes of a frontier's per-session part, whatever its length."""
    return _nbytes(lambda: session_arrays(cfg, dtype))


def record_bytes(cfg: Config, dtype: str) -> tuple[int, int]:
    """(bytes of one compressed row, of one indexer row) in `dtype`."""
    comp = _nbytes(lambda: _rows((1,), cfg.head_dim, cfg.rope_dim, dtype))
    return comp, _nbytes(lambda: _index_rows((1,), cfg.index_head_dim, dtype))
