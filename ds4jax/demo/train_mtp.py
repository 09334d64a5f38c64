"""Train the demo model's multi-token-prediction block: `python -m ds4jax.demo.train_mtp`.

Why: greedy speculative decoding (`model.speculative`) drafts each next token with the MTP
block (spec §2.9) and keeps the draft where the model's own choice agrees, so how often it
pays depends on the block's weights. Random ones draft noise (nearly every draft
rejected); the release ships a trained block, and so does the demo, so its acceptance
means something.

How: as the release trains its block, one position further than the model: at position i
the block reads the model's last-layer streams there (before `hc_head`) and token i+1,
and its loss is cross-entropy against token i+2, on the assistant's tokens (`train`'s
mask). The shipped model is frozen — its streams come from a forward without gradient,
and its weights are saved back bit for bit — and the block (`init_params(mtp_layers=1)`;
the embedding and head it uses are the model's, not trained) is the only thing optax
updates, on the same synthetic corpus as `ds4jax.demo.train` (same draw, same tokenizer,
same prefix/suffix split; the block's window over the shared prefix is evaluated without
gradient, as the model's is there). Reported: the block's top-1 accuracy on unseen
conversations — how often its argmax is the token two ahead, and how often it is the
model's own argmax there, the greedy acceptance rate — before and after training, beside
the model's own next-token accuracy. The block is saved into the model's checkpoint
(`params["mtp"]`, metadata `mtp_layers` 1), read only on request
(`restore_params(..., mtp=True)`, `load_model(..., mtp=True)`); `training.json` keeps
the settings and figures under "mtp".

Seeded and reproducible on one machine, like `train`. Measured on 2 CPU cores with nothing
else running: 400 steps of 16 conversations in 176 s, 211 s in all; loss → 0.127. On 192
unseen conversations (another draw of the generator) the block's argmax is token i+2 at
94.5% of assistant tokens and the model's own argmax at 94.6% (random block weights: 1.5%;
the model's own next-token top-1: 99.6%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ds4jax.chat import specials
from ds4jax.chat.spm_tokenizer import SpmTokenizer
from ds4jax.config import Config
from ds4jax.demo.corpus import training_bodies
from ds4jax.demo.train import (
    DEMO_DIR,
    TOKENIZER_NAME,
    Corpus,
    TrainSettings,
    _say,
    dense_moe,
    draw_batch,
    encode_corpus,
    pad_prefixes,
    run_steps,
    training_record,
)
from ds4jax.model.forward import forward_chunk, mtp_chunk
from ds4jax.model.params import Params, init_params
from ds4jax.model.state import DecodeState, init_state
from ds4jax.weights.checkpoint import is_params_checkpoint, restore_params, save_params

_TRAIN = TrainSettings()


@dataclasses.dataclass(frozen=True)
class MtpSettings:
    seed: int = 0
    #: the main model's corpus draw (`TrainSettings`: same seed, same conversations)
    examples: int = _TRAIN.examples
    suffix_lens: tuple[int, ...] = _TRAIN.suffix_lens
    prefix_len: int = _TRAIN.prefix_len
    batch: int = 16
    steps: int = 400
    lr: float = 3e-3
    warmup: int = 30
    #: held-out conversations (another draw of the generator) scored before and after
    #: training (0: none)
    eval_examples: int = 192
    eval_seed: int = 7_000_001


@dataclasses.dataclass
class Context:
    """A corpus's distinct prefixes evaluated once by the frozen model: the states its
    suffixes continue, the streams at each prefix position, and the token after each (the
    last prefix position's is the `<｜User｜>` every suffix starts with)."""

    states: list[DecodeState]
    streams: list[jax.Array]  # [prefix_len, hc, D] each
    after: np.ndarray  # [prefixes, prefix_len]
    lengths: list[int]


def prefix_context(
    params: Params, cfg: Config, corpus: Corpus, prefix_len: int, max_len: int, pad: int,
    user: int,
) -> Context:  # fmt: skip
    prefixes = pad_prefixes(corpus, prefix_len, pad)
    state0 = init_state(cfg, max_len)
    states, streams = [], []
    after = np.full_like(prefixes, pad)
    for g, p in enumerate(corpus.prefixes):
        state, _, X = forward_chunk(params, state0, prefixes[g], len(p), cfg=cfg, streams=True)
        states.append(state)
        streams.append(X)
        after[g, : len(p)] = [*p[1:], user]
    return Context(states, streams, after, [len(p) for p in corpus.prefixes])


def _mtp_logits(params: Params, mtp: Any, ctx: DecodeState, Hp: jax.Array, after: jax.Array,
                n_prefix: jax.Array, toks: jax.Array, max_len: int, cfg: Config,
                all_logits: bool = False) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """The block's logits [B, T, vocab] over a batch of suffixes (row i: its draft for
    token i+2), and the model's ([B, T, vocab] with `all_logits`, else its last row)."""
    params = jax.lax.stop_gradient(params)
    full = {**params, "mtp": mtp}
    m0 = init_state(cfg.mtp_block(), max_len).layers[0]
    _, _, mctx = mtp_chunk(full, Hp, after, m0, 0, n_prefix, cfg=cfg)
    mctx = jax.lax.stop_gradient(mctx)

    def one(t: jax.Array) -> tuple[jax.Array, jax.Array]:
        T = t.shape[0]
        _, logits, H = forward_chunk(params, ctx, t, T, cfg=cfg, all_logits=all_logits,
                                     streams=True)  # fmt: skip
        nxt = jnp.concatenate([t[1:], t[-1:]])  # the last one's is padding (never scored)
        return mtp_chunk(full, H, nxt, mctx, n_prefix, T, cfg=cfg)[0], logits

    return jax.vmap(one)(toks)


def make_step(cfg: Config, max_len: int, opt: optax.GradientTransformation):
    def loss_fn(mtp, params, ctx, Hp, after, n_prefix, toks, mask):
        mlog, _ = _mtp_logits(params, mtp, ctx, Hp, after, n_prefix, toks, max_len, cfg)
        logp = jax.nn.log_softmax(mlog[:, :-2], axis=-1)
        nll = -jnp.take_along_axis(logp, toks[:, 2:, None], axis=-1)[..., 0]
        m = mask[:, 2:]
        return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)

    @jax.jit
    def step(mtp, opt_state, params, ctx, Hp, after, n_prefix, toks, mask):
        loss, grads = jax.value_and_grad(loss_fn)(mtp, params, ctx, Hp, after, n_prefix, toks, mask)
        updates, opt_state = opt.update(grads, opt_state, mtp)
        return optax.apply_updates(mtp, updates), opt_state, loss

    return step


@partial(jax.jit, static_argnames=("max_len", "cfg"))
def _counts(params, mtp, ctx, Hp, after, n_prefix, toks, mask, *, max_len, cfg) -> jax.Array:
    """[block's argmax = token i+2, = the model's argmax there, scored positions, model's
    argmax = token i+1, its scored positions] over a batch."""
    mlog, logits = _mtp_logits(params, mtp, ctx, Hp, after, n_prefix, toks, max_len, cfg,
                               all_logits=True)  # fmt: skip
    draft, main = jnp.argmax(mlog, -1), jnp.argmax(logits, -1)
    m2, m1 = mask[:, 2:], mask[:, 1:]
    return jnp.stack([
        jnp.sum((draft[:, :-2] == toks[:, 2:]) * m2),
        jnp.sum((draft[:, :-2] == main[:, 1:-1]) * m2),
        jnp.sum(m2),
        jnp.sum((main[:, :-1] == toks[:, 1:]) * m1),
        jnp.sum(m1),
    ])  # fmt: skip


def score(params: Params, mtp: Any, cfg: Config, corpus: Corpus, context: Context,
          batch: int, max_len: int) -> dict[str, float] | None:  # fmt: skip
    """Top-1 accuracies over every assistant token of `corpus` (padded to its longest
    bucket, so one program): `mtp_top1` the block's argmax at i is token i+2,
    `mtp_agrees` it is the model's argmax there (the greedy acceptance rate, teacher
    forced), `main_top1` the model's argmax at i is token i+1. None for no conversations."""
    if not len(corpus.group):
        return None
    total = np.zeros(5)
    for g in range(len(corpus.prefixes)):
        rows = np.flatnonzero(corpus.group == g)
        for start in range(0, len(rows), batch):
            idx = rows[start : start + batch]
            mask = np.zeros((batch, corpus.mask.shape[1]), np.float32)
            mask[: len(idx)] = corpus.mask[idx]
            idx = np.resize(idx, batch)  # fill the last batch, its extra rows unscored
            total += np.asarray(_counts(
                params, mtp, context.states[g], context.streams[g], context.after[g],
                context.lengths[g], corpus.suffix[idx], mask, max_len=max_len, cfg=cfg,
            ))  # fmt: skip
    return {
        "mtp_top1": round(float(total[0] / total[2]), 4),
        "mtp_agrees": round(float(total[1] / total[2]), 4),
        "main_top1": round(float(total[3] / total[4]), 4),
        "tokens": int(total[2]),
    }


def _leaves_equal(a: Params, b: Params) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb, strict=True)
    )


def train_mtp(
    settings: MtpSettings, src: Path = DEMO_DIR, out: Path | None = None, *,
    log: Callable[[str], None] = _say,
) -> dict[str, Any]:  # fmt: skip
    """Train the MTP block of the demo model at `src` and save model + block to `out`
    (default `src`, replaced; its tokenizer and `training.json` kept, the latter with an
    "mtp" record added). Returns that record."""
    src, out = Path(src).absolute(), Path(out or src).absolute()
    t_start = time.perf_counter()
    cfg, params = restore_params(src)
    params = jax.device_put(params, jax.devices()[0])  # committed: one compile per shape
    tok = SpmTokenizer(src / (TOKENIZER_NAME + ".model"))
    user = tok.special_id(specials.USER)
    lens = settings.suffix_lens
    corpus = encode_corpus(training_bodies(settings.examples, settings.seed), tok, lens)
    held = encode_corpus(training_bodies(settings.eval_examples, settings.eval_seed), tok, lens)
    max_len = settings.prefix_len + max(lens)
    mtp = jax.device_put(init_params(cfg, settings.seed, mtp_layers=1)["mtp"], jax.devices()[0])
    with dense_moe():
        ctx = prefix_context(params, cfg, corpus, settings.prefix_len, max_len, tok.eos_id, user)
        held_ctx = prefix_context(params, cfg, held, settings.prefix_len, max_len, tok.eos_id,
                                  user)  # fmt: skip
        log(
            f"corpus: {len(corpus.group)} conversations, {int(corpus.mask.sum())} assistant "
            f"tokens; held out {len(held.group)} ({time.perf_counter() - t_start:.0f}s)"
        )
        before = score(params, mtp, cfg, held, held_ctx, settings.batch, max_len)
        log(f"random block: {before}")
        sched = optax.warmup_cosine_decay_schedule(
            0.0, settings.lr, settings.warmup, settings.steps, settings.lr / 10
        )
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
        opt_state = jax.device_put(opt.init(mtp), jax.devices()[0])
        step = make_step(cfg, max_len, opt)
        rng = np.random.default_rng(settings.seed)

        def one(_: int) -> jax.Array:
            nonlocal mtp, opt_state
            g, b, idx = draw_batch(rng, corpus, settings.batch)
            n = lens[b]
            mtp, opt_state, loss = step(
                mtp, opt_state, params, ctx.states[g], ctx.streams[g], ctx.after[g],
                ctx.lengths[g], corpus.suffix[idx, :n], corpus.mask[idx, :n],
            )  # fmt: skip
            return loss

        losses, train_s = run_steps(settings.steps, one, log)
        after = score(params, mtp, cfg, held, held_ctx, settings.batch, max_len)
    log(f"trained block: {after}")
    record = training_record(settings, losses, train_s, t_start,
                             held_out={"trained": after, "random_init": before})  # fmt: skip
    save_with_block(params, mtp, cfg, src, out, record)
    log(f"saved {out}: final loss {losses[-1]:.4f}, {record['total_seconds']:.0f}s in all")
    return record


def save_with_block(params: Params, mtp: Any, cfg: Config, src: Path, out: Path,
                    record: dict[str, Any]) -> None:  # fmt: skip
    """The model and its block as one checkpoint at `out`, written beside it first and
    checked (the model's leaves restore bit for bit, the block as trained) before it
    replaces `out`; the tokenizer and `training.json` (+ "mtp") come from `src`."""
    if out.exists() and not is_params_checkpoint(out):
        raise FileExistsError(f"{out} exists and is not a ds4jax params checkpoint")
    tmp, old = out.with_name(f".{out.name}.mtp-new"), out.with_name(f".{out.name}.mtp-old")
    for d in (tmp, old):
        if d.exists():
            shutil.rmtree(d)
    save_params({**params, "mtp": mtp}, cfg, tmp)
    try:
        for suffix in (".model", ".vocab"):
            shutil.copyfile(src / (TOKENIZER_NAME + suffix), tmp / (TOKENIZER_NAME + suffix))
        meta = src / "training.json"
        training = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else {}
        training["mtp"] = record
        (tmp / "training.json").write_text(json.dumps(training, indent=1) + "\n",
                                           encoding="utf-8")  # fmt: skip
        if not _leaves_equal(restore_params(tmp)[1], params):
            raise RuntimeError("the model's weights did not restore bit for bit")
        if not _leaves_equal(restore_params(tmp, mtp=True)[1]["mtp"], mtp):
            raise RuntimeError("the MTP block did not restore as trained")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    d = MtpSettings()
    ap = argparse.ArgumentParser(prog="python -m ds4jax.demo.train_mtp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--src", default=str(DEMO_DIR), help=f"the model ({DEMO_DIR})")
    ap.add_argument("--out", default=None, help="where model + block go (default: --src)")
    for f in dataclasses.fields(MtpSettings):
        default = getattr(d, f.name)
        kind = _int_tuple if isinstance(default, tuple) else type(default)
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default)
    args = ap.parse_args(argv)
    settings = MtpSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(d)})
    train_mtp(settings, Path(args.src), Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
