"""SentencePiece backend for small research vocabularies, and its trainer.

`SpmTokenizer` implements `ds4jax.chat.tokenizer_base.Tokenizer` over a SentencePiece `.model`;
`train_spm` trains one whose special tokens sit where V4 has them (BOS id 0, EOS id 1) and
whose plain text round-trips byte for byte.

Pitfalls this module exists to get around:

* `▁` (U+2581) is SentencePiece's space symbol, and DeepSeek's special strings contain it.
  `sp.decode` turns every `▁` into a space, so `<｜end▁of▁sentence｜>` decodes to
  `<｜end of sentence｜>`. We never use `sp.decode`: decoding goes through `token_bytes`,
  which is built from `id_to_piece` and the piece's type.
* A literal `▁` in client text is indistinguishable from a space once SentencePiece has
  escaped whitespace, and would come back as a space. `encode_text` therefore never hands a
  `▁` to SentencePiece; each one is emitted as its three UTF-8 byte-fallback pieces
  (`<0xE2><0x96><0x81>`), which decode back to `▁`.
* User-defined symbols (the DS4 specials `<｜User｜>`, `<think>`, ...) are matched anywhere in
  the input, so client text could forge a turn boundary. `encode_text` cuts the text around
  every such special and encodes each occurrence as ordinary pieces (its first
  character on its own, the rest recursively), so no user-defined id can come out of it.
  Special ids only enter a prompt through `Tokenizer.special_id`, from template segments.
  Other user-defined pieces are word symbols (`train_spm(symbols=...)`): plain text, which
  SentencePiece emits wherever the word occurs and which decode with `▁` as a space.
* Round-tripping needs `normalization_rule_name="identity"`, `remove_extra_whitespaces=False`,
  `add_dummy_prefix=False` and byte fallback at training time. `SpmTokenizer` checks a model
  for these on load (by round-tripping a probe string) instead of trusting it.

The SentencePiece Python API cannot tell a user-defined piece from a normal one, so the
piece types are read straight from the serialized `ModelProto` with a tiny protobuf wire
reader (no dependency on `protobuf`).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from ds4jax.chat import specials
from ds4jax.chat.tokenizer_base import Tokenizer

__all__ = ["SpmTokenizer", "train_spm"]

# `ModelProto.SentencePiece.Type` values (sentencepiece_model.proto).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")
_DS4_SPECIALS = frozenset(specials.TEMPLATE_SPECIALS)
#: Round-tripped on load: catches NFKC-style normalization (`ﬁ`, fullwidth `Ａ`, ideographic
#: space), whitespace collapsing, a dummy `▁` prefix and a missing byte fallback.
_PROBE = "  a\u3000b ﬁＡ\t\n\x00▁z🦜 " + specials.USER


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _wire_fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) for each field of one protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in SentencePiece model")
        yield field, wire, value


def _piece_types(model_proto: bytes) -> list[int]:
    """The `type` of every piece, in id order (`ModelProto.pieces` is field 1, and a
    piece's `type` is its field 3, NORMAL when absent)."""
    types: list[int] = []
    for field, wire, value in _wire_fields(model_proto):
        if field == 1 and wire == 2:
            assert isinstance(value, bytes)
            kind = _NORMAL
            for f, w, v in _wire_fields(value):
                if f == 3 and w == 0:
                    assert isinstance(v, int)
                    kind = v
            types.append(kind)
    return types


class SpmTokenizer(Tokenizer):
    """A SentencePiece `.model` behind the `Tokenizer` interface.

    Raises ValueError on load if the model cannot round-trip text (trained without byte
    fallback, or with normalization, whitespace collapsing or a dummy prefix): every caller
    above relies on `decode(encode_text(s)) == s`."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no SentencePiece model at {path}")
        self.path = path
        # Plain processor: no bos/eos added, no sampling, no reversal.
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        n = self._sp.get_piece_size()
        types = _piece_types(self._sp.serialized_model_proto())
        if len(types) != n:
            raise ValueError(f"{path}: read {len(types)} piece types for {n} pieces")
        self._pieces = [self._sp.id_to_piece(i) for i in range(n)]
        self._ids = {p: i for i, p in enumerate(self._pieces)}

        self._byte_ids: dict[int, int] = {}
        self._bytes: list[bytes] = []
        user_defined: list[str] = []
        symbols: list[str] = []
        for i, (p, kind) in enumerate(zip(self._pieces, types, strict=True)):
            if kind == _BYTE:
                m = _BYTE_PIECE.fullmatch(p)
                if m is None:
                    raise ValueError(f"{path}: byte piece {p!r} (id {i}) is not <0xHH>")
                self._byte_ids[int(m.group(1), 16)] = i
                out = bytes([int(m.group(1), 16)])
            elif kind == _USER_DEFINED and p in _DS4_SPECIALS:
                user_defined.append(p)
                out = p.encode("utf-8")  # matched verbatim from input: no `▁` → space
            elif kind == _USER_DEFINED:
                # a word symbol (`train_spm(symbols=...)`): plain text, SentencePiece emits it
                symbols.append(p.replace(_SPACE, " "))
                out = symbols[-1].encode("utf-8")
            elif kind == _CONTROL:
                # DS4 BOS/EOS decode to their strings, as in `V4Tokenizer`; other control
                # tokens (a pad, say) contribute nothing.
                out = p.encode("utf-8") if p in _DS4_SPECIALS else b""
            elif kind == _UNKNOWN:
                # Never produced by `encode_text` (byte fallback); if a model samples it,
                # show that something is missing rather than dropping it silently.
                out = "\ufffd".encode()
            else:  # NORMAL, UNUSED
                out = p.replace(_SPACE, " ").encode("utf-8")
            self._bytes.append(out)
        if len(self._byte_ids) != 256:
            raise ValueError(
                f"{path}: has {len(self._byte_ids)} of 256 byte-fallback pieces; "
                "train with byte_fallback=True (see train_spm) so any text round-trips"
            )
        #: the protected specials: never produced from plain text
        self.user_defined: tuple[str, ...] = tuple(user_defined)
        #: word symbols: always one piece in plain text
        self.symbols: tuple[str, ...] = tuple(symbols)
        # Longest first, so at a given position the longest symbol wins; `▁` is cut out too.
        cut = sorted({*user_defined, _SPACE}, key=len, reverse=True)
        self._cut = re.compile("|".join(re.escape(s) for s in cut))

        got = self.decode(self.encode_text(_PROBE))
        if got != _PROBE:
            raise ValueError(
                f"{path}: text does not round-trip ({_PROBE!r} -> {got!r}); train with "
                'normalization_rule_name="identity", remove_extra_whitespaces=False, '
                "add_dummy_prefix=False and byte_fallback=True (see train_spm)"
            )

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        self._encode_into(text, ids)
        return ids

    def _encode_into(self, text: str, ids: list[int]) -> None:
        """Hand SentencePiece only stretches holding no user-defined symbol and no `▁`;
        such a stretch cannot yield a user-defined id, since every piece SentencePiece
        emits is a substring of its input."""
        start = 0
        for m in self._cut.finditer(text):
            if start < m.start():
                ids.extend(self._sp.encode(text[start : m.start()]))
            cut = m.group()
            if len(cut) == 1:
                # `▁` or a one-character symbol: only byte pieces spell it unambiguously.
                ids.extend(self._byte_ids[b] for b in cut.encode("utf-8"))
            else:
                # A special string in plain text: its first character, then the rest, which
                # may itself hold shorter symbols (hence the recursion; it always shrinks).
                self._encode_into(cut[0], ids)
                self._encode_into(cut[1:], ids)
            start = m.end()
        if start < len(text):
            ids.extend(self._sp.encode(text[start:]))

    def token_to_id(self, piece: str) -> int | None:
        # `sp.piece_to_id` answers the unk id for anything unknown; a dict has no such trap.
        return self._ids.get(piece)

    def token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._bytes):
            raise IndexError(f"token id {token_id} out of range 0..{len(self._bytes) - 1}")
        return self._bytes[token_id]

    def piece(self, token_id: int) -> str:
        token_id = int(token_id)
        if not 0 <= token_id < len(self._pieces):
            raise IndexError(f"token id {token_id} out of range 0..{len(self._pieces) - 1}")
        return self._pieces[token_id]


_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")
_TOO_LARGE = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")


def _lines(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8", newline="\n") as f:
        for line in f:
            yield line.rstrip("\n")


def train_spm(
    input_path: str | Path,
    vocab_size: int,
    out_prefix: str | Path,
    *,
    character_coverage: float = 0.9995,
    split_digits: bool = True,
    symbols: Sequence[str] = (),
) -> Path:
    """Train a BPE SentencePiece model on a UTF-8 text file (one sentence per line) and
        write `<out_prefix>.model` and `<out_prefix>.vocab`; returns the `.model` path.

        Layout: id 0 BOS and id 1 EOS (the DS4 strings, as control pieces, as in V4), id 2
        `<unk>`, no pad, then the other DS4 specials as user-defined symbols, then the 256
        byte-fallback pieces, then learned pieces. Normalization is off (identity, no whitespace
        collapsing, no dummy prefix) so text round-trips. Digits are split one per token by
        default. Characters outside `character_coverage` fall back to bytes.

    `symbols` are strings that are always one piece wherever they occur, whatever precedes
    them (a space is part of a symbol only where the symbol has one inside). A small model
    copies a word from the prompt into a call far more reliably when the word is the same
    token in both places: learned pieces carry a leading space (` Denver` in a sentence), so
    without this the copy (`">Denver`) is a different token sequence (`D`, `enver`) that
    must be learned word by word — exactly why digits are split.

        Deterministic: the corpus is fed from Python (so no path ends up in the model), one
        thread, no sentence sampling; the same corpus and arguments give identical model bytes.

        Raises ValueError naming the limit when `vocab_size` is too small for the required
        pieces or larger than the corpus supports (the vocabulary size is a hard limit so that
        `vocab_size` is exactly the embedding size a model config can rely on).
    """
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"no training corpus at {input_path}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    user_defined = [
        specials.USER,
        specials.ASSISTANT,
        specials.THINK_START,
        specials.THINK_END,
        specials.DSML,
        specials.LATEST_REMINDER,
        *(x.replace(" ", "\u2581") for x in symbols),
    ]
    model = io.BytesIO()
    try:
        with open(os.devnull, "w") as quiet:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_lines(input_path),
                model_writer=model,
                logstream=quiet,
                model_type="bpe",
                vocab_size=vocab_size,
                hard_vocab_limit=True,
                byte_fallback=True,
                character_coverage=character_coverage,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                split_digits=split_digits,
                allow_whitespace_only_pieces=True,
                max_sentence_length=1 << 16,
                user_defined_symbols=user_defined,
                bos_piece=specials.BOS,
                eos_piece=specials.EOS,
                unk_piece="<unk>",
                bos_id=0,
                eos_id=1,
                unk_id=2,
                pad_id=-1,
                num_threads=1,
            )
    except RuntimeError as e:
        msg = str(e)
        if m := _TOO_SMALL.search(msg):
            raise ValueError(
                f"vocab_size {vocab_size} is too small: this corpus needs at least "
                f"{m.group(2)} (special, byte-fallback and required character pieces); "
                "raise vocab_size or lower character_coverage"
            ) from e
        if m := _TOO_LARGE.search(msg):
            raise ValueError(
                f"vocab_size {vocab_size} is too large for this corpus: at most "
                f"{m.group(2)} pieces can be learned from it; lower vocab_size or add text"
            ) from e
        raise
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    model_path = out_prefix.with_name(out_prefix.name + ".model")
    model_path.write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(
        f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size())
    )
    out_prefix.with_name(out_prefix.name + ".vocab").write_text(vocab, encoding="utf-8")
    return model_path
