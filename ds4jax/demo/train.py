"""Train the tiny demo model that `make serve` ships: `python -m ds4jax.demo.train`.

The model is the V4 architecture (sliding, CSA and HCA attention; hash and learned MoE;
hyper-connections) at toy width, trained from scratch with optax on the synthetic corpus of
`ds4jax.demo.corpus` and a SentencePiece vocabulary learned from the same text. The
training forward is the serving forward (`forward_chunk` from an empty state with
`all_logits`), so nothing separate can drift from what is served. Loss is next-token
cross-entropy on the assistant's tokens only (reasoning, DSML call, answer, EOS): the prompt
around them is the client's, not the model's to predict.

Seeded and reproducible on one machine (XLA's CPU reductions are deterministic for a fixed
thread count); on 2 CPU cores the default settings train in about 26 minutes (the bound is 30).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ds4jax import native
from ds4jax.chat import specials
from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.conversation import Conversation
from ds4jax.chat.render import render, render_text
from ds4jax.chat.spm_tokenizer import SpmTokenizer, train_spm
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.config import CONFIG_DIR, Config, load_config
from ds4jax.demo.corpus import city_symbols, training_bodies
from ds4jax.model import layers
from ds4jax.model.forward import forward_chunk
from ds4jax.model.params import Params, init_params
from ds4jax.model.state import init_state
from ds4jax.weights.checkpoint import save_params

#: Where the shipped model lives: a named model directory beside the named configs.
DEMO_DIR = CONFIG_DIR / "demo"
TOKENIZER_NAME = "demo"


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    examples: int = 8000
    vocab_size: int = 1024
    #: suffix buckets: an example trains in the shortest that holds it (half the
    #: conversations fit in 131 tokens, a two-round one with thinking takes up to ~370;
    #: these pad 24% against 39% for 128/256/384, for two more ~20 s compiles)
    suffix_lens: tuple[int, ...] = (96, 128, 192, 256, 384)
    prefix_len: int = 384
    batch: int = 16
    steps: int = 1100
    lr: float = 3e-3
    warmup: int = 60


def finished_conversation(body: dict[str, Any]) -> Conversation:
    """A training conversation as the model lives it: the parser reads a trailing assistant
    message as an Anthropic prefill (rendered without EOS), but here it is a finished turn,
    and its EOS is what teaches the model to stop."""
    conv = parse_messages_request(body).conversation
    last = conv.messages[-1]
    if last.role == "assistant":
        conv.messages[-1] = dataclasses.replace(last, prefill=False)
    return conv


def assistant_mask(ids: list[int], tok: Tokenizer) -> np.ndarray:
    """1 where a token was produced by the assistant: everything after an
    `<｜Assistant｜>` + think opener, up to and including the turn's EOS. (The tools block
    also contains a `<think>` special, but never right after `<｜Assistant｜>`.)"""
    assistant = tok.special_id(specials.ASSISTANT)
    openers = {tok.special_id(specials.THINK_START), tok.special_id(specials.THINK_END)}
    mask = np.zeros(len(ids), np.float32)
    inside = False
    for i, t in enumerate(ids):
        if inside:
            mask[i] = 1.0
            inside = t != tok.eos_id
        elif i >= 2 and ids[i - 1] in openers and ids[i - 2] == assistant:
            mask[i] = 1.0
            inside = t != tok.eos_id
    return mask


@dataclasses.dataclass
class Corpus:
    """The encoded conversations, split at the first `<｜User｜>`: the prefix (BOS, system
    prompt, tools block) is shared by every example with the same system prompt, so it is
    evaluated once per step and the batch trains on the suffixes only. Suffixes are padded
    to the shortest of the buckets that holds them, so short conversations do not pay for
    long ones."""

    prefixes: list[list[int]]  # distinct prefixes
    group: np.ndarray  # [N] index into prefixes
    bucket: np.ndarray  # [N] index into suffix_lens
    suffix: np.ndarray  # [N, max suffix_len] int32, EOS-padded
    mask: np.ndarray  # [N, max suffix_len] float32, 1 on assistant tokens


def encode_corpus(
    bodies: list[dict[str, Any]], tok: Tokenizer, suffix_lens: tuple[int, ...]
) -> Corpus:
    user = tok.special_id(specials.USER)
    longest = max(suffix_lens)
    prefixes: dict[tuple[int, ...], int] = {}
    group = np.zeros(len(bodies), np.int32)
    bucket = np.zeros(len(bodies), np.int32)
    suffix = np.full((len(bodies), longest), tok.eos_id, np.int32)
    mask = np.zeros((len(bodies), longest), np.float32)
    for i, body in enumerate(bodies):
        ids = tok.encode_segments(render(finished_conversation(body)))
        cut = ids.index(user)
        rest = ids[cut:]
        if len(rest) > longest:
            raise ValueError(f"example {i}: {len(rest)} tokens after the prefix > {longest}")
        group[i] = prefixes.setdefault(tuple(ids[:cut]), len(prefixes))
        bucket[i] = min(b for b, n in enumerate(suffix_lens) if n >= len(rest))
        suffix[i, : len(rest)] = rest
        mask[i, : len(rest)] = assistant_mask(ids, tok)[cut:]
    return Corpus([list(p) for p in prefixes], group, bucket, suffix, mask)


def pad_prefixes(corpus: Corpus, length: int, pad: int) -> np.ndarray:
    """The distinct prefixes as one [prefixes, `length`] array, `pad`-padded."""
    out = np.full((len(corpus.prefixes), length), pad, np.int32)
    for g, p in enumerate(corpus.prefixes):
        out[g, : len(p)] = p
    return out


def draw_batch(rng: np.random.Generator, corpus: Corpus, batch: int) -> tuple[int, int, np.ndarray]:
    """One step's examples (prefix, suffix bucket, `batch` indices): one prefix and one
    bucket per step (the batch shares its state and shape), drawn by their share of the
    data."""
    pick = rng.integers(len(corpus.group))
    g, b = corpus.group[pick], corpus.bucket[pick]
    idx = rng.choice(np.flatnonzero((corpus.group == g) & (corpus.bucket == b)), batch)
    return g, b, idx


@contextlib.contextmanager
def dense_moe() -> Iterator[None]:
    """Programs traced inside keep the MoE dense: a batch's suffixes are vmapped, and the
    grouped MoE of long chunks would index each example's experts inside its loop."""
    dense_from = layers.GROUPED_MIN_TOKENS
    layers.GROUPED_MIN_TOKENS = 1 << 30
    try:
        with native.disabled():  # no gradient through the native kernels
            yield
    finally:
        layers.GROUPED_MIN_TOKENS = dense_from


def demo_config(vocab_size: int) -> Config:
    return dataclasses.replace(load_config(CONFIG_DIR / "demo.json"), vocab_size=vocab_size)


def make_step(cfg: Config, max_len: int, opt: optax.GradientTransformation):
    """A jitted optimizer step over the float leaves (the hash-routing table is int and
    fixed). The shared prefix is evaluated without gradient (as context, like truncated
    backpropagation); the batch's suffixes are evaluated on top of it."""
    state0 = init_state(cfg, max_len)

    def loss_fn(floats, frozen, treedef, kinds, prefix, n_prefix, toks, mask):
        params = join_params(floats, frozen, treedef, kinds)
        ctx, _ = forward_chunk(jax.lax.stop_gradient(params), state0, prefix, n_prefix, cfg=cfg)
        ctx = jax.lax.stop_gradient(ctx)

        def logits_of(t: jax.Array) -> jax.Array:
            return forward_chunk(params, ctx, t, t.shape[0], cfg=cfg, all_logits=True)[1]

        logits = jax.vmap(logits_of)(toks)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)[..., 0]
        m = mask[:, 1:]
        return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)

    @partial(jax.jit, static_argnums=(2, 3))
    def step(floats, frozen, treedef, kinds, opt_state, prefix, n_prefix, toks, mask):
        loss, grads = jax.value_and_grad(loss_fn)(
            floats, frozen, treedef, kinds, prefix, n_prefix, toks, mask
        )
        updates, opt_state = opt.update(grads, opt_state, floats)
        return optax.apply_updates(floats, updates), opt_state, loss

    return step


def split_params(params: Params) -> tuple[list, list, Any, tuple[bool, ...]]:
    leaves, treedef = jax.tree.flatten(params)
    kinds = tuple(bool(jnp.issubdtype(x.dtype, jnp.floating)) for x in leaves)
    floats = [x for x, k in zip(leaves, kinds, strict=True) if k]
    frozen = [x for x, k in zip(leaves, kinds, strict=True) if not k]
    return floats, frozen, treedef, kinds


def join_params(floats: list, frozen: list, treedef: Any, kinds: tuple[bool, ...]) -> Params:
    fi, zi = iter(floats), iter(frozen)
    return jax.tree.unflatten(treedef, [next(fi) if k else next(zi) for k in kinds])


def _say(line: str) -> None:
    print(line, flush=True)


def _bar(done: int, total: int, loss: float, t0: float) -> None:
    """A progress bar on stderr; `t0` is the end of the first (compiling) step."""
    width = 30
    fill = width * done // total
    rate = (time.perf_counter() - t0) / max(done - 1, 1)
    sys.stderr.write(
        f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} loss {loss:.4f} "
        f"{rate:.2f}s/step eta {rate * (total - done) / 60:.1f} min "
    )
    sys.stderr.flush()


def run_steps(
    total: int, one: Callable[[int], jax.Array], log: Callable[[str], None]
) -> tuple[list[float], float]:
    """`total` optimizer steps, `one(i)` running step i and returning its loss: the first
    (compiling) step's time said apart, a progress bar every ten. Returns (the loss every
    ten steps and the last's, seconds after the first step)."""
    losses: list[float] = []
    t0 = time.perf_counter()
    for i in range(total):
        loss = one(i)
        if i == 0:
            loss.block_until_ready()
            log(f"first step (compile) {time.perf_counter() - t0:.0f}s")
            t0 = time.perf_counter()
        if i % 10 == 9 or i == total - 1:
            losses.append(float(loss))
            _bar(i + 1, total, losses[-1], t0)
    sys.stderr.write("\n")
    return losses, time.perf_counter() - t0


def training_record(settings: Any, losses: list[float], train_s: float, t_start: float,
                    **extra: Any) -> dict[str, Any]:  # fmt: skip
    """What `training.json` keeps of a run: its settings, the loss curve, the timings and
    where it ran (`extra`: a trainer's own figures, after the loss curve)."""
    return {
        "settings": dataclasses.asdict(settings),
        "final_loss": losses[-1],
        "loss_every_10_steps": [round(x, 4) for x in losses],
        **extra,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
    }


def train(
    settings: TrainSettings, out: Path, *, log: Callable[[str], None] = _say
) -> dict[str, Any]:
    """Build the tokenizer, the corpus and the model; train; save params + tokenizer to
    `out` (replacing an earlier demo checkpoint there). Returns the training record."""
    t_start = time.perf_counter()
    bodies = training_bodies(settings.examples, settings.seed)
    work = Path(tempfile.mkdtemp(prefix="ds4jax-demo-"))
    try:
        text = work / "corpus.txt"
        text.write_text(
            "\n".join(render_text(finished_conversation(b)) for b in bodies),
            encoding="utf-8",
        )
        spm_path = train_spm(
            text, settings.vocab_size, work / TOKENIZER_NAME, symbols=city_symbols()
        )
        tok = SpmTokenizer(spm_path)
        corpus = encode_corpus(bodies, tok, settings.suffix_lens)
        log(
            f"corpus: {len(bodies)} conversations, {len(corpus.prefixes)} distinct prefixes "
            f"(longest {max(map(len, corpus.prefixes))} tokens), {int(corpus.mask.sum())} "
            f"assistant tokens; vocab {tok.vocab_size} ({time.perf_counter() - t_start:.0f}s)"
        )
        prefixes = pad_prefixes(corpus, settings.prefix_len, tok.eos_id)
        cfg = demo_config(tok.vocab_size)
        params = init_params(cfg, seed=settings.seed)
        sched = optax.warmup_cosine_decay_schedule(
            0.0, settings.lr, settings.warmup, settings.steps, settings.lr / 10
        )
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
        floats, frozen, treedef, kinds = split_params(params)
        opt_state = opt.init(floats)
        step = make_step(cfg, settings.prefix_len + max(settings.suffix_lens), opt)
        rng = np.random.default_rng(settings.seed)

        def one(_: int) -> jax.Array:
            nonlocal floats, opt_state
            g, b, idx = draw_batch(rng, corpus, settings.batch)
            n = settings.suffix_lens[b]
            with dense_moe():  # traced on the first step of each bucket
                floats, opt_state, loss = step(
                    floats, frozen, treedef, kinds, opt_state, prefixes[g],
                    len(corpus.prefixes[g]), corpus.suffix[idx, :n], corpus.mask[idx, :n],
                )  # fmt: skip
            return loss

        losses, train_s = run_steps(settings.steps, one, log)
        params = join_params(floats, frozen, treedef, kinds)
        save_params(params, cfg, out, force=True)
        for suffix in (".model", ".vocab"):
            shutil.copyfile(spm_path.with_suffix(suffix), out / (TOKENIZER_NAME + suffix))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = training_record(settings, losses, train_s, t_start)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    log(f"saved {out}: final loss {losses[-1]:.4f}, {record['total_seconds']:.0f}s in all")
    return record


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    d = TrainSettings()
    ap = argparse.ArgumentParser(prog="python -m ds4jax.demo.train", description=__doc__)
    ap.add_argument("--out", default=str(DEMO_DIR), help=f"checkpoint directory ({DEMO_DIR})")
    for f in dataclasses.fields(TrainSettings):
        default = getattr(d, f.name)
        kind = _int_tuple if isinstance(default, tuple) else type(default)
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default)
    args = ap.parse_args(argv)
    settings = TrainSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(d)})
    random.seed(settings.seed)
    train(settings, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
