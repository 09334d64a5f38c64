"""`DiskStore`: decode-state checkpoints on disk, written with Orbax, found by the longest
rendered-text prefix (ds4's disk KV cache, spec ds4-server-behaviour.md §4).

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

Atomicity: a checkpoint is assembled complete in a `.tmp-…` directory (Orbax commits
`state/` there with its own tmp dir + rename) and renamed onto `DIR/<sha1>` as its last step,
so a crash at any point leaves either nothing or a whole checkpoint. Deletions rename to
`.tmp-…` first. Nothing is fsynced (as in ds4): after a power loss a renamed checkpoint may
hold short files, which the checksums catch at load.

Trust: nothing on disk is served unverified. A directory whose metadata does not parse, whose
`meta_sha1` or text sha1 (against its name and at lookup against the request) disagrees, or
whose payload is missing, is ignored and logged once. A checkpoint of another model (other
fingerprint) or that does not fit this context is skipped. `DiskHit.load()` checks every
Orbax file's size and CRC-32 before Orbax reads it, then the payload CRC-32 and the shapes
(checksums against corruption; the directory is 0700, nothing here defends against a
writer with access to it), and
raises `KVStoreError` on any failure (the engine then prefills cold); a checksum or size
mismatch also deletes the checkpoint, any other load failure only stops this process from
offering it again. A failed save (disk full included) is logged and
cleaned up; it never raises.

Budget: all well-formed checkpoints in the directory count (other models' too, like ds4);
after every save, and at startup, the lowest `policy.eviction_score` goes first, never the
checkpoint just written. A save whose estimated or final size does not fit the budget on its
own is skipped.

Tool memory: a checkpoint carries the entries (tool id → exact DSML block) of the tool memory
whose block occurs in its text. `DiskHit.tool_entries` holds them for the engine to remember
on a hit; `DiskStore.tool_entries()` collects them from every checkpoint of this model, for a
server to remember at startup, so that a client replaying a tool call after a restart renders
the sampled bytes (and so matches the checkpoint's text) before any lookup happens.

One process per directory: there is no locking between processes (ds4 relies on its instance
lock the same way).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ds4jax.chat import specials
from ds4jax.chat.segments import Segment, join, normalize, strip_prefix
from ds4jax.config import Config
from ds4jax.kvstore import policy
from ds4jax.kvstore.fingerprint import model_fingerprint
from ds4jax.kvstore.payload import crc_pool, digest, manifest, pack, payload_bytes, unpack
from ds4jax.kvstore.store import DiskHit, SaveReason, ToolEntries
from ds4jax.model.state import DecodeState, span_for, spans, window

log = logging.getLogger("ds4jax.kvstore")

#: 2: one payload array, zarr3, no compression; 3: rows in the state dtype (`payload`); 4:
#: rings with rewind room (`model.state`); a checkpoint of an older format is ignored with
#: a log line, never misread
FORMAT = "ds4jax-kv/4"
KEY_TOKEN_TEXT = "token-text"
REASONS = tuple(SaveReason)
TMP_PREFIX = ".tmp-"
META, USAGE, STATE = "meta.json", "usage.json", "state"
#: Orbax's own metadata files, added to the payload bytes when estimating a checkpoint
ORBAX_OVERHEAD = 64 * 1024
_NAME = re.compile(r"[0-9a-fA-F]{40}")
_MiB = 1024 * 1024


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


def tool_entries_in(text: str, tool_memory: ToolEntries | None) -> dict[str, str]:
    """The entries (tool id → DSML block) of `tool_memory` (a `ToolMemory` or a mapping)
    whose exact block occurs in `text`: every id of each such block (ds4 §2.7)."""
    if tool_memory is None:
        return {}
    items = list(tool_memory.items())
    open_tag = "<" + specials.DSML + "tool_calls>"
    close_tag = "</" + specials.DSML + "tool_calls>"
    if not items or open_tag not in text:
        return {}
    # a block is `<prefix><core>`, its core running from the opening tag to the closing one
    by_core: dict[str, dict[str, list[str]]] = {}
    loose: dict[str, list[str]] = {}
    for tid, block in items:
        k = block.find(open_tag)
        if k < 0 or not block.endswith(close_tag):
            loose.setdefault(block, []).append(tid)
        else:
            by_core.setdefault(block[k:], {}).setdefault(block[:k], []).append(tid)
    found: dict[str, str] = {}
    i = text.find(open_tag)
    while i >= 0:
        j = text.find(close_tag, i)
        if j < 0:
            break
        end = j + len(close_tag)
        for prefix, ids in by_core.get(text[i:end], {}).items():
            if i >= len(prefix) and text[i - len(prefix) : i] == prefix:
                found.update(dict.fromkeys(ids, prefix + text[i:end]))
        i = text.find(open_tag, end)
    for block, ids in loose.items():
        if block and block in text:
            found.update(dict.fromkeys(ids, block))
    return found


@dataclass
class _Entry:
    """One well-formed checkpoint, as the index keeps it (the rest stays in meta.json)."""

    key: str
    path: Path
    fingerprint: str
    tokens: int
    text_bytes: int
    window: int
    reason: str
    created: float
    size: int
    hits: int = 0
    last_used: float = 0.0

    def usage(self) -> policy.Usage:
        return policy.Usage(
            self.key, self.tokens, self.size, self.hits, self.created, self.last_used
        )


class DiskStore:
    """The disk checkpoint store (see the module docstring).

    `fingerprint` is the model identity (`model_fingerprint(cfg, params, tokenizer)`);
    checkpoints of any other are never served. `cfg` and `max_len` are the engine's: loaded
    states have the capacity of `init_state(cfg, max_len)`. `tokenizer` supplies the
    `<｜User｜>` / `<｜Assistant｜>` ids for the cold save point (without it the cold save
    uses the aligned length only).

    Policy (ds4's defaults): `min_tokens` for any save or hit; cold saves of cold prefills of
    `min_tokens..cold_max_tokens` tokens (`cold_cut`); `continued_every` (0 = never);
    `evict` and `shutdown` saves of the full live state; each reason can be switched off.
    `budget_mb` bounds the directory (0 = the default 4096 MiB).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fingerprint: str,
        *,
        cfg: Config,
        max_len: int,
        tokenizer: Any = None,
        budget_mb: float = policy.BUDGET_MB,
        min_tokens: int = policy.MIN_TOKENS,
        cold: bool = True,
        cold_max_tokens: int = policy.COLD_MAX_TOKENS,
        boundary_trim: int = policy.BOUNDARY_TRIM,
        boundary_align: int = policy.BOUNDARY_ALIGN,
        continued_every: int = policy.CONTINUED_EVERY,
        evict: bool = True,
        shutdown: bool = True,
        hit_half_life_s: float = policy.HIT_HALF_LIFE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.cfg = cfg
        self.max_len = max_len
        self.window = window(cfg)
        self.budget_bytes = int((budget_mb or policy.BUDGET_MB) * _MiB)
        self.min_tokens = max(1, min_tokens)
        self.cold_max_tokens = cold_max_tokens if cold else 0
        self.boundary_trim = boundary_trim
        self.boundary_align = boundary_align
        self.continued_every = max(0, continued_every)
        self.reasons = frozenset(
            r
            for r, on in (
                (SaveReason.COLD, self.cold_max_tokens > 0),
                (SaveReason.CONTINUED, self.continued_every > 0),
                (SaveReason.EVICT, evict),
                (SaveReason.SHUTDOWN, shutdown),
            )
            if on
        )
        self.hit_half_life_s = hit_half_life_s
        self.clock = clock
        self._user_id = self._assistant_id = None
        if tokenizer is not None:
            try:
                self._user_id = tokenizer.special_id(specials.USER)
                self._assistant_id = tokenizer.special_id(specials.ASSISTANT)
            except KeyError:
                self._user_id = self._assistant_id = None
        self._lock = threading.RLock()
        self._index: dict[str, _Entry] = {}
        self._ignored: set[str] = set()  # names already logged as not checkpoints
        self._bad: set[str] = set()  # checkpoints whose load failed in this process
        #: checkpoints written and loaded by this process (the server's metrics)
        self.saved = self.restored = 0
        self._make_directory()
        with self._lock:
            self._clean_tmp()
            self._refresh()
            self._evict(protect=None)
        log.info(
            "kv cache dir=%s checkpoints=%d size=%.1f MiB budget=%.0f MiB",
            self.directory,
            len(self._index),
            sum(e.size for e in self._index.values()) / _MiB,
            self.budget_bytes / _MiB,
        )

    @classmethod
    def for_model(
        cls,
        directory: str | os.PathLike[str],
        cfg: Config,
        params: Any,
        tokenizer: Any,
        *,
        max_len: int,
        **options: Any,
    ) -> DiskStore:
        """The store for this model: its fingerprint computed here."""
        return cls(
            directory,
            model_fingerprint(cfg, params, tokenizer),
            cfg=cfg,
            max_len=max_len,
            tokenizer=tokenizer,
            **options,
        )

    # ------------------------------------------------------------------ the directory

    def _make_directory(self) -> None:
        missing = []
        p = self.directory
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for d in reversed(missing):
            d.mkdir(mode=0o700, exist_ok=True)

    def _clean_tmp(self) -> None:
        """Leftovers of saves or deletions a crash interrupted."""
        for child in os.scandir(self.directory):
            if child.name.startswith(TMP_PREFIX):
                log.info("kv cache removed incomplete %s", child.path)
                if child.is_dir(follow_symlinks=False):
                    shutil.rmtree(child.path, ignore_errors=True)
                else:
                    Path(child.path).unlink(missing_ok=True)

    def _refresh(self) -> None:
        """Bring the index in line with the directory: new checkpoints are read and checked,
        vanished ones dropped. Called at startup and before every lookup and save."""
        seen: set[str] = set()
        try:
            children = list(os.scandir(self.directory))
        except OSError as err:
            log.warning("kv cache cannot list %s: %s", self.directory, err)
            return
        for child in children:
            if not _NAME.fullmatch(child.name) or not child.is_dir(follow_symlinks=False):
                continue
            key = child.name.lower()
            seen.add(key)
            if key in self._index or child.name in self._ignored:
                continue
            path = Path(child.path)
            try:
                meta = read_meta(path)
                entry = _Entry(
                    key=key,
                    path=path,
                    fingerprint=str(meta.get("fingerprint")),
                    tokens=int(meta["n_tokens"]),
                    text_bytes=int(meta["text_bytes"]),
                    window=int(meta.get("window", -1)),
                    reason=str(meta.get("reason")),
                    created=float(meta.get("created", 0.0)),
                    size=_dir_bytes(path),
                )
            except (OSError, ValueError, KeyError, TypeError) as err:
                self._ignored.add(child.name)
                log.warning("kv cache ignored %s: %s", path, err)
                continue
            entry.hits, entry.last_used = self._read_usage(path)
            if entry.fingerprint != self.fingerprint:
                log.info("kv cache ignores %s: another model's checkpoint", path)
            self._index[key] = entry
        for key in set(self._index) - seen:
            del self._index[key]
        self._ignored &= {c.name for c in children}

    @staticmethod
    def _read_usage(path: Path) -> tuple[int, float]:
        try:
            doc = json.loads((path / USAGE).read_bytes())
            return max(0, int(doc["hits"])), float(doc["last_used"])
        except Exception:
            return 0, 0.0

    def _touch(self, entry: _Entry, hit: bool) -> None:
        entry.hits += int(hit)
        entry.last_used = self.clock()
        try:
            _write_json(entry.path / USAGE, {"hits": entry.hits, "last_used": entry.last_used})
        except OSError as err:
            log.warning("kv cache could not update %s: %s", entry.path / USAGE, err)

    def _remove(self, entry: _Entry) -> None:
        """Delete a checkpoint: rename it out of sight first, so an interrupted deletion
        leaves a `.tmp-` directory (cleaned at startup), never a half checkpoint."""
        self._index.pop(entry.key, None)
        gone = self.directory / f"{TMP_PREFIX}del-{entry.key}-{secrets.token_hex(4)}"
        try:
            os.rename(entry.path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def _evict(self, protect: str | None) -> None:
        for u in policy.eviction_order(
            [e.usage() for e in self._index.values()],
            self.budget_bytes,
            self.clock(),
            protect,
            self.hit_half_life_s,
        ):
            entry = self._index[u.key]
            log.info(
                "kv cache evicted reason=disk-cache-full tokens=%d hits=%d size=%.2f MiB file=%s",
                entry.tokens,
                entry.hits,
                entry.size / _MiB,
                entry.path,
            )
            self._remove(entry)

    # ------------------------------------------------------------------ the KVStore protocol

    def cold_cut(self, tokens: tuple[int, ...], segments: tuple[Segment, ...]) -> int | None:
        """Where a cold prefill of `tokens` stops for its "cold" save: right before the last
        `<｜User｜>` token that precedes the first `<｜Assistant｜>` (the shared system prompt
        and tools), when that is at least `min_tokens` in; else `len − 32` aligned down to
        2048 when that is at least `min_tokens`; else the whole prompt (`len(tokens)`, saved
        after the prefill). None outside `min_tokens ≤ len ≤ cold_max_tokens`."""
        n = len(tokens)
        if SaveReason.COLD not in self.reasons or not self.min_tokens <= n <= self.cold_max_tokens:
            return None
        if self._user_id is not None and self._assistant_id is not None:
            anchor = policy.chat_anchor(tokens, self._user_id, self._assistant_id, self.min_tokens)
            if anchor is not None:
                return anchor
        return policy.store_len(n, self.min_tokens, self.boundary_trim, self.boundary_align)

    def lookup(self, segments: tuple[Segment, ...]) -> DiskHit | None:
        """The checkpoint of this model with the longest text that is a prefix of
        `segments`' (special tokens matching one for one), holding at least `min_tokens` and
        fewer than `max_len` tokens; ties go to more tokens. Cheap: the text sha1s are
        compared first, only the winner's metadata is read."""
        segments = normalize(segments)
        text = join(segments).encode()
        with self._lock:
            self._refresh()
            cands = [
                e
                for e in self._index.values()
                if e.fingerprint == self.fingerprint
                and e.key not in self._bad
                and e.text_bytes <= len(text)
                and self.min_tokens <= e.tokens < self.max_len
                and e.window == self.window
            ]
            if not cands:
                return None
            # sha1 of every candidate length of the request text, in one pass
            prefix_sha: dict[int, str] = {}
            h, done = hashlib.sha1(), 0
            for length in sorted({e.text_bytes for e in cands}):
                h.update(text[done:length])
                done = length
                prefix_sha[length] = h.copy().hexdigest()
            cands.sort(key=lambda e: (e.text_bytes, e.tokens), reverse=True)
            for e in cands:
                if prefix_sha[e.text_bytes] != e.key:
                    continue
                try:
                    meta = read_meta(e.path)
                    if meta.get("fingerprint") != self.fingerprint:
                        raise ValueError("fingerprint changed")
                    tokens = tuple(int(t) for t in meta["tokens"])
                    tool_entries = {
                        str(k): str(v) for k, v in (meta.get("tool_entries") or {}).items()
                    }
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                    self._bad.add(e.key)
                    log.warning("kv cache ignored %s: %s", e.path, err)
                    continue
                if strip_prefix(segments, meta["segments"]) is None:
                    continue  # same bytes, other special tokens: not this conversation
                return DiskHit(
                    key=e.key,
                    tokens=tokens,
                    segments=meta["segments"],
                    load=lambda e=e, meta=meta: self._load(e, meta),
                    tool_entries=tool_entries,
                )
            return None

    def _load(self, entry: _Entry, meta: dict[str, Any]) -> DecodeState:
        t0 = time.perf_counter()
        tokens = meta["tokens"]
        try:
            _verify_files(entry.path / STATE, meta.get("files"))
            arrays = _read_payload(entry.path / STATE, meta["arrays"])
            if digest(tokens, arrays) != meta.get("payload_crc32"):
                raise KVStoreError("payload checksum mismatch")
            # at the span of the tokens held, not the context's capacity (`model.state`)
            span = span_for(spans(self.cfg, self.max_len), len(tokens))
            state = unpack(arrays, len(tokens), self.cfg, span)
        except Exception as err:
            with self._lock:
                self._bad.add(entry.key)
                corrupt = isinstance(err, KVStoreError)
                log.warning(
                    "kv cache load failed tokens=%d file=%s: %s%s",
                    len(tokens),
                    entry.path,
                    err,
                    " (discarded)" if corrupt else "",
                )
                if corrupt:
                    self._remove(entry)
            raise KVStoreError(f"checkpoint {entry.key}: {err}") from err
        with self._lock:
            self._touch(entry, hit=True)
            self.restored += 1
        log.info(
            "kv cache hit tokens=%d key=%s reason=%s hits=%d load=%.0f ms",
            len(tokens),
            meta.get("key", KEY_TOKEN_TEXT),
            entry.reason,
            entry.hits,
            (time.perf_counter() - t0) * 1e3,
        )
        return state

    def save(
        self,
        tokens: tuple[int, ...],
        segments: tuple[Segment, ...],
        state: Any,
        reason: str,
        tool_memory: ToolEntries | None,
    ) -> None:
        """Persist `state` (exactly `tokens`) unless the policy says no; never raises: a
        failure is logged and the save skipped. An existing checkpoint of the same text and
        tokens is kept; only its tool entries are merged and its last use refreshed."""
        try:
            self._save(tokens, segments, state, reason, tool_memory)
        except Exception as err:
            log.warning("kv cache store failed (%s) tokens=%d: %s", reason, len(tokens), err)

    def _save(self, tokens, segments, state, reason, tool_memory) -> None:
        n = len(tokens)
        if reason not in self.reasons:
            return
        if n < self.min_tokens or n >= self.max_len:
            log.info("kv cache skipped tokens=%d reason=%s: outside %d..%d tokens",
                     n, reason, self.min_tokens, self.max_len - 1)  # fmt: skip
            return
        pos = int(state.pos)
        if pos != n:
            log.info("kv cache skipped tokens=%d reason=%s because live checkpoint is at %d",
                     n, reason, pos)  # fmt: skip
            return
        t0 = time.perf_counter()
        segments = normalize(segments)
        text = join(segments)
        key = sha1_hex(text.encode())
        entries = tool_entries_in(text, tool_memory)
        with self._lock:
            self._refresh()
            old = self._index.get(key)
            if old is not None:
                if self._keep_existing(old, tokens, segments, entries):
                    return
                log.info("kv cache replaced incompatible file %s", old.path)
                self._remove(old)
            arrays = pack(state, n, self.cfg)
            meta: dict[str, Any] = {
                "format": FORMAT,
                "sha1": key,
                "key": KEY_TOKEN_TEXT,
                "reason": reason,
                "created": self.clock(),
                "fingerprint": self.fingerprint,
                "n_tokens": n,
                "tokens": [int(t) for t in tokens],
                "text_bytes": len(text.encode()),
                "segments": [[s.text, s.special] for s in segments],
                "window": self.window,
                "max_len": self.max_len,
                "arrays": manifest(arrays),
                "payload_crc32": "0" * 8,  # computed while the payload is written
                "tool_entries": entries,
            }
            estimate = payload_bytes(arrays) + len(_canonical(meta)) + ORBAX_OVERHEAD
            if not policy.fits_budget(estimate, self.budget_bytes):
                log.warning(
                    "kv cache skipped tokens=%d reason=%s because estimated file size "
                    "%.2f MiB (%.2f MiB with safety) exceeds budget %.0f MiB",
                    n, reason, estimate / _MiB, estimate * 1.01 / _MiB,
                    self.budget_bytes / _MiB,
                )  # fmt: skip
                return
            final = self.directory / key
            tmp = self.directory / f"{TMP_PREFIX}{key}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                tmp.mkdir(mode=0o700)
                with ThreadPoolExecutor(1) as beside:
                    crc = beside.submit(digest, tokens, arrays)
                    _write_payload(tmp / STATE, arrays)
                    meta["payload_crc32"] = crc.result()
                meta["files"] = _file_manifest(tmp / STATE)
                meta["meta_sha1"] = _meta_digest(meta)
                _write_json(tmp / META, meta)
                _write_json(tmp / USAGE, {"hits": 0, "last_used": meta["created"]})
                size = _dir_bytes(tmp)
                if not policy.fits_budget(size, self.budget_bytes):
                    raise KVStoreError(
                        f"final file size {size / _MiB:.2f} MiB exceeds budget "
                        f"{self.budget_bytes / _MiB:.0f} MiB"
                    )
                os.rename(tmp, final)
            except Exception as err:  # disk full, permissions, Orbax: skip this save
                shutil.rmtree(tmp, ignore_errors=True)
                log.warning("kv cache store failed (%s) tokens=%d: %s", reason, n, err)
                return
            self._index[key] = _Entry(
                key=key,
                path=final,
                fingerprint=self.fingerprint,
                tokens=n,
                text_bytes=meta["text_bytes"],
                window=self.window,
                reason=reason,
                created=meta["created"],
                size=size,
                last_used=meta["created"],
            )
            self._bad.discard(key)
            self.saved += 1
            log.info(
                "kv cache stored tokens=%d reason=%s key=%s size=%.2f MiB save=%.0f ms",
                n, reason, KEY_TOKEN_TEXT, size / _MiB, (time.perf_counter() - t0) * 1e3,
            )  # fmt: skip
            self._evict(protect=key)

    def _keep_existing(
        self,
        old: _Entry,
        tokens: tuple[int, ...],
        segments: tuple[Segment, ...],
        entries: dict[str, str],
    ) -> bool:
        """The same checkpoint is already stored: merge the tool entries, refresh its last
        use, and keep it (True). False when it is not compatible (to be replaced)."""
        if old.fingerprint != self.fingerprint or old.key in self._bad:
            return False
        try:
            meta = read_meta(old.path)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if meta["segments"] != segments or tuple(meta["tokens"]) != tuple(tokens):
            return False
        merged = {**(meta.get("tool_entries") or {}), **entries}
        if merged != meta.get("tool_entries"):
            meta["segments"] = [[s.text, s.special] for s in segments]
            meta["tool_entries"] = merged
            meta["meta_sha1"] = _meta_digest(meta)
            try:
                _write_json(old.path / META, meta)
            except OSError as err:
                log.warning("kv cache could not update %s: %s", old.path / META, err)
        self._touch(old, hit=False)
        return True

    # ------------------------------------------------------------------ startup

    def tool_entries(self) -> dict[str, str]:
        """Every tool entry (id → exact DSML block) stored with this model's checkpoints,
        least recently used checkpoint first, so that remembering them in this order leaves
        the most recent ones the most recent in a `ToolMemory`. A server calls this once at
        startup: `for tid, block in store.tool_entries().items(): memory.remember([tid],
        block)`."""
        out: dict[str, str] = {}
        with self._lock:
            self._refresh()
            entries = sorted(
                (e for e in self._index.values() if e.fingerprint == self.fingerprint),
                key=lambda e: e.last_used or e.created,
            )
            for e in entries:
                try:
                    meta = read_meta(e.path)
                    stored = dict(meta.get("tool_entries") or {})
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                    log.warning("kv cache ignored %s: %s", e.path, err)
                    continue
                for tid, block in stored.items():
                    if isinstance(tid, str) and isinstance(block, str) and tid and block:
                        out.pop(tid, None)
                        out[tid] = block
        return out

    # ------------------------------------------------------------------ introspection

    def checkpoints(self) -> list[dict[str, Any]]:
        """The index, for logs and tests: key, tokens, reason, size, hits, fingerprint
        match."""
        with self._lock:
            self._refresh()
            return [
                {
                    "key": e.key,
                    "tokens": e.tokens,
                    "reason": e.reason,
                    "size": e.size,
                    "hits": e.hits,
                    "last_used": e.last_used,
                    "created": e.created,
                    "same_model": e.fingerprint == self.fingerprint,
                }
                for e in sorted(self._index.values(), key=lambda e: e.created)
            ]

    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._index.values())
