"""The interface every tokenizer backend implements, on its own so backends can import it.

`ds4jax.chat.tokenizer` loads a backend by file type (`load_tokenizer`), so it imports
`ds4jax.chat.spm_tokenizer`; the SentencePiece backend subclasses `Tokenizer`. With the
interface in the loader's module the two imported each other; here, both import it and
nothing imports back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from functools import cached_property

from ds4jax.chat import specials
from ds4jax.chat.segments import Segment, merged


class Tokenizer(ABC):
    """Common interface. Subclasses provide the four abstract primitives; encoding of
    segments, decoding and special-id lookup are shared here so they exist once."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Plain text to ids. Special-token strings inside `text` stay plain text."""

    @abstractmethod
    def token_to_id(self, piece: str) -> int | None:
        """Id of a whole token string (special or not), or None."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes this token contributes to the decoded text (may be a partial
        character)."""

    @abstractmethod
    def piece(self, token_id: int) -> str:
        """The vocabulary entry as stored (byte-mapped or `▁`-spaced), for display."""

    def special_id(self, text: str) -> int:
        tid = self.token_to_id(text)
        if tid is None:
            raise KeyError(f"tokenizer has no special token {text!r}")
        return tid

    @cached_property
    def bos_id(self) -> int:
        return self.special_id(specials.BOS)

    @cached_property
    def eos_id(self) -> int:
        return self.special_id(specials.EOS)

    def encode_segments(self, segments: Iterable[Segment]) -> list[int]:
        ids: list[int] = []
        for seg in merged(segments):
            if seg.special:
                ids.append(self.special_id(seg.text))
            else:
                ids.extend(self.encode_text(seg.text))
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
