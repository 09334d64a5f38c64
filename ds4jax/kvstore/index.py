"""The store's picture of its directory: which checkpoints are there, with their size and
use, kept in line with what is on disk. Apart from `disk.DiskStore` because it only mirrors
the directory (scan, count use, delete) and decides nothing: what to serve, save or evict is
the store's, and the store calls all of this under its own lock.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from ds4jax.kvstore import policy
from ds4jax.kvstore.checkpoint import TMP_PREFIX, USAGE, _dir_bytes, _write_json, read_meta

log = logging.getLogger("ds4jax.kvstore")

#: a checkpoint directory's name: the sha1 of its text (uppercase accepted on read)
_NAME = re.compile(r"[0-9a-fA-F]{40}")


@dataclass
class Entry:
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


def _read_usage(path: Path) -> tuple[int, float]:
    try:
        doc = json.loads((path / USAGE).read_bytes())
        return max(0, int(doc["hits"])), float(doc["last_used"])
    except Exception:
        return 0, 0.0


class Index:
    """The well-formed checkpoints of `directory` by key (`entries`), refreshed from the
    directory before every lookup and save. `fingerprint` only tells which ones to log as
    another model's."""

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.entries: dict[str, Entry] = {}
        self._ignored: set[str] = set()  # names already logged as not checkpoints

    def make_directory(self) -> None:
        missing = []
        p = self.directory
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for d in reversed(missing):
            d.mkdir(mode=0o700, exist_ok=True)

    def clean_tmp(self) -> None:
        """Leftovers of saves or deletions a crash interrupted."""
        for child in os.scandir(self.directory):
            if child.name.startswith(TMP_PREFIX):
                log.info("kv cache removed incomplete %s", child.path)
                if child.is_dir(follow_symlinks=False):
                    shutil.rmtree(child.path, ignore_errors=True)
                else:
                    Path(child.path).unlink(missing_ok=True)

    def refresh(self) -> None:
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
            if key in self.entries or child.name in self._ignored:
                continue
            path = Path(child.path)
            try:
                meta = read_meta(path)
                entry = Entry(
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
            entry.hits, entry.last_used = _read_usage(path)
            if entry.fingerprint != self.fingerprint:
                log.info("kv cache ignores %s: another model's checkpoint", path)
            self.entries[key] = entry
        for key in set(self.entries) - seen:
            del self.entries[key]
        self._ignored &= {c.name for c in children}

    def touch(self, entry: Entry, hit: bool, now: float) -> None:
        entry.hits += int(hit)
        entry.last_used = now
        try:
            _write_json(entry.path / USAGE, {"hits": entry.hits, "last_used": entry.last_used})
        except OSError as err:
            log.warning("kv cache could not update %s: %s", entry.path / USAGE, err)

    def remove(self, entry: Entry) -> None:
        """Delete a checkpoint: rename it out of sight first, so an interrupted deletion
        leaves a `.tmp-` directory (cleaned at startup), never a half checkpoint."""
        self.entries.pop(entry.key, None)
        self._delete(entry.key, entry.path)

    def remove_damaged(self, key: str) -> bool:
        """Delete the directory of `key` that `refresh` ignored as unreadable (a damaged
        checkpoint: else its key could never be saved again, the save's rename blocked by
        it); True when there was one."""
        path = self.directory / key
        names = {n for n in self._ignored if n.lower() == key}
        if not names or not path.is_dir():
            return False
        self._ignored -= names
        self._delete(key, path)
        return True

    def _delete(self, key: str, path: Path) -> None:
        gone = self.directory / f"{TMP_PREFIX}del-{key}-{secrets.token_hex(4)}"
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)
