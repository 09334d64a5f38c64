"""The comparison measures: next-token KL, top-1 agreement and entropy from logits (float64),
and the shared token prefix of two prompts. Pure numpy, so they are tested apart from any
model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
