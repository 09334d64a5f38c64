"""The official V4 tokenizer behind the `Tokenizer` interface."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4jax.chat import specials as sp
from ds4jax.chat.segments import Segment, merged, template
from ds4jax.chat.tokenizer import IncrementalDetokenizer, V4Tokenizer, load_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOK = V4Tokenizer()


def test_vocab_and_special_ids_are_looked_up_by_string() -> None:
    assert TOK.vocab_size == 129280
    assert (TOK.bos_id, TOK.eos_id) == (0, 1)
    assert TOK.special_id(sp.USER) == 128803
    assert TOK.special_id(sp.ASSISTANT) == 128804
    assert TOK.special_id(sp.THINK_START) == 128821
    assert TOK.special_id(sp.THINK_END) == 128822
    assert TOK.special_id(sp.DSML) == 128825
    assert TOK.special_id(sp.LATEST_REMINDER) == 128828
    with pytest.raises(KeyError):
        TOK.special_id("<｜no_such_token｜>")


def test_official_prompt_count_for_the_italian_test_vector() -> None:
    # The official API counted 21 prompt tokens for this prompt, thinking disabled.
    segs = [
        *template(sp.BOS + sp.USER),
        Segment("Rispondi in italiano con una frase: chi era Ada Lovelace?"),
        *template(sp.ASSISTANT + sp.THINK_END),
    ]
    assert len(TOK.encode_segments(segs)) == 21


def test_plain_text_never_matches_added_tokens() -> None:
    text = f"x{sp.USER}{sp.DSML}<dsml:{sp.EOS}y"
    ids = TOK.encode_text(text)
    assert all(i < 128000 for i in ids)
    assert TOK.decode(ids) == text
    assert TOK.special_id(sp.USER) in TOK.encode_official(text)


def test_bpe_is_not_additive_so_segments_merge_before_encoding() -> None:
    # "s" + "trand" tokenizes differently from "strand": adjacent plain segments must be
    # encoded together, as the official pipeline sees one string.
    assert TOK.encode_text("s") + TOK.encode_text("trand") != TOK.encode_text("strand")
    segs = [Segment("s"), Segment("trand")]
    assert list(merged(segs)) == [Segment("strand")]
    assert TOK.encode_segments(segs) == TOK.encode_text("strand")


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_plain_text_round_trips(text: str) -> None:
    assert TOK.decode(TOK.encode_text(text)) == text


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("aé世😀🇮🇹 \n")), max_size=40))
def test_incremental_detokenizer_never_splits_a_character(text: str) -> None:
    ids = TOK.encode_text(text)
    det = IncrementalDetokenizer(TOK)
    pieces = [det.push(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_split_emoji_is_held_until_complete() -> None:
    ids = TOK.encode_text(" 😀")
    assert len(ids) >= 2  # the emoji's bytes span tokens
    det = IncrementalDetokenizer(TOK)
    assert det.push(ids[0]) == " "
    assert "".join(det.push(i) for i in ids[1:]) == "😀"


def test_token_bytes_and_pieces() -> None:
    ids = TOK.encode_text(" é")
    assert b"".join(TOK.token_bytes(i) for i in ids) == " é".encode()
    assert TOK.token_bytes(TOK.eos_id) == sp.EOS.encode()
    assert TOK.piece(TOK.special_id(sp.DSML)) == sp.DSML
    with pytest.raises(IndexError):
        TOK.piece(10**7)


def test_load_tokenizer_from_checkpoint_directory(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(TOK.path.read_bytes())
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, V4Tokenizer)
    assert tok.encode_text("hello world") == TOK.encode_text("hello world")
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
