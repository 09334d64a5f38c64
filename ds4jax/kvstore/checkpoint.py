"""One disk checkpoint as files: the directory layout, `meta.json` and its checks, and the
Orbax payload with the checksums that guard it. Kept apart from `disk.DiskStore` because the
format is what a checkpoint written by another process or an older build must still match,
while the store's choices (what to look up, save and evict) change freely around it.

Layout (`directory` is created 0700; one directory per checkpoint)::

    DIR/<sha1 of the rendered text>/     40 lowercase hex (uppercase accepted on read)
        state/       Orbax tree of one byte array, `payload` (zarr3, 16 MiB chunks, no
                     compression): the arrays `logits` [vocab] and `l{i}_{field}` per
                     layer, live rows only (payload.py), laid end to end in name order
                     (64-byte aligned); rebuilt into `init_state(cfg, max_len)` on load
        meta.json    format, sha1, key kind, save reason, created, model fingerprint,
                     token ids, rendered text as segments (text + special flag), sliding
                     window, array manifest, payload CRC-32 (token ids + each array's
                     CRC-32), the Orbax files with their sizes and the CRC-32 of each
                     16 MiB piece, tool entries, and `meta_sha1` over all of it
        usage.json   hits and last use (rewritten by tmp file + rename on every hit)
    DIR/.tmp-<sha1>-<pid>-<hex>/         a save in progress (or a deletion); removed at
                                         startup, never read

What is checked where: `read_meta` is the check a directory must pass to be indexed or
looked up at all; `_verify_files` and the payload CRC-32 are checked on load, before and after
Orbax reads the payload (`disk` says what happens on a failure).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ds4jax.chat.segments import Segment, join
from ds4jax.kvstore.payload import crc_pool, manifest

#: 2: one payload array, zarr3, no compression; 3: rows in the state dtype (`payload`); 4:
#: rings with rewind room (`model.state`); a checkpoint of an older format is ignored with
#: a log line, never misread
FORMAT = "ds4jax-kv/4"
KEY_TOKEN_TEXT = "token-text"
TMP_PREFIX = ".tmp-"
META, USAGE, STATE = "meta.json", "usage.json", "state"
#: Orbax's own metadata files, added to the payload bytes when estimating a checkpoint
ORBAX_OVERHEAD = 64 * 1024


class KVStoreError(RuntimeError):
    """A checkpoint that cannot be served."""


def sha1_hex(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def _meta_digest(meta: Mapping[str, Any]) -> str:
    return sha1_hex(_canonical({k: v for k, v in meta.items() if k != "meta_sha1"}))


def _segments_from_json(raw: Any) -> tuple[Segment, ...]:
    if not isinstance(raw, list):
        raise ValueError("segments are not a list")
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError("bad segment")
        out.append(Segment(item[0], bool(item[1])))
    return tuple(out)


def read_meta(path: Path) -> dict[str, Any]:
    """The verified metadata of the checkpoint directory `path`; ValueError (or OSError)
    saying why it is not a checkpoint."""
    try:
        meta = json.loads((path / META).read_bytes())
    except json.JSONDecodeError as err:
        raise ValueError(f"unreadable {META}: {err}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"unreadable {META}: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} checkpoint")
    if meta.get("meta_sha1") != _meta_digest(meta):
        raise ValueError("metadata checksum mismatch")
    segments = _segments_from_json(meta.get("segments"))
    text = join(segments).encode()
    if sha1_hex(text) != meta.get("sha1") or meta["sha1"] != path.name.lower():
        raise ValueError("text hash mismatch")
    tokens = meta.get("tokens")
    if not isinstance(tokens, list) or not tokens or len(tokens) != meta.get("n_tokens"):
        raise ValueError("bad token ids")
    if meta.get("text_bytes") != len(text):
        raise ValueError("bad text length")
    if not (path / STATE).is_dir():
        raise ValueError("no payload")
    meta["segments"] = segments
    return meta


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """Whole or not at all: a tmp file beside it, then rename."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(json.dumps(doc, ensure_ascii=False).encode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _checkpointer() -> Any:
    """A synchronous Orbax checkpointer (no commit thread) of the payload, tuned for
    throughput (issue 17; `bench/disk.py` measures it against raw I/O): zarr3 without
    compression (zstd saved 11% of a state's bytes and cut reads from 1,862 to 723 MB/s
    in one comparison run), without OCDBT (one writer, one array: nothing to aggregate), and
    without Orbax's copy of host arrays.
    Across processes only process 0 touches the disk (`ds4jax.distributed`: the others get
    loaded states by broadcast), so Orbax is told that process 0 alone takes part: no
    barrier waits for processes that never save."""
    import jax
    import orbax.checkpoint as ocp

    # the payload is written synchronously and never changed meanwhile: Orbax's defensive
    # copy of a host array (half the save time of a 250 MB payload here) is not needed
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False))
    )
    kw: dict[str, Any] = dict(use_ocdbt=False, use_zarr3=True, use_compression=False,
                              type_handler_registry=registry)  # fmt: skip
    if jax.process_count() > 1:
        alone = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
        return ocp.Checkpointer(
            ocp.PyTreeCheckpointHandler(multiprocessing_options=alone, **kw),
            multiprocessing_options=alone,
        )
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kw))


#: the payload is one byte array, in chunks of this size: Orbax's per-array cost is paid
#: once, not for each of a model's few hundred state arrays, and two threads read and write
#: the chunks (16 MiB measured best of 4–64 MiB here)
CHUNK_BYTES = 16 << 20
_ALIGN = 64


def _layout(arrays: Mapping[str, Any]) -> tuple[dict[str, tuple[int, int, tuple, Any]], int]:
    """Where each array (a manifest entry: shape and dtype) sits in the payload bytes, in
    name order: name → (offset, bytes, shape, dtype); and the total size."""
    out, end = {}, 0
    for name in sorted(arrays):
        shape, dtype = tuple(arrays[name]["shape"]), np.dtype(jnp.dtype(arrays[name]["dtype"]))
        nbytes = int(np.prod(shape)) * dtype.itemsize
        out[name] = (end, nbytes, shape, dtype)
        end += -(-nbytes // _ALIGN) * _ALIGN
    return out, max(end, _ALIGN)


def _write_payload(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    import orbax.checkpoint as ocp

    layout, total = _layout(manifest(arrays))
    flat = np.zeros(total, np.uint8)
    for name, (off, nbytes, _shape, _dtype) in layout.items():
        flat[off : off + nbytes] = np.ascontiguousarray(arrays[name]).reshape(-1).view(np.uint8)
    ck = _checkpointer()
    try:
        ck.save(path, args=ocp.args.PyTreeSave(
            {"payload": flat}, save_args={"payload": ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)}
        ))  # fmt: skip
    finally:
        ck.close()


def _piece_crcs(path: Path) -> list[str]:
    """CRC-32 of each `CHUNK_BYTES` piece of a file."""
    out = []
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            out.append(f"{zlib.crc32(chunk):08x}")
    return out


def _file_manifest(root: Path) -> dict[str, list]:
    """Every file under `root` (an Orbax checkpoint): relative path → [bytes, CRC-32 of each
    16 MiB piece]. Files are checksummed side by side (zlib releases the GIL)."""
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    with crc_pool() as pool:
        crcs = list(pool.map(_piece_crcs, paths))
    return {
        p.relative_to(root).as_posix(): [p.stat().st_size, c]
        for p, c in zip(paths, crcs, strict=True)
    }


def _verify_files(root: Path, files: Any) -> None:
    """The payload files are exactly those written: checked before Orbax reads a byte, so a
    truncated or altered file is reported as such (and Orbax never parses it)."""
    if not isinstance(files, dict) or not files:
        raise KVStoreError("no payload file list")
    for rel, (size, _crcs) in files.items():
        p = root / rel
        if not p.is_file() or p.stat().st_size != size:
            raise KVStoreError(f"payload file {rel} is missing or truncated")
    with crc_pool() as pool:
        found = list(pool.map(_piece_crcs, (root / rel for rel in files)))
    for (rel, (_size, crcs)), crc in zip(files.items(), found, strict=True):
        if crc != crcs:
            raise KVStoreError(f"payload file {rel} checksum mismatch")


def _read_payload(path: Path, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a manifest, as views of the one payload array Orbax reads back."""
    import orbax.checkpoint as ocp

    layout, total = _layout(arrays)
    ck = _checkpointer()
    try:
        out = ck.restore(path, args=ocp.args.PyTreeRestore(
            {"payload": np.empty(total, np.uint8)},
            restore_args={"payload": ocp.RestoreArgs(restore_type=np.ndarray)},
        ))  # fmt: skip
    finally:
        ck.close()
    flat = np.asarray(out["payload"])
    if flat.shape != (total,):
        raise KVStoreError(f"payload of {flat.size} bytes, the manifest needs {total}")
    return {
        name: flat[off : off + nbytes].view(dtype).reshape(shape)
        for name, (off, nbytes, shape, dtype) in layout.items()
    }
