"""Weights that stay in the release's own formats on device (`--weights fp8`).

The official release stores its linears as FP8 E4M3 with one power-of-two scale per 128×128
block and its routed experts as FP4 E2M1 with one per 32 inputs (`model.official`). Expanded
to bf16 at load they take twice (FP8) to four times (FP4) the device memory; here they stay
as they are — `float8_e4m3fn` / `float4_e2m1fn` values and E8M0 exponent bytes — and are
expanded inside the jitted step, one layer at a time, where they are used. The expansion is
exact in float32 (a value of at most 4 significant bits times a power of two), so logits
equal the dequantize-at-load path up to the order of float32 operations.

A `QWeight` is a pytree node (its arrays are leaves), so params holding them jit, shard and
donate like any other. Where a sub-byte dtype is stored one per byte (XLA:CPU does), FP4
takes as many bytes as FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

E8M0_BIAS = 127


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QWeight:
    """Values [..., out, in] and E8M0 exponents [..., out/block[0], in/block[1]] (uint8,
    scale = 2^(e−127)); `block`: the elements one scale covers, along out and in (FP8:
    128×128, FP4: 1×32). Leading dims (experts) index both alike."""

    q: Any
    exp: Any
    block: tuple[int, int] = field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.exp.nbytes)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QWeight)


def dequantize(w: Any, dtype: Any = jnp.float32) -> jax.Array:
    """A `QWeight` as a dense array of `dtype` (anything else is returned as it is); partial
    edge blocks are cut to the weight's shape."""
    if not isinstance(w, QWeight):
        return w
    o, i = w.q.shape[-2:]
    bo, bi = w.block
    scale = jnp.ldexp(jnp.float32(1.0), w.exp.astype(jnp.int32) - E8M0_BIAS)
    scale = jnp.repeat(jnp.repeat(scale, bo, axis=-2)[..., :o, :], bi, axis=-1)[..., :i]
    return (w.q.astype(jnp.float32) * scale).astype(dtype)


def expert(w: Any, e: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """Expert `e` of stacked expert weights [E, out, in], dense: only that expert's values
    are read and expanded."""
    if isinstance(w, QWeight):
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False)  # noqa: E731
        return dequantize(QWeight(pick(w.q), pick(w.exp), w.block), dtype)
    return jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False)


def dense(tree: Any, dtype: Any = jnp.float32, keep: frozenset[str] = frozenset()) -> Any:
    """A layer's params with every `QWeight` expanded, except the leaves named in `keep`
    (a dict's keys at any depth: the routed experts, expanded one at a time by `expert`)."""
    if isinstance(tree, dict):
        return {k: v if k in keep else dense(v, dtype, keep) for k, v in tree.items()}
    return dequantize(tree, dtype)


def stack(parts: list[QWeight]) -> QWeight:
    """Per-expert weights → one stacked along a new leading axis (host arrays)."""
    return QWeight(np.stack([p.q for p in parts]), np.stack([p.exp for p in parts]),
                   parts[0].block)  # fmt: skip


def to_device(w: QWeight) -> QWeight:
    return QWeight(jnp.asarray(w.q), jnp.asarray(w.exp), w.block)


def shardings_like(sharding: Any, w: QWeight) -> QWeight:
    """The sharding of a `QWeight` from its dense weight's `NamedSharding`: values split as
    the weight is; each exponent dim split along the same mesh axis when it divides (a
    block never straddles two shards then), else replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (w.q.ndim - len(sharding.spec))
    axes = [
        ax if ax is not None and d % mesh.shape[ax] == 0 else None
        for ax, d in zip(spec, w.exp.shape, strict=True)
    ]
    return QWeight(sharding, NamedSharding(mesh, PartitionSpec(*axes)), w.block)


def device_bytes(params: Any) -> dict[Any, int]:
    """Bytes of the params on each of this process's devices (`ds4jax serve` reports the
    largest at start-up)."""
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(params):
        for shard in getattr(leaf, "addressable_shards", ()):
            out[shard.device] = out.get(shard.device, 0) + int(shard.data.nbytes)
    return out or {None: 0}
