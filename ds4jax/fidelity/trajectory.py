"""The live side: the model under study (`load_model`), how its tokens are drawn
(`emittable`), and one seeded tool loop served through the real `Engine` (`live_trajectory`),
with the continuation sampled from the live state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.chat import specials
from ds4jax.chat.anthropic import parse_messages_request, response_content
from ds4jax.chat.segments import template
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.continuation.types import CacheSource
from ds4jax.engine import Engine
from ds4jax.fidelity.conversations import (
    _RESULTS,
    CLIENTS,
    SYSTEM,
    TASKS,
    TOOLS,
    client_roundtrip,
    sampled_dsml,
)
from ds4jax.model.forward import decode_step, prefill
from ds4jax.model.state import DecodeState, init_state
from ds4jax.sampling import sample


def load_model(
    model: str | Path = "tiny",
    *,
    seed: int = 0,
    max_len: int = 8192,
    chunk_sizes: Sequence[int] = (16, 64),
    quant_sim: bool | None = None,
) -> Engine:
    """An Engine for a named config with random weights (`seed`; quantization simulation off
    unless asked, so the `exact` control measures float rounding only) or a checkpoint
    directory / named model such as `demo` (`ds4jax.weights.checkpoint.load_model`: its own
    tokenizer when it ships one; its config's `quant_sim` unless overridden)."""
    from ds4jax.chat.tokenizer import load_tokenizer
    from ds4jax.weights.checkpoint import load_model as load
    from ds4jax.weights.checkpoint import resolve_model_dir

    try:
        checkpoint = resolve_model_dir(model).is_dir()
    except FileNotFoundError:
        checkpoint = False
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if checkpoint:
        cfg, params, tok, _ = load(model, dtype=dtype, load_tokenizer=load_tokenizer)
    else:
        cfg, params, tok, _ = load(None, str(model), seed, dtype, load_tokenizer=load_tokenizer)
        quant_sim = bool(quant_sim)
    if quant_sim is not None:
        cfg = cfg.replace(quant_sim=quant_sim)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer vocab {tok.vocab_size} > model vocab {cfg.vocab_size}")
    return Engine(cfg, params, tok, max_len=max_len, chunk_sizes=chunk_sizes)


_sample = jax.jit(sample, static_argnames=("temperature", "top_k", "top_p", "min_p"))
_MAX_REJECTIONS = 1000


def emittable(tok: Tokenizer, token: int, text: str) -> bool:
    """Whether the sampler keeps `token` after `text`. A trained model emits byte fragments
    in valid sequences, and markers (`</think>`, DSML) and added tokens (placeholders) on
    purpose; random weights emit them at random, which would end the reasoning early, break
    UTF-8 or spell text no tokenizer produces. So a token must be whole UTF-8, be what the
    plain tokenizer can produce for its own text, and not complete a template special string
    with the text before it. Any merge of the vocabulary stays possible, so a run of sampled
    ids can still retokenize differently."""
    try:
        piece = tok.token_bytes(token).decode("utf-8")
    except (UnicodeDecodeError, IndexError, KeyError):
        return False
    if not piece or token not in tok.encode_text(piece):
        return False
    tail = text[-32:] + piece
    return not any(s in tail for s in specials.TEMPLATE_SPECIALS)


def _draw(
    tok: Tokenizer,
    logits: jax.Array,
    key: jax.Array,
    text: str,
    settings: Settings,
    stop: int | None = None,
) -> tuple[int, jax.Array]:
    """(a token sampled from `logits` that is `emittable` after `text`, or is `stop`; the
    next key). A rejected token is removed from the distribution and the rest sampled
    again."""
    for _ in range(_MAX_REJECTIONS):
        key, sub = jax.random.split(key)
        t = int(_sample(logits, sub, temperature=settings.temperature, min_p=settings.min_p))
        if t == stop or emittable(tok, t, text):
            return t, key
        logits = logits.at[t].set(-jnp.inf)
    raise RuntimeError(f"no emittable token in {_MAX_REJECTIONS} draws after {text[-40:]!r}")


@dataclass(frozen=True)
class Settings:
    """What `run` measures. `reasoning_tokens` is the most reasoning sampled per turn (each
    conversation draws a length in [max/2, max]; a sampled `</think>` ends it sooner);
    `positions` the teacher-forced continuation positions compared after the first;
    `split_prob` the chance that a sampled reasoning token, or a plain run of the forced DSML,
    is emitted as two tokens: the non-canonical ids a model samples now and then (random
    tokens form such runs by themselves only now and then, e.g. adjacent CJK tokens that BPE
    would merge). `temperature` and `min_p` are the server's sampling defaults."""

    conversations: int = 32
    positions: int = 16
    reasoning_tokens: int = 48
    seed: int = 0
    temperature: float = 1.0
    min_p: float = 0.05
    split_prob: float = 0.05


@dataclass
class Trajectory:
    """One live tool loop, as the engine served it."""

    index: int
    client: str
    first_body: dict[str, Any]
    #: The tool-result request as the client sends it (with its thinking block).
    client_body: dict[str, Any]
    prompt_ids: tuple[int, ...]
    reasoning_ids: tuple[int, ...]
    #: The forced assistant turn after the reasoning: `</think>` + the DSML block.
    call_ids: tuple[int, ...]
    #: The sampled DSML block (as tool memory holds it).
    raw_dsml: str
    #: The live prompt of the tool-result turn: everything the live state has evaluated.
    live_ids: tuple[int, ...]
    source: CacheSource
    continuation: tuple[int, ...] = ()


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


def sampled_ids(
    tok: Tokenizer, text: str, rng: np.random.Generator, split_prob: float
) -> list[int]:
    """Ids of template text (its specials as special ids) as a model may have sampled them:
    each plain run is, with probability `split_prob`, cut at a random character and its
    halves encoded apart, so the ids spell the text but are not its canonical tokenization."""
    ids: list[int] = []
    for seg in template(text):
        if seg.special:
            ids.append(tok.special_id(seg.text))
        elif len(seg.text) > 1 and rng.random() < split_prob:
            cut = int(rng.integers(1, len(seg.text)))
            ids += tok.encode_text(seg.text[:cut]) + tok.encode_text(seg.text[cut:])
        else:
            ids += tok.encode_text(seg.text)
    return ids


def _prompt_state(engine: Engine, ids: Sequence[int]) -> DecodeState:
    state, _ = prefill(
        engine.params, init_state(engine.cfg, engine.max_len), list(ids), engine.cfg,
        chunk_sizes=engine.chunk_sizes,
    )  # fmt: skip
    return state


def live_trajectory(
    engine: Engine, index: int, settings: Settings
) -> tuple[Trajectory, DecodeState, np.ndarray]:
    """Serve one seeded tool loop through `engine`: the first request cold, its assistant
    turn = reasoning sampled from the model (until it samples `</think>` or has its drawn
    length) + a forced DSML call with realistic argument bytes; then the client's
    tool-result request, which must take the live tool path; then `settings.positions`
    tokens sampled from the live state. Returns (trajectory, the prompt state, the live
    logits [positions + 1, vocab] at the first assistant position and after each sampled
    continuation token)."""
    rng = _rng(settings.seed, index)
    key = jax.random.fold_in(jax.random.key(settings.seed), index)
    tok, params, cfg = engine.tokenizer, engine.params, engine.cfg
    client = CLIENTS[int(rng.integers(len(CLIENTS)))]
    first = {
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": TASKS[int(rng.integers(len(TASKS)))]}],
    }
    engine.reset()
    prepared = _prepare(engine, first)
    prompt_ids = prepared.view.tokens
    prompt_state = _prompt_state(engine, prompt_ids)

    # the reasoning, sampled from the model (see `emittable`) until it ends or is long enough
    n_reason = int(
        rng.integers(max(1, settings.reasoning_tokens // 2), settings.reasoning_tokens + 1)
    )
    reasoning: list[int] = []
    text = ""
    state = prompt_state
    think_end = tok.special_id(specials.THINK_END)
    while len(reasoning) < n_reason:
        t, key = _draw(tok, state.logits, key, text, settings, stop=think_end)
        if t == think_end:
            break  # a trained model may end its reasoning: the forced call starts there
        piece = tok.token_bytes(t).decode("utf-8")
        ids = [t]
        if len(piece) > 1 and rng.random() < settings.split_prob:
            cut = int(rng.integers(1, len(piece)))
            ids = tok.encode_text(piece[:cut]) + tok.encode_text(piece[cut:])
        for u in ids:
            state = decode_step(params, state, u, cfg)
        reasoning += ids
        text += piece

    block, n_calls = sampled_dsml(rng)
    call_ids = sampled_ids(tok, specials.THINK_END + block, rng, settings.split_prob)
    res1 = engine.run(prepared, forced_tokens=[*reasoning, *call_ids])
    if res1.finish != "tool_use" or len(res1.tool_ids) != n_calls:
        raise RuntimeError(f"conversation {index}: the forced call did not parse ({res1.finish})")
    raw_dsml = res1.message.raw_dsml
    assert raw_dsml is not None

    content = response_content(res1.message, res1.tool_ids)
    for b in content:
        if b["type"] == "tool_use":
            b["input"] = client_roundtrip(b["input"], client)
    results = [
        {
            "type": "tool_result",
            "tool_use_id": tid,
            "content": _RESULTS[int(rng.integers(len(_RESULTS)))],
        }
        for tid in res1.tool_ids
    ]
    body = dict(
        first,
        messages=[
            *first["messages"],
            {"role": "assistant", "content": content},
            {"role": "user", "content": results},
        ],
    )
    res2 = engine.run(_prepare(engine, body, max_tokens=0))
    live = engine.live
    assert live is not None
    traj = Trajectory(
        index=index, client=client, first_body=first, client_body=body,
        prompt_ids=tuple(prompt_ids), reasoning_ids=tuple(reasoning), call_ids=tuple(call_ids),
        raw_dsml=raw_dsml, live_ids=live.tokens, source=res2.source,
    )  # fmt: skip

    # the live continuation: sampled from the live state, logits kept at every step
    state = live.state
    logits = [np.asarray(state.logits)]
    cont: list[int] = []
    text = ""
    for _ in range(settings.positions):
        t, key = _draw(tok, state.logits, key, text, settings)
        text += tok.token_bytes(t).decode("utf-8")
        cont.append(t)
        state = decode_step(params, state, t, cfg)
        logits.append(np.asarray(state.logits))
    traj.continuation = tuple(cont)
    return traj, prompt_state, np.stack(logits)


def _prepare(engine: Engine, body: dict[str, Any], max_tokens: int = 4096) -> Any:
    return engine.prepare_request(parse_messages_request(body), max_tokens=max_tokens)
