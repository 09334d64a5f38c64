"""A `DecodeState` as the flat dict of host arrays a checkpoint stores, and back.

Only live rows are kept: after `n` tokens the raw ring holds `min(n, W)` rows, the
compressed and indexer rows `n // r` rows; the small compressor frontiers and the next-token
logits are kept whole. Rows are stored in the state dtype (`Config.state_dtype`): as
float32, or as the bytes of their bf16 / fp8 records (`model.pages.records`) — the
rows a state of that dtype holds are values of it, so they come back bit for bit, at a
quarter of the bytes in fp8. The state is canonical (model/state.py: rows past the live ones are
the initial values, zero for every row field), so `unpack` rebuilds the full-capacity state
exactly by scattering the saved rows into zeros of the shapes of `init_state(cfg, max_len)`:
a checkpoint loads into any context that holds its tokens, whatever context it was written
with, provided the sliding window is the same.

Orbax refuses zero-size arrays, so a row-sliced array keeps at least one row; the extra row
is the initial value, and scattering it back changes nothing.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.config import Config
from ds4jax.model.pages import from_records, record_size, record_spec, records
from ds4jax.model.state import DecodeState, LayerState, init_state, window

#: per-layer fields whose leading axis is token rows, and how many rows are live after n
ROW_FIELDS = ("raw", "comp", "idx")
FRONTIER_FIELDS = ("comp_kv", "comp_score", "idx_kv", "idx_score")


def live_rows(cfg: Config, layer: int, field: str, n: int, win: int) -> int:
    if field == "raw":
        return min(n, win)
    return n // cfg.compress_ratios[layer]


def _bucket(k: int, capacity: int) -> int:
    """Rows moved for `k` live ones: a power of two (at most 2× the live bytes), so that
    saves and loads at ever-new lengths reuse a few compiled programs."""
    return min(capacity, 1 << max(0, k - 1).bit_length())


@partial(jax.jit, static_argnames=("bucket", "rope", "dtype", "index"))
def _head(x: jax.Array, *, bucket: int, rope: int, dtype: str, index: bool) -> jax.Array:
    """The first `bucket` rows of `x`, as records in `dtype` (as they are, in f32)."""
    return x[:bucket] if dtype == "f32" else records(x[:bucket], rope, dtype, index)


def host_rows(x: jax.Array, k: int, rope: int = 0, dtype: str = "f32",
              index: bool = False) -> np.ndarray:  # fmt: skip
    """The first `k` rows of `x` on the host, as their records' bytes in `dtype`: encoded
    on the device, a bucket of rows at a time (`_bucket`), then cut to `k` on the host."""
    bucket = _bucket(k, x.shape[0])
    return np.asarray(_head(x, bucket=bucket, rope=rope, dtype=dtype, index=index))[:k]


@partial(jax.jit, static_argnames=("capacity", "width", "rope", "dtype", "index"))
def _placed(head: jax.Array, k: jax.Array, *, capacity: int, width: int, rope: int,
            dtype: str, index: bool) -> jax.Array:  # fmt: skip
    """A row field of `capacity` rows holding the `k` live rows of `head` (a bucket of
    rows, or of their records in `dtype`) and zeros after them (the initial value)."""
    rows = head if dtype == "f32" else from_records(head, width, rope, dtype, index)
    rows = jnp.where(jnp.arange(rows.shape[0])[:, None] < k, rows, 0.0)
    return jax.lax.dynamic_update_slice_in_dim(jnp.zeros((capacity, width), rows.dtype), rows, 0, 0)


def pack(state: DecodeState, n: int, cfg: Config) -> dict[str, np.ndarray]:
    """Host copies of the live part of `state` (which holds `n` tokens): `logits` and
    `l{i}_{field}` per layer."""
    out: dict[str, np.ndarray] = {"logits": np.asarray(state.logits)}
    for i, layer in enumerate(state.layers):
        win = layer.raw.shape[0]
        for field in ROW_FIELDS + FRONTIER_FIELDS:
            x = getattr(layer, field)
            if x is None:
                continue
            if field in ROW_FIELDS:  # in the state dtype: the bytes its rows are
                k = max(1, live_rows(cfg, i, field, n, win))
                out[f"l{i}_{field}"] = host_rows(x, k, cfg.rope_dim, cfg.state_dtype,
                                                 field == "idx")  # fmt: skip
            else:
                out[f"l{i}_{field}"] = np.asarray(x)
    return out


def manifest(arrays: Mapping[str, np.ndarray]) -> dict[str, dict]:
    return {k: {"shape": list(a.shape), "dtype": str(a.dtype)} for k, a in sorted(arrays.items())}


def payload_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    return int(sum(a.nbytes for a in arrays.values()))


def crc_pool() -> ThreadPoolExecutor:
    """Threads for checksums: zlib releases the GIL on large buffers, so CRCs of separate
    arrays (or file pieces) run side by side, one per core."""
    return ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)))


def digest(tokens: tuple[int, ...] | list[int], arrays: Mapping[str, np.ndarray]) -> str:
    """CRC-32 over the token ids and, in name order, every array's name, shape, dtype and
    the CRC-32 of its bytes (computed side by side): what a load must read back bit for bit.
    A checksum against corruption, not a signature (sha1 runs at ~0.5 GB/s here, crc32 at
    ~1.4 GB/s per core)."""
    names = sorted(arrays)

    def crc(name: str) -> int:
        return zlib.crc32(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))

    with crc_pool() as pool:
        crcs = list(pool.map(crc, names))
    out = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes())
    for name, c in zip(names, crcs, strict=True):
        a = arrays[name]
        out = zlib.crc32(f"{name}:{a.shape}:{a.dtype}:{c:08x}".encode(), out)
    return f"{out:08x}"


@functools.lru_cache(maxsize=8)
def _template(cfg: Config, max_len: int) -> DecodeState:
    """The shapes of `init_state(cfg, max_len)` (tracing it costs ~50 ms for Flash)."""
    return jax.eval_shape(lambda: init_state(cfg, max_len))


def unpack(arrays: Mapping[str, np.ndarray], n: int, cfg: Config, max_len: int) -> DecodeState:
    """The full-capacity state of `init_state(cfg, max_len)` holding the saved rows. Raises
    ValueError when the arrays do not fit this model and context."""
    if n >= max_len:
        raise ValueError(f"{n} tokens do not fit a context of {max_len}")
    template = _template(cfg, max_len)
    expected = {"logits"} | {
        f"l{i}_{f}"
        for i, layer in enumerate(template.layers)
        for f in ROW_FIELDS + FRONTIER_FIELDS
        if getattr(layer, f) is not None
    }
    if set(arrays) != expected:
        raise ValueError(f"arrays {sorted(set(arrays) ^ expected)} do not match the model")

    def fill(name: str, like: jax.ShapeDtypeStruct, rows: int | None) -> jax.Array:
        a = arrays[name]
        as_records = rows is not None and cfg.state_dtype != "f32"
        if as_records:
            spec = record_spec(like.shape[-1], cfg.rope_dim, cfg.state_dtype,
                               name.endswith("_idx"))  # fmt: skip
            if a.dtype != np.uint8 or a.ndim != 2 or a.shape[-1] != record_size(spec):
                raise ValueError(f"{name}: {a.dtype} {a.shape}, not {cfg.state_dtype} records")
        elif a.dtype != like.dtype:
            raise ValueError(f"{name}: dtype {a.dtype}, the state has {like.dtype}")
        if rows is None:
            if a.shape != like.shape:
                raise ValueError(f"{name}: shape {a.shape}, the state has {like.shape}")
            return jnp.asarray(a)
        width = like.shape[-1]
        if (not as_records and a.shape[1:] != (width,)) or a.shape[0] != max(1, rows):
            raise ValueError(f"{name}: shape {a.shape}, expected {max(1, rows)} live rows")
        if a.shape[0] > like.shape[0]:
            raise ValueError(f"{name}: {a.shape[0]} rows exceed the capacity {like.shape[0]}")
        bucket = _bucket(a.shape[0], like.shape[0])
        head = np.zeros((bucket, *a.shape[1:]), a.dtype)  # padded: one program a bucket
        head[: a.shape[0]] = a
        return _placed(head, np.int32(rows), capacity=like.shape[0], width=width,
                       rope=cfg.rope_dim, dtype=cfg.state_dtype if as_records else "f32",
                       index=name.endswith("_idx"))  # fmt: skip

    win = window(cfg)
    layers = []
    for i, tl in enumerate(template.layers):
        if tl.raw.shape[0] != win:
            raise ValueError("sliding window mismatch")
        kw = {}
        for f in ROW_FIELDS + FRONTIER_FIELDS:
            like = getattr(tl, f)
            if like is None:
                continue
            rows = live_rows(cfg, i, f, n, win) if f in ROW_FIELDS else None
            kw[f] = fill(f"l{i}_{f}", like, rows)
        layers.append(LayerState(**kw))
    return DecodeState(
        layers=tuple(layers),
        pos=jnp.asarray(n, jnp.int32),
        logits=fill("logits", template.logits, None),
    )
