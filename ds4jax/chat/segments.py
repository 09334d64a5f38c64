"""A rendered prompt as segments: the unit every tokenizer backend encodes.

Why segments and not a string: the official V4 tokenizer matches its added tokens anywhere
in the text it is given, so a user who types `<｜User｜>` would forge a turn boundary. The
renderer therefore marks each special token *it* inserts as its own segment; all other text,
client text and template prose alike, is encoded as plain text. Adjacent plain segments are
merged before encoding, so when client text holds no special strings the ids equal those the
official pipeline produces from the joined string (BPE is not additive across a cut).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ds4jax.chat.specials import TEMPLATE_SPECIALS


@dataclass(frozen=True, slots=True)
class Segment:
    text: str
    special: bool = False


def special(text: str) -> Segment:
    if text not in TEMPLATE_SPECIALS:
        raise ValueError(f"not a template special token: {text!r}")
    return Segment(text, True)


def template(text: str) -> list[Segment]:
    """Template-authored prose: the special strings inside it are real special tokens
    (the official tools block says `triggered by <think>`, and the official tokenizer
    encodes that `<think>` as the special id). Never pass client text here."""
    out: list[Segment] = []
    i = start = 0
    while i < len(text):
        for s in TEMPLATE_SPECIALS:
            if text.startswith(s, i):
                if start < i:
                    out.append(Segment(text[start:i]))
                out.append(Segment(s, True))
                i = start = i + len(s)
                break
        else:
            i += 1
    if start < len(text):
        out.append(Segment(text[start:]))
    return out


def join(segments: Iterable[Segment]) -> str:
    """The exact prompt string: what disk keys and text-prefix matching compare."""
    return "".join(s.text for s in segments)


def merged(segments: Iterable[Segment]) -> Iterator[Segment]:
    """Coalesce adjacent plain segments and drop empty ones."""
    buf: list[str] = []
    for seg in segments:
        if seg.special:
            if buf:
                yield Segment("".join(buf))
                buf = []
            yield seg
        elif seg.text:
            buf.append(seg.text)
    if buf:
        yield Segment("".join(buf))


def normalize(segments: Iterable[Segment]) -> tuple[Segment, ...]:
    return tuple(merged(segments))


def strip_prefix(
    segments: tuple[Segment, ...], prefix: tuple[Segment, ...]
) -> tuple[Segment, ...] | None:
    """The rest of `segments` after `prefix`, or None when `prefix` is not a prefix.

    Both must be normalized. Special tokens must match one for one; the prefix's last plain
    segment may end inside a plain segment of `segments` (text continues after it). A plain
    segment is never matched against a special one: typed `<｜User｜>` is not a turn."""
    if len(prefix) > len(segments):
        return None
    for i, p in enumerate(prefix):
        s = segments[i]
        if s.special != p.special:
            return None
        last = i == len(prefix) - 1
        if p.special or not last:
            if s != p:
                return None
            continue
        if not s.text.startswith(p.text):
            return None
        head = s.text[len(p.text) :]
        return ((Segment(head),) if head else ()) + segments[i + 1 :]
    return segments[len(prefix) :]
