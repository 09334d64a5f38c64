"""Which tokens may come next while a call's name is sampled under `tool_choice` any.

Why: `tool_choice` any (OpenAI's `required`) promises calls to the declared tools. The
server forces the call's opening up to `<｜DSML｜invoke name="`; with one tool it forces the
name too, but with several the model picks — and a model may name a tool it was never
offered (a small one often does), which the client cannot run. So while a call's name is
sampled (the forced one's and any further call's in the block), the row draws only among
the tokens that keep what it wrote a prefix of some declared `name">\\n`, and the name ends
exactly there: no token that runs on past the line's end (`">{`, `">$`, `">\\n\\n`), which
left the call's markup broken and the turn ending as text. The model's own distribution
over the declared names, no other.

`NameIndex` is built once per tokenizer (every ordinary token by its bytes); `allowed` is
pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from ds4jax.chat import specials
from ds4jax.chat.tokenizer_base import Tokenizer

#: what opens a DSML tag, a call's name in a block, and what closes the name
DSML_TAG = "<" + specials.DSML
NAME_OPEN = DSML_TAG + 'invoke name="'
NAME_END = '">\n'


class NameIndex:
    """Ordinary tokens (not the template's `special` ones) by their bytes."""

    def __init__(self, tokenizer: Tokenizer, special: frozenset[int]) -> None:
        self.tokenizer, self.special = tokenizer, special

    @cached_property
    def by_bytes(self) -> dict[bytes, list[int]]:
        """Built on first use (~0.3 s for 129k tokens; `Engine.warm_up` builds it)."""
        out: dict[bytes, list[int]] = {}
        for t in range(self.tokenizer.vocab_size):
            if t not in self.special:
                out.setdefault(self.tokenizer.token_bytes(t), []).append(t)
        return out


def targets(names: Sequence[str]) -> tuple[bytes, ...]:
    """What a sampled name must spell out, for each declared name."""
    return tuple((n + NAME_END).encode("utf-8") for n in names)


def allowed(index: NameIndex, written: bytes, goals: Sequence[bytes]) -> list[int]:
    """The tokens that may come next after `written` (the name's bytes so far): each keeps
    it a prefix of some goal (a whole goal at most). Sorted ids; none once a goal is
    spelled out."""
    if written in goals:
        return []
    out: set[int] = set()
    for goal in goals:
        if goal.startswith(written):
            rest = goal[len(written) :]
            for end in range(1, len(rest) + 1):
                out.update(index.by_bytes.get(rest[:end], ()))
    return sorted(out)
