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
        z = jnp.where(nucleus(z, top_p), z, -jnp.inf)
    if min_p > 0.0:
        probs = jax.nn.softmax(z)
        z = jnp.where(probs < min_p * jnp.max(probs), -jnp.inf, z)
    return jax.random.categorical(key, z).astype(jnp.int32)


#: Candidates the nucleus is first looked for among: sorting the whole V4 vocabulary
#: (129k) costs ~60 ms per token on CPU, `top_k` of this many ~1 ms.
NUCLEUS_CANDIDATES = 1024


@jax.jit
def nucleus(z: jax.Array, top_p: float | jax.Array) -> jax.Array:
    """Top-p keep mask: a token stays when the probability of the tokens ranked before it
    (descending, ties by lower id) is < top_p. When the best `NUCLEUS_CANDIDATES` tokens
    already hold ≥ top_p of the mass, every kept token is among them and only they are
    ranked; otherwise (a flat distribution) the whole vocabulary is sorted."""
    probs = jax.nn.softmax(z)
    _, top = jax.lax.top_k(z, min(NUCLEUS_CANDIDATES, z.shape[-1]))

    def keep_of(ids: jax.Array) -> jax.Array:
        p_sorted = probs[ids]
        keep_sorted = (jnp.cumsum(p_sorted) - p_sorted) < top_p
        return jnp.zeros(z.shape, bool).at[ids].set(keep_sorted)

    return jax.lax.cond(
        jnp.sum(probs[top]) >= top_p,
        lambda: keep_of(top),
        lambda: keep_of(jnp.argsort(-z, stable=True)),
    )
