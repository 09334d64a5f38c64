"""`ds4jax dump-logits`, `generate` and `convert`, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.model import hf_reference


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ds4jax", *args], capture_output=True, text=True, timeout=600
    )


def test_dump_logits_convert_and_generate_on_a_transformers_checkpoint(tmp_path: Path) -> None:
    model = hf_reference.build("hca_no_yarn", tmp_path / "hf")
    tokens = np.random.default_rng(3).integers(0, 320, 21)
    (tmp_path / "toks.txt").write_text(" ".join(map(str, tokens)))

    out = run(
        "dump-logits", "--model", str(tmp_path / "hf"), "--tokens", str(tmp_path / "toks.txt"),
        "--out", str(tmp_path / "l.npy"), "--chunk", "16",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (21, 320) and logits.dtype == np.float32
    ref = hf_reference.reference_logits(model, tokens)
    assert np.abs(logits - ref).max() <= 1e-4

    out = run("convert", str(tmp_path / "hf"), str(tmp_path / "orbax"), "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    out = run("convert", str(tmp_path / "hf"), str(tmp_path / "orbax"))
    assert out.returncode == 1 and "exists" in out.stderr

    out = run(
        "dump-logits", "--model", str(tmp_path / "orbax"), "--tokens", str(tmp_path / "toks.txt"),
        "--out", str(tmp_path / "l2.npy"), "--chunk", "16",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "l2.npy"), logits)

    # a prompt whose ids exceed this tiny vocabulary is a clear error, not a crash
    out = run("dump-logits", "--model", str(tmp_path / "hf"), "--prompt", "hello world",
              "--out", str(tmp_path / "x.npy"))  # fmt: skip
    assert out.returncode == 1 and "vocabulary" in out.stderr


def test_generate_streams_text_and_reports_prefill_progress() -> None:
    out = run("generate", "--config", "tiny", "-p", "Hello", "-n", "4")
    assert out.returncode == 0, out.stderr
    assert "prefill 2/2 tokens" in out.stderr
    assert "generated" in out.stderr
    assert out.stdout.endswith("\n") and "\ufffd" not in out.stdout


def test_generate_refuses_a_context_its_tokens_do_not_fit() -> None:
    """A state smaller than the prompt and its tokens wrapped its rows over each other and
    printed wrong tokens, exit 0; now a one-line error, as for -n 0 or a negative temperature."""
    for flags, says in (
        (("--ctx", "8", "-n", "20"), "--ctx 8 holds fewer"),
        (("-n", "0"), "-n 0"),
        (("--temperature", "-1"), "temperature"),
        (("--temperature", "nan"), "temperature"),  # it sampled token 0 (BOS) every step
    ):
        out = run("generate", "--config", "tiny", "-p", "Hello there", *flags)
        assert out.returncode == 1 and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_convert_keeps_the_models_own_tokenizer(tmp_path: Path) -> None:
    """The demo model's SentencePiece vocabulary travels with its converted checkpoint, so
    the copy generates as the original does (without it: the official V4 tokenizer, whose
    ids fall outside the demo's vocabulary)."""
    dst = tmp_path / "demo"
    out = run("convert", "demo", str(dst), "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert (dst / "demo.model").is_file() and (dst / "demo.vocab").is_file()
    again = run("convert", "demo", str(dst))
    assert again.returncode == 1 and "--force" in again.stderr
    gens = [run("generate", "--model", m, "-p", "list the files", "-n", "6", "--chat")
            for m in ("demo", str(dst))]  # fmt: skip
    assert gens[0].returncode == 0 and gens[1].returncode == 0, gens[1].stderr
    assert gens[0].stdout == gens[1].stdout
