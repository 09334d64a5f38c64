"""Sealed reasoning for the Responses API: `encrypted_content` that carries the exact sampled
reasoning, authenticated by a server key.

Codex sends `store: false` and replays every reasoning item it was given. Sealing the exact
text lets a stateless replay render the turn's reasoning byte for byte — after a restart
(the key lives in `--kv-disk-dir`) or a session switch — without trusting client text: a
forged or stale seal (another key) does not open, and the caller ignores it with a warning.
The seal authenticates, it does not hide: the reasoning is the client's to see anyway.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_FILE = "responses-reasoning.key"
_PREFIX = "ds4jax.r1."


class ReasoningSeal:
    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a reasoning seal key needs at least 16 bytes")
        self._key = key

    @classmethod
    def fresh(cls) -> ReasoningSeal:
        """A key for this process only: seals from before a restart no longer open."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def in_dir(cls, directory: str | os.PathLike[str]) -> ReasoningSeal:
        """The key kept in `directory` (created, readable by the owner only, on first use)."""
        path = Path(directory) / KEY_FILE
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            key = secrets.token_bytes(32)
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
            os.replace(tmp, path)
        return cls(key)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()

    def seal(self, reasoning: str) -> str:
        body = reasoning.encode("utf-8")
        return _PREFIX + base64.urlsafe_b64encode(self._mac(body) + body).decode("ascii")

    def open(self, sealed: str) -> str | None:
        """The reasoning a seal carries, or None when it is not one of this key's."""
        if not isinstance(sealed, str) or not sealed.startswith(_PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(sealed[len(_PREFIX) :].encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            return None
        mac, body = raw[:32], raw[32:]
        if len(mac) < 32 or not hmac.compare_digest(mac, self._mac(body)):
            return None
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            return None
