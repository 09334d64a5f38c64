"""Continuation fidelity: how far stateless replays drift from the sampled live state.

ds4jax continues a tool loop from the state it sampled: the client's `tool_result` selects the
live frontier by tool id and only the tool-result suffix is prefilled. A stateless server
instead re-renders the JSON history the client sends back and prefills that. The two prompts
spell the same conversation but are not the same tokens:

* (a) **hidden reasoning dropped** — a client that does not send the thinking block back;
* (b) **tool JSON re-serialised** — the client replays `tool_use.input` as parsed JSON, so the
  DSML is rendered canonically from it, not replayed byte for byte (number formatting, key
  order, whitespace, unicode escapes, entities);
* (c) **BPE retokenized** — sampled ids are not always the canonical tokenization of their
  text, and a replay only has the text.

This module measures the effect on the model: for seeded conversations it builds the live
trajectory through the real `Engine` (a cold first request whose assistant turn is sampled
reasoning plus a forced DSML call, then the client's tool-result request, which must take the
live tool path), samples a continuation from the live state, and compares next-token
distributions (KL(live‖replay), top-1 agreement) at the first assistant position and at each
teacher-forced continuation position against replays built from what the client sends back,
rendered by the real renderer and tokenizer.

Replay kinds, by the factors they change (`KINDS`): `exact` (the live ids themselves: the
numerical floor), `a`, `b` (token splices of the live ids that isolate one factor each), `c`,
`a+c`, `b+c`, `a+b+c` (full renders of the client's request; `a+b+c` is what a stateless
server sees when the client drops thinking, and a splice `a+b` would be the same ids, since a
canonical DSML block has nothing left to retokenize).

Every replay shares the prompt (system, tools, user turn) token for token, so each one
continues from one prefilled prompt state — what any prefix-caching server would do; a cold
prefill of the whole gives the same logits (chunked prefill = one-shot prefill, to float
rounding with quant_sim off).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.chat import specials
from ds4jax.chat.anthropic import parse_messages_request, response_content
from ds4jax.chat.dsml_render import render_tool_calls
from ds4jax.chat.render import render
from ds4jax.chat.segments import template
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.continuation.evidence import attach_tool_memory
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.continuation.types import CacheSource
from ds4jax.engine import Engine
from ds4jax.model.forward import decode_step, prefill
from ds4jax.model.state import DecodeState, init_state
from ds4jax.sampling import sample

#: Replay kinds, by the factors they change: a = reasoning dropped, b = tool JSON re-serialised,
#: c = BPE retokenized.
KINDS: tuple[str, ...] = ("exact", "a", "b", "c", "a+c", "b+c", "a+b+c")
KIND_LABELS: dict[str, str] = {
    "exact": "live ids replayed (control: numerics only)",
    "a": "hidden reasoning dropped (sampled ids kept)",
    "b": "tool JSON re-serialised (sampled ids kept)",
    "c": "same text, BPE retokenized (ds4jax fallback, client keeps thinking)",
    "a+c": "reasoning dropped, exact DSML bytes (ds4jax fallback, client drops thinking)",
    "b+c": "stateless server, client keeps thinking",
    "a+b+c": "stateless server, client drops thinking",
}
#: The reference row: a different conversation's live state at the same position.
OTHER = "other"

#: How clients serialise the `tool_use.input` they replay: Python (`json` round trip, floats
#: stay floats), TypeScript (`JSON.stringify` writes 30.0 as 30), Go (`encoding/json` on a
#: `map[string]any`: sorted keys, 30.0 as 30).
CLIENTS: tuple[str, ...] = ("python", "typescript", "go")

SYSTEM = "You are a careful coding agent working in a Python repository."
TASKS: tuple[str, ...] = (
    "The HTTP client times out on large uploads. Find where the timeout is set and fix it.",
    "Run the failing test in tests/test_io.py and tell me why it fails.",
    "Rename the helper `load_cfg` to `load_config` everywhere.",
    "Is there a résumé parser in this repo? Find it and check its unicode handling.",
    "Add a retry with backoff to the download function.",
    "Count the TODO comments under src/ and list the files.",
)
TOOLS: list[dict[str, Any]] = [
    {
        "name": "bash",
        "description": "Run a shell command and return its output",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
    {
        "name": "edit",
        "description": "Replace text in a file",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "replace": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["path", "replace"],
        },
    },
    {
        "name": "search",
        "description": "Search the repository",
        "input_schema": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "paths": {"type": "array", "items": {"type": "string"}},
                "max_results": {"type": "integer"},
                "regex": {"type": "boolean"},
            },
            "required": ["query"],
        },
    },
]

#: Argument bytes as a model may sample them: (DSML value text, string attribute). Several are
#: valid but not canonical, so the client's JSON round trip re-serialises them differently.
_ARGS: dict[str, dict[str, list[tuple[str, bool]]]] = {
    "bash": {
        "command": [
            ("ls -la src", True),
            ('grep -rn "timeout" --include=*.py .', True),
            ("pytest -q tests/test_io.py::test_read", True),
            ("sed -n '1,40p' README.md", True),
            ('echo "café" | wc -c', True),
            ("make test &amp;&amp; git status", True),  # entities: decoded by the parser
        ],
        "timeout": [("30", False), ("30.0", False), ("3e1", False), ("30.50", False)],
    },
    "edit": {
        "path": [("src/client.py", True), ("src/résumé.py", True)],
        "line": [("42", False), ("7", False)],
        "replace": [
            ('{"old": "timeout=10", "new": "timeout=60"}', False),
            ('{"old":"timeout=10","new":"timeout=60"}', False),
            ('{ "new": "retries = 5", "old": "retries = 3" }', False),
            ('{"old": "na\\u00efve", "new": "naïve"}', False),
        ],
        "tags": [
            ('["fix", "io"]', False),
            ('["fix","io"]', False),
            ('["r\\u00e9sum\\u00e9"]', False),
        ],
    },
    "search": {
        "query": [("load_cfg", True), ("TODO", True), ("def download", True)],
        "paths": [('["src", "tests"]', False), ('[ "src" ]', False)],
        "max_results": [("20", False), ("100", False)],
        "regex": [("false", False), ("true", False)],
    },
}
_RESULTS: tuple[str, ...] = (
    "src/client.py:12:    timeout=10\nsrc/upload.py:88:    timeout=timeout",
    "F\n=================== FAILURES ===================\nAssertionError: b'' != b'data'\n"
    "1 failed in 0.04s",
    "Applied 1 edit to src/client.py",
    "7\n",
    "src/parse/résumé.py\nsrc/parse/__init__.py",
)


# ------------------------------------------------------------------------------ the model


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
    directory / named model such as `demo` (`ds4jax.model.checkpoint.load_model`: its own
    tokenizer when it ships one; its config's `quant_sim` unless overridden)."""
    from ds4jax.model.checkpoint import load_model as load
    from ds4jax.model.checkpoint import resolve_model_dir

    try:
        checkpoint = resolve_model_dir(model).is_dir()
    except FileNotFoundError:
        checkpoint = False
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if checkpoint:
        cfg, params, tok, _ = load(model, dtype=dtype)
    else:
        cfg, params, tok, _ = load(None, str(model), seed, dtype)
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


# ------------------------------------------------------------------------------ measures


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p‖q) in nats over the last axis, from logits, in float64 (clipped at 0: rounding
    can make an identical pair a hair negative)."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def top1_agreement(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """Whether the most likely next token is the same, per position."""
    return np.argmax(p_logits, axis=-1) == np.argmax(q_logits, axis=-1)


def entropy(logits: np.ndarray) -> np.ndarray:
    lp = log_softmax(logits)
    return -(np.exp(lp) * lp).sum(axis=-1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens two id sequences share from the start: what a prefix cache could reuse."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------ trajectories


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


@dataclass
class KindResult:
    kind: str
    ids: tuple[int, ...]
    shared_prefix: int
    kl: np.ndarray  # [positions + 1]
    top1: np.ndarray  # [positions + 1] bool


@dataclass
class ConversationResult:
    trajectory: Trajectory
    kinds: dict[str, KindResult]
    live_entropy: float  # at the first assistant position, nats
    #: Whether the client's JSON, rendered canonically, differs from the sampled DSML bytes.
    dsml_changed: bool
    #: Whether the sampled reasoning / DSML ids differ from the canonical tokenization of
    #: their text.
    reasoning_noncanonical: bool
    dsml_noncanonical: bool
    #: The live next-token logits at the first assistant position (for the reference row).
    first_logits: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


def _tool_call(rng: np.random.Generator, tool: str) -> list[tuple[str, str, bool]]:
    """(name, value text, string) of one sampled call: the required parameters and, with
    probability 1/2 each, the optional ones, in schema order."""
    schema = next(t for t in TOOLS if t["name"] == tool)["input_schema"]
    out = []
    for name in schema["properties"]:
        if name in schema["required"] or rng.random() < 0.5:
            options = _ARGS[tool][name]
            value, is_str = options[int(rng.integers(len(options)))]
            out.append((name, value, is_str))
    return out


def sampled_dsml(rng: np.random.Generator) -> tuple[str, int]:
    """A DSML tool-call block as a model may sample it (one call, or two in parallel) and the
    number of calls. The byte layout is the official one; only argument values vary."""
    calls = 2 if rng.random() < 0.3 else 1
    invokes = []
    for _ in range(calls):
        tool = TOOLS[int(rng.integers(len(TOOLS)))]["name"]
        params = [
            f'<{specials.DSML}parameter name="{n}" string="{"true" if s else "false"}">'
            f"{v}</{specials.DSML}parameter>"
            for n, v, s in _tool_call(rng, tool)
        ]
        invokes.append(
            f'<{specials.DSML}invoke name="{tool}">\n'
            + "\n".join(params)
            + f"\n</{specials.DSML}invoke>"
        )
    block = (
        f"\n\n<{specials.DSML}tool_calls>\n"
        + "\n".join(invokes)
        + f"\n</{specials.DSML}tool_calls>"
    )
    return block, calls


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


def client_roundtrip(value: Any, client: str) -> Any:
    """`value` after a client parsed it from the response and serialised it back (see
    `CLIENTS`)."""
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r} (one of {CLIENTS})")
    out = json.loads(json.dumps(value, ensure_ascii=False))
    if client == "python":
        return out

    def fix(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            keys = sorted(v) if client == "go" else list(v)
            return {k: fix(v[k]) for k in keys}
        return v

    return fix(out)


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
    req = parse_messages_request(body)
    return engine.prepare(req.conversation, max_tokens=max_tokens, has_tools=True)


# ------------------------------------------------------------------------------ replays


def _render_ids(tok: Tokenizer, body: dict[str, Any], memory: ToolMemory | None) -> tuple[int, ...]:
    """The client's request rendered and tokenized as a stateless server would; with
    `memory`, the sampled DSML bytes are replayed by tool id (ds4jax's tool memory)."""
    conv = parse_messages_request(body).conversation
    if memory is not None and not attach_tool_memory(conv, memory.block_for):
        raise RuntimeError("tool memory did not cover the replayed call")
    return tuple(tok.encode_segments(render(conv)))


def _without_thinking(body: dict[str, Any]) -> dict[str, Any]:
    messages = []
    for m in body["messages"]:
        if m["role"] == "assistant" and isinstance(m["content"], list):
            m = dict(m, content=[b for b in m["content"] if b["type"] != "thinking"])
        messages.append(m)
    return dict(body, messages=messages)


def splice_ids(
    traj: Trajectory, *, reasoning: bool = True, call: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The live ids with the reasoning removed (`reasoning=False`) and/or the sampled DSML ids
    replaced by `call` (ids of the DSML block, without `</think>`). The cuts sit at template
    specials (`<think>`, `</think>`, EOS) and the tokenizer never merges across a special,
    so a splice is what the renderer gives for that text where the rest keeps its sampled
    ids: one factor changed, the others held."""
    p, r = len(traj.prompt_ids), len(traj.reasoning_ids)
    live = traj.live_ids
    end = p + r + len(traj.call_ids)
    think_end, block = live[p + r : p + r + 1], live[p + r + 1 : end]
    return (
        live[:p]
        + (live[p : p + r] if reasoning else ())
        + think_end
        + (tuple(call) if call is not None else block)
        + live[end:]
    )


def canonical_call_ids(tok: Tokenizer, traj: Trajectory) -> tuple[int, ...]:
    """The DSML block a stateless server renders from the client's `tool_use` JSON."""
    conv = parse_messages_request(traj.client_body).conversation
    calls = next(m for m in conv.messages if m.tool_calls).tool_calls
    return tuple(tok.encode_segments(render_tool_calls(calls)))


def build_replays(engine: Engine, traj: Trajectory) -> dict[str, tuple[int, ...]]:
    """The prompt of the tool-result turn for every kind in `KINDS`: `exact` the live ids,
    `a` and `b` splices of them (`splice_ids`), the `…c` kinds full renders of the client's
    request by the real renderer and tokenizer (with the sampled DSML bytes replayed by tool
    id where the kind keeps them, as ds4jax's tool memory does)."""
    tok = engine.tokenizer
    memory = ToolMemory()
    memory.remember(_tool_use_ids(traj.client_body), traj.raw_dsml)
    body, dropped = traj.client_body, _without_thinking(traj.client_body)
    return {
        "exact": traj.live_ids,
        "a": splice_ids(traj, reasoning=False),
        "b": splice_ids(traj, call=canonical_call_ids(tok, traj)),
        "c": _render_ids(tok, body, memory),
        "a+c": _render_ids(tok, dropped, memory),
        "b+c": _render_ids(tok, body, None),
        "a+b+c": _render_ids(tok, dropped, None),
    }


def _tool_use_ids(body: dict[str, Any]) -> list[str]:
    return [
        b["id"]
        for m in body["messages"]
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_use"
    ]


def replay_logits(
    engine: Engine,
    prompt_state: DecodeState,
    prompt_len: int,
    ids: Sequence[int],
    continuation: Sequence[int],
) -> np.ndarray:
    """Next-token logits [len(continuation) + 1, vocab] of a replay: after its prompt, then
    after each teacher-forced continuation token. Continues the shared prompt state."""
    state, _ = prefill(
        engine.params, prompt_state, list(ids[prompt_len:]), engine.cfg,
        chunk_sizes=engine.chunk_sizes,
    )  # fmt: skip
    out = [np.asarray(state.logits)[None]]
    if continuation:
        _, rest = prefill(
            engine.params, state, list(continuation), engine.cfg,
            chunk_sizes=engine.chunk_sizes, all_logits=True,
        )  # fmt: skip
        out.append(np.asarray(rest))
    return np.concatenate(out)


def measure_conversation(engine: Engine, index: int, settings: Settings) -> ConversationResult:
    """One conversation: the live trajectory, every replay kind, and their comparison."""
    traj, prompt_state, live_logits = live_trajectory(engine, index, settings)
    if traj.source != CacheSource.LIVE_TOOL:
        raise RuntimeError(f"conversation {index}: the tool result took {traj.source.value}")
    replays = build_replays(engine, traj)
    p = len(traj.prompt_ids)
    kinds: dict[str, KindResult] = {}
    for kind, ids in replays.items():
        if ids[:p] != traj.prompt_ids:
            raise RuntimeError(f"conversation {index}: replay {kind} does not share the prompt")
        logits = replay_logits(engine, prompt_state, p, ids, traj.continuation)
        kinds[kind] = KindResult(
            kind=kind,
            ids=ids,
            shared_prefix=common_prefix(ids, traj.live_ids),
            kl=kl_divergence(live_logits, logits),
            top1=top1_agreement(live_logits, logits),
        )
    tok = engine.tokenizer
    return ConversationResult(
        trajectory=traj,
        kinds=kinds,
        live_entropy=float(entropy(live_logits[0])),
        dsml_changed=tok.decode(replays["b"]) != tok.decode(replays["exact"]),
        reasoning_noncanonical=list(traj.reasoning_ids)
        != tok.encode_text(tok.decode(traj.reasoning_ids)),
        dsml_noncanonical=list(traj.call_ids)
        != tok.encode_segments(template(tok.decode(traj.call_ids))),
        first_logits=live_logits[0],
    )


# ------------------------------------------------------------------------------ the study


@dataclass
class Report:
    settings: Settings
    results: list[ConversationResult]
    #: KL / top-1 at the first assistant position between conversation i's live state and
    #: conversation i+1's: the scale of "a different conversation altogether".
    other_kl: np.ndarray
    other_top1: np.ndarray


def run(
    engine: Engine,
    settings: Settings = Settings(),
    *,
    progress: Callable[[int, ConversationResult], None] | None = None,
) -> Report:
    """Measure `settings.conversations` seeded conversations (conversation i is the same
    whatever their number)."""
    results = []
    for i in range(settings.conversations):
        res = measure_conversation(engine, i, settings)
        results.append(res)
        if progress is not None:
            progress(i, res)
    engine.reset()
    n = len(results)
    firsts = [r.first_logits for r in results]
    pairs = [(firsts[i], firsts[(i + 1) % n]) for i in range(n)] if n > 1 else []
    other_kl = np.array([float(kl_divergence(a, b)) for a, b in pairs])
    other_top1 = np.array([bool(top1_agreement(a, b)) for a, b in pairs])
    return Report(settings, results, other_kl, other_top1)


@dataclass(frozen=True)
class KindSummary:
    kind: str
    label: str
    kl_first_mean: float
    kl_first_median: float
    kl_all_mean: float
    kl_all_p90: float
    top1_first: float
    top1_all: float
    shared_prefix_mean: float  # tokens
    shared_fraction_mean: float  # of the live prompt
    length_delta_mean: float  # replay tokens - live tokens
    identical: int  # conversations whose replay ids equal the live ids


def summarize(report: Report) -> list[KindSummary]:
    """One row per replay kind, then the `other` reference row (first position only)."""
    rows = []
    for kind in KINDS:
        rs = [r.kinds[kind] for r in report.results]
        lives = [r.trajectory.live_ids for r in report.results]
        first = np.array([k.kl[0] for k in rs])
        every = np.concatenate([k.kl for k in rs])
        rows.append(
            KindSummary(
                kind=kind,
                label=KIND_LABELS[kind],
                kl_first_mean=float(first.mean()),
                kl_first_median=float(np.median(first)),
                kl_all_mean=float(every.mean()),
                kl_all_p90=float(np.quantile(every, 0.9)),
                top1_first=float(np.mean([k.top1[0] for k in rs])),
                top1_all=float(np.concatenate([k.top1 for k in rs]).mean()),
                shared_prefix_mean=float(np.mean([k.shared_prefix for k in rs])),
                shared_fraction_mean=float(
                    np.mean([k.shared_prefix / len(li) for k, li in zip(rs, lives, strict=True)])
                ),
                length_delta_mean=float(
                    np.mean([len(k.ids) - len(li) for k, li in zip(rs, lives, strict=True)])
                ),
                identical=sum(k.ids == li for k, li in zip(rs, lives, strict=True)),
            )
        )
    if len(report.other_kl):
        o = report.other_kl
        rows.append(
            KindSummary(
                kind=OTHER, label="reference: another conversation's live state",
                kl_first_mean=float(o.mean()), kl_first_median=float(np.median(o)),
                kl_all_mean=float("nan"), kl_all_p90=float("nan"),
                top1_first=float(report.other_top1.mean()), top1_all=float("nan"),
                shared_prefix_mean=float("nan"), shared_fraction_mean=float("nan"),
                length_delta_mean=float("nan"), identical=0,
            )
        )  # fmt: skip
    return rows


def format_table(rows: Sequence[KindSummary]) -> str:
    """A plain-text table of `summarize` (no pandas)."""
    head = (
        f"{'kind':<7} {'KL@0 mean':>10} {'KL@0 med':>10} {'KL all':>10} {'KL p90':>10} "
        f"{'top1@0':>7} {'top1':>6} {'shared':>7} {'shared%':>8} {'Δlen':>6} {'same':>5}"
    )
    lines = [head, "-" * len(head)]

    def num(x: float, fmt: str) -> str:
        return "-" if np.isnan(x) else format(x, fmt)

    for r in rows:
        lines.append(
            f"{r.kind:<7} {num(r.kl_first_mean, '10.3g')} {num(r.kl_first_median, '10.3g')} "
            f"{num(r.kl_all_mean, '10.3g')} {num(r.kl_all_p90, '10.3g')} "
            f"{num(r.top1_first, '7.2f')} {num(r.top1_all, '6.2f')} "
            f"{num(r.shared_prefix_mean, '7.1f')} {num(100 * r.shared_fraction_mean, '7.1f')}% "
            f"{num(r.length_delta_mean, '6.1f')} {r.identical:>5}"
        )
    lines.append("")
    lines += [f"{r.kind:<7} {r.label}" for r in rows]
    return "\n".join(lines)


def factor_counts(report: Report) -> dict[str, int]:
    """How often each factor actually changed something (reasoning is always dropped in
    `a`), and which clients replayed the JSON."""
    rs = report.results
    out = {
        "conversations": len(rs),
        "tool JSON re-serialised to different bytes": sum(r.dsml_changed for r in rs),
        "sampled reasoning ids non-canonical": sum(r.reasoning_noncanonical for r in rs),
        "sampled DSML ids non-canonical": sum(r.dsml_noncanonical for r in rs),
        "parallel tool calls": sum(len(_tool_use_ids(r.trajectory.client_body)) > 1 for r in rs),
    }
    for client in CLIENTS:
        out[f"client {client}"] = sum(r.trajectory.client == client for r in rs)
    return out
