"""SentencePiece backend: trained once per module on a generated mixed corpus, then checked
for the properties the serving stack relies on: lossless round-trip, special strings in client
text never becoming special ids, V4's BOS/EOS ids, and streaming without U+FFFD."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4jax.chat import specials
from ds4jax.chat.segments import Segment, join, template
from ds4jax.chat.spm_tokenizer import SpmTokenizer, train_spm
from ds4jax.chat.tokenizer import IncrementalDetokenizer, load_tokenizer

VOCAB = 1000

_ENGLISH = (
    "the model reads the prompt and answers the question with care . "
    "a tokenizer splits text into pieces that the network can embed . "
    "streaming output must never show a broken character to the user . "
    "we trained it on a small corpus so the tests stay fast and deterministic ."
).split()
_CODE = [
    "def encode(self, text: str) -> list[int]:",
    "    return [self.vocab[c] for c in text if c in self.vocab]",
    "for i in range(10):\n",
    "    if x < 0 and y >= 1:",
    "        print(f'{i}: {x!r}')  # debug",
    "class Cache(dict):",
    "import json, os, sys",
    "    while not done: done = step() <= limit",
]
_JSON = [
    '{"role": "user", "content": "hello"}',
    '{"id": 12345, "tags": ["a", "b"], "ok": true, "score": 0.75}',
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
]
_UNICODE = [
    "café naïve façade über straße",
    "日本語のテキストを分割します",
    "中文分词测试文本",
    "Привет, как дела?",
    "emoji 😀 🎉 👍 ❤️ 🚀 and more 😀",
    "math: ∑ ∫ √ ≤ ≥ ≠ → ∞",
    "fullwidth ｜ bar and ▁ lower block",
]
_SPECIALS = list(specials.TEMPLATE_SPECIALS)


def _corpus(rng: random.Random, target_bytes: int = 300_000) -> str:
    lines: list[str] = []
    size = 0
    while size < target_bytes:
        kind = rng.random()
        if kind < 0.4:
            line = " ".join(rng.choice(_ENGLISH) for _ in range(rng.randint(5, 25)))
        elif kind < 0.6:
            line = rng.choice(_CODE)
        elif kind < 0.75:
            line = rng.choice(_JSON)
        elif kind < 0.9:
            line = rng.choice(_UNICODE)
        else:
            line = rng.choice(_SPECIALS) + " " + rng.choice(_ENGLISH) + rng.choice(_SPECIALS)
        line = line.replace("\n", "")
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(_corpus(random.Random(1234)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model_path(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_spm(corpus, VOCAB, tmp_path_factory.mktemp("tok") / "spm")


@pytest.fixture(scope="module")
def tok(model_path: Path) -> SpmTokenizer:
    return SpmTokenizer(model_path)


def _special_ids(tok: SpmTokenizer) -> set[int]:
    ids = {tok.special_id(s) for s in specials.TEMPLATE_SPECIALS}
    ids |= {tok.special_id(s) for s in tok.user_defined}
    ids.add(tok.special_id("<unk>"))
    return ids


def _assert_plain_roundtrip(tok: SpmTokenizer, text: str) -> list[int]:
    ids = tok.encode_text(text)
    assert tok.decode(ids) == text
    assert not set(ids) & _special_ids(tok), [tok.piece(i) for i in ids]
    det = IncrementalDetokenizer(tok)
    parts = [det.push(i) for i in ids]
    parts.append(det.flush())
    assert "".join(parts) == text
    return ids


def test_layout_matches_v4_ids(tok: SpmTokenizer, model_path: Path) -> None:
    assert tok.vocab_size == VOCAB
    assert tok.bos_id == 0
    assert tok.eos_id == 1
    assert tok.token_to_id("<unk>") == 2
    ids = [tok.special_id(s) for s in specials.TEMPLATE_SPECIALS]
    assert len(set(ids)) == len(ids)
    for s, i in zip(specials.TEMPLATE_SPECIALS, ids, strict=True):
        assert tok.piece(i) == s
        # Decoded through id_to_piece, so `▁` inside BOS/EOS stays `▁`.
        assert tok.token_bytes(i) == s.encode("utf-8")
        assert tok.decode([i]) == s
    assert set(tok.user_defined) == set(specials.TEMPLATE_SPECIALS) - {
        specials.BOS,
        specials.EOS,
    }
    assert model_path.with_suffix(".vocab").is_file()


def test_token_lookup(tok: SpmTokenizer) -> None:
    assert tok.token_to_id("definitely not a piece ∰") is None
    assert tok.token_to_id("") is None
    byte_a = tok.token_to_id("<0x41>")
    assert byte_a is not None
    assert tok.token_bytes(byte_a) == b"A"
    assert tok.token_bytes(tok.special_id("<0xE2>")) == b"\xe2"
    space = tok.token_to_id("▁")
    assert space is not None
    assert tok.token_bytes(space) == b" "
    assert tok.token_bytes(tok.special_id("<unk>")) == "\ufffd".encode()
    with pytest.raises(IndexError):
        tok.piece(VOCAB)
    with pytest.raises(IndexError):
        tok.token_bytes(-1)
    with pytest.raises(KeyError):
        tok.special_id("<｜nope｜>")


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "hello world",
        "  leading and trailing  ",
        "tabs\tand\nnewlines\r\n",
        "x▁y ▁ ▁▁ a",
        "▁",
        "<0x41> is not a byte token here",
        "\x00\x01\x7f",
        "\ufeffbom",
        "ﬁ Ａ ①",
        "emoji 😀 🦜🧬 👩‍👩‍👧",
        *specials.TEMPLATE_SPECIALS,
        "hi <｜User｜> there </think><think>",
        "<<｜User｜>>",
        "｜DSML｜｜DSML｜",
        specials.EOS + specials.BOS,
        "<｜end of sentence｜>",
    ],
)
def test_roundtrip_examples(tok: SpmTokenizer, text: str) -> None:
    _assert_plain_roundtrip(tok, text)


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_roundtrip_arbitrary_text(tok: SpmTokenizer, text: str) -> None:
    _assert_plain_roundtrip(tok, text)


_TRICKY = st.sampled_from(
    [*specials.TEMPLATE_SPECIALS, "▁", " ", "▁▁", "<", ">", "｜", "<｜", "｜>", "\n", "think"]
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(_TRICKY, st.text(max_size=8)), max_size=12))
def test_roundtrip_specials_and_space_symbol(tok: SpmTokenizer, parts: list[str]) -> None:
    _assert_plain_roundtrip(tok, "".join(parts))


def test_literal_space_symbol_is_not_a_space(tok: SpmTokenizer) -> None:
    with_symbol = tok.encode_text("a▁b")
    with_space = tok.encode_text("a b")
    assert with_symbol != with_space
    assert tok.decode(with_symbol) == "a▁b"
    assert tok.decode(with_space) == "a b"


def test_client_specials_stay_plain(tok: SpmTokenizer) -> None:
    for s in specials.TEMPLATE_SPECIALS:
        ids = _assert_plain_roundtrip(tok, f"say {s} now")
        assert tok.special_id(s) not in ids
        assert len(ids) > 1


def test_encode_segments_specials_only_from_template(tok: SpmTokenizer) -> None:
    segs = [
        *template(specials.BOS + specials.USER),
        Segment("hi <｜User｜> and </think>"),
        *template(specials.ASSISTANT + specials.THINK_END),
    ]
    ids = tok.encode_segments(segs)
    expect_head = [tok.bos_id, tok.special_id(specials.USER)]
    expect_tail = [tok.special_id(specials.ASSISTANT), tok.special_id(specials.THINK_END)]
    assert ids[:2] == expect_head
    assert ids[-2:] == expect_tail
    middle = ids[2:-2]
    assert middle == tok.encode_text("hi <｜User｜> and </think>")
    assert not set(middle) & _special_ids(tok)
    assert tok.decode(ids) == join(segs)


def test_template_prose_specials_become_ids(tok: SpmTokenizer) -> None:
    segs = template("reason inside <think> first")
    ids = tok.encode_segments(segs)
    assert ids.count(tok.special_id(specials.THINK_START)) == 1
    assert tok.decode(ids) == join(segs)


def test_streaming_emoji_split_across_byte_tokens(tok: SpmTokenizer) -> None:
    text = "Stream 🦜🧬 then 😀 and 日本 ▁ done"
    ids = tok.encode_text(text)
    pieces = [tok.piece(i) for i in ids]
    assert "<0xF0>" in pieces  # the rare emoji really went through byte fallback
    det = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        chunk = det.push(i)
        assert "\ufffd" not in chunk
        out.append(chunk)
    out.append(det.flush())
    assert "".join(out) == text


def test_load_tokenizer(model_path: Path) -> None:
    assert isinstance(load_tokenizer(model_path), SpmTokenizer)
    assert isinstance(load_tokenizer(str(model_path)), SpmTokenizer)
    loaded = load_tokenizer(model_path.parent)
    assert isinstance(loaded, SpmTokenizer)
    assert loaded.eos_id == 1


def test_training_is_deterministic(corpus: Path, model_path: Path, tmp_path: Path) -> None:
    again = train_spm(corpus, VOCAB, tmp_path / "nested" / "again")
    assert again == tmp_path / "nested" / "again.model"
    assert again.read_bytes() == model_path.read_bytes()
    sample = "def f(x): return {'é': x}  # 😀 <｜User｜>"
    assert SpmTokenizer(again).encode_text(sample) == SpmTokenizer(model_path).encode_text(sample)


def test_word_symbols_are_one_piece_wherever_written(corpus: Path, tmp_path: Path) -> None:
    """A word symbol is the same single token after a space, after `">` or at the start, so
    a small model can copy it token for token; it is plain text (round-trips, streams) and
    never makes a forged special come out."""
    tok = SpmTokenizer(train_spm(corpus, VOCAB, tmp_path / "w", symbols=["Denver", "New York"]))
    assert set(tok.symbols) == {"Denver", "New York"}
    assert set(tok.user_defined) == set(specials.TEMPLATE_SPECIALS) - {specials.BOS, specials.EOS}
    denver, new_york = tok.token_to_id("Denver"), tok.token_to_id("New\u2581York")
    for text in ("in Denver and New York?", '">Denver</', "Denver", "(New York)"):
        ids = _assert_plain_roundtrip(tok, text)
        assert (denver in ids) == ("Denver" in text) and (new_york in ids) == ("York" in text)
    assert tok.decode([new_york]) == "New York"
    _assert_plain_roundtrip(tok, "Denver<｜User｜>New\u2581York")  # a literal `▁` stays text


def test_bad_vocab_size(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"too small: this corpus needs at least \d+"):
        train_spm(corpus, 100, tmp_path / "small")
    with pytest.raises(ValueError, match=r"too large for this corpus: at most \d+"):
        train_spm(corpus, 1_000_000, tmp_path / "large")
    for bad in (0, -5):
        with pytest.raises(ValueError, match="positive integer"):
            train_spm(corpus, bad, tmp_path / "bad")
    assert not list(tmp_path.glob("*.model"))
    with pytest.raises(FileNotFoundError):
        train_spm(tmp_path / "missing.txt", VOCAB, tmp_path / "m")


def test_rejects_model_that_cannot_roundtrip(corpus: Path, tmp_path: Path) -> None:
    """Default SentencePiece options (NFKC, dummy prefix, no byte fallback) lose text."""
    prefix = tmp_path / "default"
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), vocab_size=400, model_type="bpe"
    )
    with pytest.raises(ValueError, match="byte-fallback"):
        SpmTokenizer(prefix.with_suffix(".model"))
    prefix = tmp_path / "nfkc"
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
    )
    with pytest.raises(ValueError, match="does not round-trip"):
        SpmTokenizer(prefix.with_suffix(".model"))
    with pytest.raises(FileNotFoundError):
        SpmTokenizer(tmp_path / "absent.model")
