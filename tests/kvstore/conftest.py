"""Shared helpers for the disk store tests: a small config, states with random live rows
(canonical: rows past the live ones keep their initial values), and request-like segments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.chat import specials
from ds4jax.chat.segments import Segment, normalize
from ds4jax.config import load_config
from ds4jax.kvstore.disk import DiskStore
from ds4jax.kvstore.payload import ROW_FIELDS, live_rows
from ds4jax.model.state import DecodeState, init_state

MAX_LEN = 512
USER_ID, ASSISTANT_ID = 128803, 128804


class StubTokenizer:
    """Only what the store asks a tokenizer: the ids of the template's special tokens."""

    def special_id(self, text: str) -> int:
        return {specials.USER: USER_ID, specials.ASSISTANT: ASSISTANT_ID}[text]


@pytest.fixture(scope="session")
def cfg():
    return load_config("tiny").replace(vocab_size=1024)


def fake_state(cfg, n: int, seed: int = 0, max_len: int = MAX_LEN) -> DecodeState:
    """A state as if `n` tokens had been evaluated: random live rows and frontiers."""
    rng = np.random.default_rng(seed)
    empty = init_state(cfg, max_len)
    layers = []
    for i, layer in enumerate(empty.layers):
        kw = {}
        for name, x in vars(layer).items():
            if x is None:
                kw[name] = None
                continue
            a = np.array(x)
            if name in ROW_FIELDS:
                k = live_rows(cfg, i, name, n, a.shape[0] if name == "raw" else 0)
                a[:k] = rng.standard_normal((k, *a.shape[1:]))
            else:
                a[:] = rng.standard_normal(a.shape)
            kw[name] = jnp.asarray(a)
        layers.append(type(layer)(**kw))
    return DecodeState(
        layers=tuple(layers),
        pos=jnp.asarray(n, jnp.int32),
        logits=jnp.asarray(rng.standard_normal(cfg.vocab_size).astype(np.float32)),
    )


def states_equal(a: DecodeState, b: DecodeState) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb, strict=True)
    )


def convo(system: str, *turns: str) -> tuple[Segment, ...]:
    """A rendered-looking prompt: BOS, system text, then user turns and assistant replies."""
    segs = [Segment(specials.BOS, True), Segment(system)]
    for i, t in enumerate(turns):
        segs += [Segment(specials.USER if i % 2 == 0 else specials.ASSISTANT, True), Segment(t)]
    return normalize(segs)


def tokens_for(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(2, 1000, n))


def make_store(directory, cfg, fingerprint: str = "model-a", **kw) -> DiskStore:
    kw.setdefault("min_tokens", 16)
    kw.setdefault("max_len", MAX_LEN)
    return DiskStore(directory, fingerprint, cfg=cfg, tokenizer=StubTokenizer(), **kw)
