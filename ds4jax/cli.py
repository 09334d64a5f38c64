"""`ds4jax` — one command line, one subcommand per capability.

Subcommands land with the issues that build them; a subcommand that is not built yet says
so and exits non-zero rather than pretending.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ds4jax.chat.anthropic import RequestError, parse_messages_request
from ds4jax.chat.render import render
from ds4jax.chat.segments import join
from ds4jax.chat.tokenizer import load_tokenizer


def _read_body(path: str) -> Any:
    data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    try:
        return json.loads(data)
    except ValueError as err:
        raise RequestError(f"request body is not valid JSON: {err}") from err


def _request_segments(args: argparse.Namespace) -> list:
    req = parse_messages_request(_read_body(args.file), max_context=args.ctx)
    return render(req.conversation)


def cmd_render(args: argparse.Namespace) -> int:
    sys.stdout.buffer.write(join(_request_segments(args)).encode("utf-8"))
    sys.stdout.buffer.flush()
    return 0


def cmd_count_tokens(args: argparse.Namespace) -> int:
    segments = _request_segments(args)
    ids = load_tokenizer(args.tokenizer).encode_segments(segments)
    print(json.dumps({"input_tokens": len(ids)}))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    for tid in tok.encode_text(args.text):
        print(json.dumps({"id": tid, "piece": tok.piece(tid)}, ensure_ascii=False))
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from ds4jax.chat.spm_tokenizer import train_spm

    model = train_spm(args.input, args.vocab_size, args.out)
    print(model)
    return 0


def cmd_not_built(args: argparse.Namespace) -> int:
    print(
        f"ds4jax {args.command}: not built yet — this capability lands with a later issue "
        "(see the README's roadmap).",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4jax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def with_tokenizer(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--tokenizer",
            default=None,
            help="tokenizer.json, SentencePiece .model, or a checkpoint directory "
            "(default: the official DeepSeek V4 tokenizer)",
        )

    def with_request(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("file", help="Anthropic Messages request body (JSON); - reads stdin")
        sp.add_argument(
            "--ctx",
            type=int,
            default=None,
            help="server context size; gates Think-Max as the server does (default: ungated)",
        )

    sp = sub.add_parser("render", help="print the exact rendered prompt of a request")
    with_request(sp)
    sp.set_defaults(func=cmd_render)

    sp = sub.add_parser("count-tokens", help='print {"input_tokens": N} for a request')
    with_request(sp)
    with_tokenizer(sp)
    sp.set_defaults(func=cmd_count_tokens)

    sp = sub.add_parser("tokenize", help="one JSON line per token of plain text")
    sp.add_argument("--text", required=True)
    with_tokenizer(sp)
    sp.set_defaults(func=cmd_tokenize)

    sp = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = sp.add_subparsers(dest="tokenizer_command", required=True)
    tp = tsub.add_parser("train", help="train a SentencePiece BPE vocabulary with DS4 specials")
    tp.add_argument("--input", required=True, help="training text file")
    tp.add_argument("--vocab-size", type=int, required=True)
    tp.add_argument("--out", required=True, help="output prefix (writes PREFIX.model/.vocab)")
    tp.set_defaults(func=cmd_tokenizer_train)

    for name, text in [
        ("serve", "serve /v1/messages (not built yet)"),
        ("generate", "generate text (not built yet)"),
        ("dump-logits", "write logits for a prompt (not built yet)"),
        ("convert", "convert a checkpoint (not built yet)"),
    ]:
        sp = sub.add_parser(name, help=text)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(func=cmd_not_built)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RequestError as err:
        print(json.dumps(err.body(), ensure_ascii=False), file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as err:
        print(f"ds4jax {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
