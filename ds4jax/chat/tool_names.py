"""Which tokens may come next while a forced tool call's name is sampled.

Why: `tool_choice` any (OpenAI's `required`) promises a call to one of the declared tools.
The server forces the call's opening up to `<｜DSML｜invoke name="`; with one tool it forces
the name too, but with several the model picks — and a model may name a tool it was never
offered (a small one often does), which the client cannot run. So while the name is
sampled, the row draws only among the tokens that keep what it wrote a prefix of some
declared `name">` (or complete one and run on past it, as a `">\\n` token does): the
model's own distribution over the declared names, no other.

`NameIndex` is built once per tokenizer (every ordinary token's bytes, sorted, so the
tokens that begin with a given string are one bisected range); `allowed` is pure.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from functools import cached_property

from ds4jax.chat.tokenizer_base import Tokenizer

#: what closes a name in the DSML call opening (`invoke name="…">`)
NAME_END = '">'


class NameIndex:
    """Ordinary tokens (not the template's `special` ones) by their bytes: the ids of a
    given byte string, and the tokens whose bytes begin with one."""

    def __init__(self, tokenizer: Tokenizer, special: frozenset[int]) -> None:
        self.tokenizer, self.special = tokenizer, special

    @cached_property
    def _sorted(self) -> tuple[list[bytes], list[int]]:
        """Built on first use (~0.3 s for 129k tokens), never for a server that forces no
        choice among names."""
        tok = self.tokenizer
        pairs = sorted((tok.token_bytes(t), t) for t in range(tok.vocab_size)
                       if t not in self.special)  # fmt: skip
        return [b for b, _ in pairs], [t for _, t in pairs]

    def exact(self, piece: bytes) -> list[int]:
        """The tokens whose bytes are `piece`."""
        keys, ids = self._sorted
        lo = bisect.bisect_left(keys, piece)
        hi = bisect.bisect_right(keys, piece)
        return ids[lo:hi]

    def starting_with(self, head: bytes) -> list[int]:
        """The tokens whose bytes begin with `head` (`head` itself too)."""
        keys, ids = self._sorted
        lo = bisect.bisect_left(keys, head)
        hi = lo
        while hi < len(keys) and keys[hi].startswith(head):
            hi += 1
        return ids[lo:hi]


def targets(names: Sequence[str]) -> tuple[bytes, ...]:
    """What the sampled name must spell out, for each declared name."""
    return tuple((n + NAME_END).encode("utf-8") for n in names)


def finished(written: bytes, goals: Sequence[bytes]) -> bool:
    """Whether `written` spells out a whole declared name and its close."""
    return any(written.startswith(g) for g in goals)


def allowed(index: NameIndex, written: bytes, goals: Sequence[bytes]) -> list[int]:
    """The tokens that may come next after `written` (the name's bytes so far): each keeps
    it a prefix of some goal, or completes one (and may run on past it). Sorted ids."""
    out: set[int] = set()
    for goal in goals:
        if not goal.startswith(written):
            continue
        rest = goal[len(written) :]
        for end in range(1, len(rest)):
            out.update(index.exact(rest[:end]))
        out.update(index.starting_with(rest))
    return sorted(out)
