"""`DiskStore`: decode-state checkpoints on disk, written with Orbax, found by the longest
rendered-text prefix (ds4's disk KV cache, spec ds4-server-behaviour.md §4). What one
checkpoint's files are and how they are checked is `checkpoint` (the layout is described
there), the store's view of its directory `index`; here is what the store decides: what to
look up, load, save and evict, and what it promises about each.

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
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ds4jax.chat import specials
from ds4jax.chat.segments import Segment, join, normalize, strip_prefix
from ds4jax.config import Config
from ds4jax.kvstore import policy
from ds4jax.kvstore.checkpoint import (
    FORMAT,
    KEY_TOKEN_TEXT,
    META,
    ORBAX_OVERHEAD,
    STATE,
    TMP_PREFIX,
    USAGE,
    KVStoreError,
    _canonical,
    _dir_bytes,
    _file_manifest,
    _meta_digest,
    _read_payload,
    _verify_files,
    _write_json,
    _write_payload,
    read_meta,
    sha1_hex,
)
from ds4jax.kvstore.fingerprint import model_fingerprint
from ds4jax.kvstore.index import Entry, Index
from ds4jax.kvstore.payload import digest, manifest, pack, payload_bytes, unpack
from ds4jax.kvstore.store import DiskHit, SaveReason, ToolEntries
from ds4jax.kvstore.tool_entries import tool_entries_in
from ds4jax.model.state import DecodeState, span_for, spans, window

log = logging.getLogger("ds4jax.kvstore")

REASONS = tuple(SaveReason)
_MiB = 1024 * 1024


#: directories this process holds (`_hold_directory`): its own stores may reopen them
_HELD: dict[str, int] = {}


def _hold_directory(directory: Path) -> int:
    """One server per directory: two saved the same text into each other's temporary
    directories, and one's start-up cleanup removed the other's save in progress. The
    directory itself is locked (no file added to it), for the life of the process (a
    crash frees it); stores this process opens again share its lock."""
    import fcntl

    key = str(directory.resolve())
    if key in _HELD:
        return _HELD[key]
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        os.close(fd)
        raise KVStoreError(f"{directory} is in use by another ds4jax serve (one server per "
                           "--kv-disk-dir)") from err  # fmt: skip
    _HELD[key] = fd
    return fd


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
    `budget_mb` bounds the directory (0 = the default 4096 MiB; `serve` refuses < 1).
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
        self._index = Index(self.directory, fingerprint)
        self._bad: set[str] = set()  # checkpoints whose load failed in this process
        #: checkpoints written, loaded, and saves that failed, in this process (the
        #: server's metrics: a failing disk shows there, not only in the log)
        self.saved = self.restored = self.failed = 0
        self._index.make_directory()
        self._hold = _hold_directory(self.directory)
        with self._lock:
            self._index.clean_tmp()
            self._index.refresh()
            self._evict(protect=None)
        log.info(
            "kv cache dir=%s checkpoints=%d size=%.1f MiB budget=%.0f MiB",
            self.directory,
            len(self._index.entries),
            sum(e.size for e in self._index.entries.values()) / _MiB,
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

    # ------------------------------------------------------------------ the budget

    def _evict(self, protect: str | None) -> None:
        for u in policy.eviction_order(
            [e.usage() for e in self._index.entries.values()],
            self.budget_bytes,
            self.clock(),
            protect,
            self.hit_half_life_s,
        ):
            entry = self._index.entries[u.key]
            log.info(
                "kv cache evicted reason=disk-cache-full tokens=%d hits=%d size=%.2f MiB file=%s",
                entry.tokens,
                entry.hits,
                entry.size / _MiB,
                entry.path,
            )
            self._index.remove(entry)

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
            self._index.refresh()
            cands = [
                e
                for e in self._index.entries.values()
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

    def _load(self, entry: Entry, meta: dict[str, Any]) -> DecodeState:
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
                    self._index.remove(entry)
            raise KVStoreError(f"checkpoint {entry.key}: {err}") from err
        with self._lock:
            self._index.touch(entry, hit=True, now=self.clock())
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
            self.failed += 1
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
            self._index.refresh()
            old = self._index.entries.get(key)
            if old is not None:
                if self._keep_existing(old, tokens, segments, entries):
                    return
                log.info("kv cache replaced incompatible file %s", old.path)
                self._index.remove(old)
            elif self._index.remove_damaged(key):
                log.info("kv cache replaces the damaged checkpoint %s", self.directory / key)
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
                self.failed += 1
                log.warning("kv cache store failed (%s) tokens=%d: %s", reason, n, err)
                return
            self._index.entries[key] = Entry(
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
        old: Entry,
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
        self._index.touch(old, hit=False, now=self.clock())
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
            self._index.refresh()
            entries = sorted(
                (e for e in self._index.entries.values() if e.fingerprint == self.fingerprint),
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
            self._index.refresh()
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
                for e in sorted(self._index.entries.values(), key=lambda e: e.created)
            ]

    def total_bytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._index.entries.values())
