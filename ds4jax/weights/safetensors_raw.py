"""A small, self-contained safetensors reader and writer on numpy + ml_dtypes.

Why not `safetensors.safe_open(..., framework="numpy")`: it cannot return the FP8 dtypes the
official release uses (`F8_E4M3` weights, `F8_E8M0` scales) because numpy itself has no such
types. The format is simple enough to parse directly: an 8-byte little-endian header length,
a JSON header `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`
(offsets relative to the end of the header), then the raw little-endian data.

Every malformed input (short file, header length past the end, bad JSON, unknown dtype,
offsets outside the file or disagreeing with the shape) is a `CheckpointError` naming the
file and, where there is one, the tensor — a half-read checkpoint must never load.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ds4jax.weights.loading import CheckpointError, TensorSource

#: safetensors dtype names → numpy dtypes (ml_dtypes for the non-numpy float formats).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}

#: A header larger than this is treated as corrupt rather than read into memory.
MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: `start`/`end` are absolute byte offsets in `path`."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and validate a file's header; the data itself is not read."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
        n = int.from_bytes(raw, "little")
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors header "
                f"(declares {n} header bytes, file has {size})"
            )
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start, data_size = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, e in header.items():
        try:
            dtype, shape, (b, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            ok = all(isinstance(d, int) and d >= 0 for d in (*shape, b, end))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {e}")
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - b != want or not b <= end <= data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} has data offsets [{b}, {end}] but needs {want} bytes "
                f"within {data_size} data bytes (truncated or corrupt file)"
            )
        out[name] = TensorInfo(path, dtype, shape, data_start + b, data_start + end)
    return out


def read_tensor(info: TensorInfo, name: str = "?") -> np.ndarray:
    """One tensor as a fresh numpy array of its stored dtype."""
    count = info.end - info.start
    data = np.fromfile(info.path, dtype=np.uint8, count=count, offset=info.start)
    if data.size != count:
        raise CheckpointError(f"{info.path}: tensor {name!r} is truncated")
    return data.view(info.np_dtype.newbyteorder("<")).reshape(info.shape)


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write `tensors` (in order) to `path` atomically (tmp file + rename); returns the
    number of data bytes. Any dtype in `DTYPES` is accepted, FP8 included."""
    path = Path(path)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
        if a.dtype.itemsize > 1:
            a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header[name] = {
            "dtype": _NAMES[np.dtype(a.dtype.newbyteorder("="))],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
    return offset


class RawTensorSource(TensorSource):
    """`TensorSource` over safetensors files read with this module (any dtype, FP8 too).

    A name stored in two files, or an index that maps a name to a file lacking it, is a
    `CheckpointError`: either means the shards do not belong together."""

    def __init__(self, files: list[Path], weight_map: Mapping[str, str] | None = None) -> None:
        self._info: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_header(f).items():
                if name in self._info:
                    raise CheckpointError(
                        f"tensor {name!r} is stored in both {self._info[name].path} and {f}"
                    )
                self._info[name] = info
        for name, fname in (weight_map or {}).items():
            if name not in self._info or self._info[name].path.name != Path(fname).name:
                raise CheckpointError(f"index maps tensor {name!r} to {fname}, which lacks it")
        self._where = {k: v.path for k, v in self._info.items()}
        self.used: set[str] = set()

    def info(self, name: str) -> TensorInfo:
        return self._info[name]

    def get(self, name: str) -> np.ndarray:
        self.used.add(name)
        return read_tensor(self._info[name], name)
