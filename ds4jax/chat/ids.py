"""Tool-call ids, minted where the wire shapes that carry them are built.

An id is part of what a client sends back and what the prompt renders, so the rendering
layer owns it: the Anthropic translation fills ids a sampled turn did not get, the HTTP
shim names a streamed call before the engine has bound one, and the decoding loop binds
the ids the tool memory remembers. Putting the minting here keeps all of them from
reaching up into `ds4jax.continuation` for it.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections.abc import Callable, Iterable


def new_tool_id(
    taken: Iterable[str] = (),
    prefix: str = "toolu_",
    token_hex: Callable[[int], str] = secrets.token_hex,
) -> str:
    """`prefix` (`toolu_` for Anthropic, `call_` for the OpenAI protocols) + 32 hex
    characters from `token_hex` (`secrets`, or a request's `id_stream`), unique among
    `taken`."""
    taken = set(taken)
    while True:
        tid = prefix + token_hex(16)
        if tid not in taken:
            return tid


def id_stream(key: bytes) -> Callable[[int], str]:
    """Hex drawn from a request's secret `key` (keyed BLAKE2b of a counter): as unguessable
    as `secrets` to anyone without the key, and the same in every process that was handed
    the request, so every process of a multi-host group binds the same tool ids."""
    counter = itertools.count()

    def token_hex(nbytes: int) -> str:
        msg = next(counter).to_bytes(8, "little")
        return hashlib.blake2b(msg, key=key, digest_size=nbytes).hexdigest()

    return token_hex
