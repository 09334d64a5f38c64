"""`ds4jax` — one command line, one subcommand per capability.

Subcommands land with the issues that build them; a subcommand that is not built yet says
so and exits non-zero rather than pretending.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ds4jax.chat.anthropic import RequestError, parse_messages_request
from ds4jax.chat.render import render
from ds4jax.chat.segments import join
from ds4jax.chat.tokenizer import load_tokenizer
from ds4jax.weights.options import add_attention_impl, add_hub_options, add_mesh, add_weights


def _read_body(path: str) -> Any:
    data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    try:
        return json.loads(data)
    except RecursionError as err:
        raise RequestError("request body is nested too deeply") from err
    except ValueError as err:
        raise RequestError(f"request body is not valid JSON: {err}") from err


def _request_segments(args: argparse.Namespace) -> list:
    if args.ctx is not None and args.ctx < 2:  # a server of that context serves nothing
        raise ValueError(f"--ctx {args.ctx}: the context holds at least 2 tokens")
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
    """`piece` is the vocabulary's own string (byte-level: "Ġw" for " w"); `text` the bytes
    it stands for, as text — a byte of a character split across tokens as `\\xNN`."""
    tok = load_tokenizer(args.tokenizer)
    try:
        args.text.encode("utf-8")
    except UnicodeEncodeError as err:  # argv bytes that are not UTF-8 (surrogate-escaped)
        raise ValueError(f"--text is not UTF-8 text: {err.reason} at {err.start}") from err
    for tid in tok.encode_text(args.text):
        text = tok.token_bytes(tid).decode("utf-8", errors="backslashreplace")
        print(json.dumps({"id": tid, "piece": tok.piece(tid), "text": text}, ensure_ascii=False))
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from ds4jax.chat.spm_tokenizer import train_spm

    model = train_spm(args.input, args.vocab_size, args.out)
    print(model)
    return 0


def _load_model(args: argparse.Namespace) -> tuple[Any, Any, Any, Callable[[Any], Any]]:
    """(config, params, tokenizer, place) from --model DIR|NAME or --config NAME [--seed S],
    the params read onto `--mesh`; `place` puts a state on the same devices."""
    import jax

    from ds4jax.model.sharding import Placement, replicated
    from ds4jax.weights.checkpoint import load_model

    placement = Placement(args.mesh)
    cfg, params, tokenizer, _ = load_model(
        args.model, args.config, args.seed, load_tokenizer=load_tokenizer,
        attention_impl=args.attention_impl, shardings=placement, weights=args.weights,
        revision=args.revision, download_dir=args.download_dir,
    )  # fmt: skip
    quant = getattr(args, "quant_sim", None)
    if quant is not None:
        cfg = cfg.replace(quant_sim=quant == "on")
    mesh = placement.mesh
    jax.set_mesh(mesh)  # this thread's programs: the routed experts expert-parallel on it
    if mesh is None:
        return cfg, params, tokenizer, lambda state: state
    print(f"mesh {dict(mesh.shape)}", file=sys.stderr)
    return cfg, params, tokenizer, lambda state: jax.device_put(state, replicated(mesh))


def _prompt_ids(args: argparse.Namespace, cfg: Any, tokenizer: Any) -> list[int]:
    if getattr(args, "tokens", None):
        ids = [int(t) for t in Path(args.tokens).read_text().split()]
    elif getattr(args, "chat", False):
        from ds4jax.chat.anthropic import parse_messages_request

        body = {
            "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": args.prompt}],
        }
        ids = tokenizer.encode_segments(render(parse_messages_request(body).conversation))
    else:
        ids = [tokenizer.bos_id, *tokenizer.encode_text(args.prompt)]
    if not ids:
        raise ValueError("empty prompt")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(
            f"token id {bad[0]} outside the model's vocabulary (0..{cfg.vocab_size - 1})"
        )
    return ids


def _progress(done: int, total: int) -> None:
    print(f"\rprefill {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr)


def cmd_dump_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from ds4jax.model.forward import CHUNK_SIZES, prefill
    from ds4jax.model.state import init_state

    cfg, params, tokenizer, place = _load_model(args)
    ids = _prompt_ids(args, cfg, tokenizer)
    sizes = (args.chunk,) if args.chunk else CHUNK_SIZES
    state = place(init_state(cfg, len(ids) + 1))
    _, logits = prefill(
        params, state, ids, cfg, chunk_sizes=sizes, all_logits=True, progress=_progress
    )
    out = np.asarray(logits, dtype=np.float32)
    np.save(args.out, out)
    print(f"wrote {args.out}: float32 {out.shape}", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.n < 1 or not args.temperature >= 0:  # NaN too: it sampled token 0 every step
        raise ValueError(f"-n {args.n} / --temperature {args.temperature}: at least 1 token, "
                         "a temperature ≥ 0")  # fmt: skip
    import time

    import jax

    from ds4jax.chat.tokenizer import IncrementalDetokenizer
    from ds4jax.model.forward import decode_step, prefill
    from ds4jax.model.state import init_state
    from ds4jax.sampling import sample

    cfg, params, tokenizer, place = _load_model(args)
    ids = _prompt_ids(args, cfg, tokenizer)
    need = len(ids) + args.n + 1
    if args.ctx is not None and args.ctx < need:
        # a smaller state would wrap its compressed rows over each other: wrong tokens, silently
        raise ValueError(f"--ctx {args.ctx} holds fewer than the prompt's {len(ids)} tokens, "
                         f"the {args.n} to generate and one more ({need})")  # fmt: skip
    state = place(init_state(cfg, args.ctx or need))
    t0 = time.perf_counter()
    state, _ = prefill(params, state, ids, cfg, progress=_progress)
    state.logits.block_until_ready()
    t1 = time.perf_counter()
    key = jax.random.key(args.seed)
    detok = IncrementalDetokenizer(tokenizer)
    produced = 0
    for _ in range(args.n):
        key, sub = jax.random.split(key)
        tok = int(sample(state.logits, sub, temperature=args.temperature))
        produced += 1
        if tok == tokenizer.eos_id:
            break
        sys.stdout.write(detok.push(tok))
        sys.stdout.flush()
        state = decode_step(params, state, tok, cfg)
    sys.stdout.write(detok.flush() + "\n")
    t2 = time.perf_counter()
    print(
        f"prefill {len(ids)} tokens {t1 - t0:.2f}s, generated {produced} tokens {t2 - t1:.2f}s",
        file=sys.stderr,
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Prints the plan; exit status 0 when it fits, 1 when it does not."""
    from ds4jax.config import load_config
    from ds4jax.plan import as_json, describe, plan

    try:
        cfg = load_config(args.config)
    except FileNotFoundError:
        from ds4jax.weights import hub

        if not hub.is_repo_id(args.config):
            raise
        cfg = load_config(hub.config_file(args.config, args.revision, args.download_dir))
    kw = dict(devices=args.devices, hbm_gb=args.hbm_gb, ctx=args.ctx, sessions=args.sessions,
              weights=args.weights, max_batch=args.max_batch, reserve=args.reserve,
              paged=args.paged_state, data_parallel=args.data_parallel)  # fmt: skip
    plans = plan(cfg, **kw)
    if args.json:
        print(json.dumps({"config": args.config, **kw, "plans": as_json(plans)}))
    else:
        print(describe(args.config, plans, **kw))
    return 0 if plans[0].fits else 1


def cmd_convert(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from ds4jax.weights.checkpoint import convert, resolve_model_dir

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    src = resolve_model_dir(args.src, args.revision, args.download_dir)
    dst = convert(src, args.dst, dtype=dtype, force=args.force)
    print(dst)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serve.main import serve

    return serve(args)


#: the commands that run a model: the process re-executes itself with its malloc settings
#: (`allocator`), and only the command run has its flags built (the server's spell its
#: defaults from the engine's modules). Every other command — and `ds4jax --help` — parses
#: and runs without importing JAX or the server: `ds4jax tokenize` 11.6 → 3.2 s on a 2-core
#: AVX2 EPYC (`tests/test_cli.py` checks what it imports)
MODEL_COMMANDS = ("dump-logits", "generate", "serve")


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names: its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(full: Sequence[str] = MODEL_COMMANDS) -> argparse.ArgumentParser:
    """Every command's parser; of the `MODEL_COMMANDS` not in `full`, only the name and
    help (enough to list them and to parse any other command)."""
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

    def with_model(sp: argparse.ArgumentParser) -> None:
        src = sp.add_mutually_exclusive_group(required=True)
        src.add_argument(
            "--model", help="checkpoint directory (Orbax, transformers or official), a "
            "named model (demo) or a Hugging Face Hub repo id org/name"
        )  # fmt: skip
        src.add_argument("--config", help="named config with random weights, e.g. tiny")
        sp.add_argument("--seed", type=int, default=0, help="weights seed with --config")
        add_attention_impl(sp)
        add_weights(sp)
        add_mesh(sp)
        add_hub_options(sp)

    helps = {
        "dump-logits": "write float32 logits for every prompt position",
        "generate": "stream a continuation of a prompt",
        "serve": "serve /v1/messages, /v1/responses and /v1/chat/completions",
    }

    def model_command(name: str) -> argparse.ArgumentParser | None:
        """The command's parser to fill in; None where only its name is wanted."""
        sp = sub.add_parser(name, help=helps[name])
        return sp if name in full else None

    if sp := model_command("dump-logits"):
        with_model(sp)
        src = sp.add_mutually_exclusive_group(required=True)
        src.add_argument("--prompt", help="text; encoded as BOS + plain text")
        src.add_argument("--tokens", help="file of whitespace-separated token ids")
        sp.add_argument("--out", required=True, help="output .npy, shape [tokens, vocab]")
        sp.add_argument("--chunk", type=int, default=None, help="one prefill chunk size")
        sp.add_argument("--quant-sim", choices=["on", "off"], default=None)
        sp.set_defaults(func=cmd_dump_logits)

    if sp := model_command("generate"):
        with_model(sp)
        sp.add_argument("-p", "--prompt", required=True)
        sp.add_argument("-n", type=int, default=64, help="tokens to generate")
        sp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        sp.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn")
        sp.add_argument("--ctx", type=int, default=None,
                        help="state capacity (default: just enough)")  # fmt: skip
        sp.add_argument("--quant-sim", choices=["on", "off"], default=None)
        sp.set_defaults(func=cmd_generate)

    sp = sub.add_parser("plan", help="bytes per device and the mesh for a model, context and "
                        "session pool on N devices (nothing is allocated)")  # fmt: skip
    sp.add_argument("--config", default="deepseek-v4-flash",
                    help="named config, a config.json, or a Hub repo id org/name (reads its "
                    "config.json alone)")  # fmt: skip
    sp.add_argument("--devices", type=int, required=True)
    sp.add_argument("--hbm-gb", type=float, required=True, help="memory per device, GB")
    sp.add_argument("--ctx", type=int, default=8192, help="context per session (serve --ctx)")
    sp.add_argument("--sessions", type=int, default=4, help="serve --sessions")
    sp.add_argument("--weights", choices=["fp8", "bf16", "f32", "fp4-experts"],
                    default="fp8")  # fmt: skip
    sp.add_argument("--max-batch", type=int, default=8, help="serve --max-batch")
    sp.add_argument(
        "--reserve",
        type=float,
        default=0.1,
        help="share of each device kept for activations and XLA (default 0.1)",
    )
    sp.add_argument("--json", action="store_true", help="one JSON object, every mesh")
    sp.add_argument("--paged-state", "--state-dtype", dest="paged_state",
                    choices=["f32", "bf16", "fp8"], default=None,
                    help="count states as paged state in this dtype holds them (serve "
                    "--paged --state-dtype) instead of fixed-capacity f32 states")  # fmt: skip
    sp.add_argument("--data-parallel", action="store_true",
                    help="search data×expert×tensor too: each data shard holding its own "
                    "sessions' pages, experts over every device (serve --paged --mesh "
                    "data=D)")  # fmt: skip
    add_hub_options(sp)
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("convert", help="checkpoint (transformers/official/Orbax) → Orbax")
    sp.add_argument("src", help="checkpoint directory, named model or Hub repo id org/name")
    sp.add_argument("dst")
    sp.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="the weights' dtype in the checkpoint written (default bfloat16)",
    )
    sp.add_argument("--force", action="store_true", help="replace an existing params checkpoint")
    add_hub_options(sp)
    sp.set_defaults(func=cmd_convert)

    if sp := model_command("serve"):
        from serve.main import add_arguments

        add_arguments(sp)
        sp.set_defaults(func=cmd_serve)
    return p


def enable_compile_cache() -> None:
    """Persist compiled XLA programs across runs (startup of `serve` drops from ~40 s to a
    few seconds once warm). `JAX_COMPILATION_CACHE_DIR` overrides the location."""
    import os

    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/ds4jax/xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


def main(argv: Sequence[str] | None = None) -> int:
    command = _command(sys.argv[1:] if argv is None else argv)
    model = command in MODEL_COMMANDS
    if argv is None and model:  # the program itself (`ds4jax`, `python -m ds4jax`) running
        # a model: another command would only pay a second start-up for it
        from ds4jax import allocator

        allocator.reexec()
    enable_compile_cache()
    args = build_parser(full=(command,) if model else ()).parse_args(argv)
    try:
        return int(args.func(args))
    except RequestError as err:
        print(json.dumps(err.body(), ensure_ascii=False), file=sys.stderr)
        return 1
    except (OSError, ValueError) as err:  # a path that is a directory, unreadable, missing…
        from ds4jax.weights.hub import HubError

        print(f"ds4jax {args.command}: {err}", file=sys.stderr)
        # 2, as for a usage error: the model named is not reachable from here, nothing broke
        return 2 if isinstance(err, HubError) else 1


if __name__ == "__main__":
    sys.exit(main())
