"""Next-token selection from logits: greedy at temperature 0, else temperature sampling with
optional top-k / top-p / min-p filtering. Pure functions of (logits, key)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,
    key: jax.Array,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> jax.Array:
    """A token id (int32 scalar). Filters apply in the order top-k, top-p, min-p, on the
    temperature-scaled distribution; at least the most likely token always survives."""
    logits = logits.astype(jnp.float32)
    if temperature <= 0:
        return jnp.argmax(logits).astype(jnp.int32)
    z = logits / temperature
    if top_k and top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, top_k)[0][-1]
        z = jnp.where(z < kth, -jnp.inf, z)
    if top_p < 1.0:
        order = jnp.argsort(-z)
        probs = jax.nn.softmax(z[order])
        keep_sorted = (jnp.cumsum(probs) - probs) < top_p
        keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        z = jnp.where(keep, z, -jnp.inf)
    if min_p > 0.0:
        probs = jax.nn.softmax(z)
        z = jnp.where(probs < min_p * jnp.max(probs), -jnp.inf, z)
    return jax.random.categorical(key, z).astype(jnp.int32)
