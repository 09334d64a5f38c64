"""Weights that stay in the release's own formats on device (`--weights fp8`).

The official release stores its linears as FP8 E4M3 with one power-of-two scale per 128×128
block and its routed experts as FP4 E2M1 with one per 32 inputs (`weights.official`). Expanded
to bf16 at load they take twice (FP8) to four times (FP4) the device memory; here they stay
as they are — `float8_e4m3fn` values, FP4 codes packed two per byte as the release packs
them, and E8M0 exponent bytes — and are expanded inside the jitted step where they are used.
The expansion is exact in float32 (a value of at most 4 significant bits times a power of
two), so logits equal the dequantize-at-load path up to the order of float32 operations.

FP4 stays packed in plain `uint8` rather than a 4-bit dtype: XLA:CPU stores a sub-byte dtype
one per byte, and its conversion from `float4_e2m1fn` ran the bench-192m decode step 7×
slower than f32 (issue 27). The codes are decoded with integer ops and a bitcast, which fuse
into the product on every backend (`matmul`).

A `QWeight` is a pytree node (its arrays are leaves), so params holding them jit, shard and
donate like any other.
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
    """Values [..., out, in] (FP8), or FP4 codes packed two per byte [..., out, in/2] (uint8,
    the low nibble the even column: `packed`), and E8M0 exponents [..., out/block[0],
    in/block[1]] (uint8, scale = 2^(e−127)); `block`: the elements one scale covers, along
    out and in (FP8: 128×128, FP4: 1×32). Leading dims (experts) index both alike."""

    q: Any
    exp: Any
    block: tuple[int, int] = field(metadata={"static": True})

    @property
    def packed(self) -> bool:
        return self.q.dtype == jnp.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, i = self.q.shape
        return (*lead, 2 * i) if self.packed else (*lead, i)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.exp.nbytes)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QWeight)


def _scales(w: QWeight) -> jax.Array:
    return jnp.ldexp(jnp.float32(1.0), w.exp.astype(jnp.int32) - E8M0_BIAS)


def e2m1(codes: jax.Array) -> jax.Array:
    """FP4 E2M1 codes (0…15, any integer dtype) → float32, by building the float's bits:
    magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign."""
    c = codes.astype(jnp.uint32)
    mag = c & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)  # (1 + m/2)·2^(e−1), e ≥ 1
    bits = jnp.where(mag < 2, mag * jnp.uint32(0x3F000000), normal)  # 0 and 0.5 (subnormal)
    return jax.lax.bitcast_convert_type(bits | ((c & 8) << 28), jnp.float32)


def _fp4_halves(w: QWeight) -> tuple[jax.Array, jax.Array]:
    """A packed FP4 weight's even and odd input columns, scaled: two [..., out, in/2]."""
    *lead, o, h = w.q.shape
    bi = w.block[1]
    scale = _scales(w)[..., None]  # [..., out, in/bi, 1]: a block is bi/2 bytes of each half

    def half(codes: jax.Array) -> jax.Array:
        return (e2m1(codes).reshape(*lead, o, h * 2 // bi, bi // 2) * scale).reshape(*lead, o, h)

    return half(w.q & 0x0F), half(w.q >> 4)


def dequantize(w: Any, dtype: Any = jnp.float32) -> jax.Array:
    """A `QWeight` as a dense array of `dtype` (anything else is returned as it is); partial
    edge blocks are cut to the weight's shape."""
    if not isinstance(w, QWeight):
        return w
    if w.packed:
        even, odd = _fp4_halves(w)
        return jnp.stack([even, odd], axis=-1).reshape(w.shape).astype(dtype)
    o, i = w.q.shape[-2:]
    bo, bi = w.block
    scale = jnp.repeat(jnp.repeat(_scales(w), bo, axis=-2)[..., :o, :], bi, axis=-1)[..., :i]
    return (w.q.astype(jnp.float32) * scale).astype(dtype)


def matmul(x: jax.Array, w: Any) -> jax.Array:
    """x [..., in] @ wᵀ for a weight [out, in], dense or a `QWeight`. Packed FP4 is never
    interleaved back: its even and odd columns meet x's even and odd inputs in two products
    (the interleave alone cost 10× the product on XLA:CPU)."""
    if isinstance(w, QWeight) and w.packed:
        even, odd = _fp4_halves(w)
        return (jnp.einsum("...i,oi->...o", x[..., 0::2], even.astype(x.dtype))
                + jnp.einsum("...i,oi->...o", x[..., 1::2], odd.astype(x.dtype)))  # fmt: skip
    return jnp.einsum("...i,oi->...o", x, dequantize(w, x.dtype))


def expert(w: Any, e: jax.Array) -> Any:
    """Expert `e` of stacked expert weights [E, out, in], as stored: only that expert's
    values are read (and expanded where `matmul` uses them)."""
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False)  # noqa: E731
    return QWeight(pick(w.q), pick(w.exp), w.block) if isinstance(w, QWeight) else pick(w)


def dense(tree: Any, dtype: Any = jnp.float32, keep: frozenset[str] = frozenset()) -> Any:
    """A layer's params with every `QWeight` expanded, except the leaves named in `keep`
    (a dict's keys at any depth: the routed experts, read one at a time by `expert` and
    expanded where `matmul` uses them)."""
    if isinstance(tree, dict):
        return {k: v if k in keep else dense(v, dtype, keep) for k, v in tree.items()}
    return dequantize(tree, dtype)


def stack(parts: list[QWeight]) -> QWeight:
    """Per-expert weights → one stacked along a new leading axis (host arrays)."""
    return QWeight(np.stack([p.q for p in parts]), np.stack([p.exp for p in parts]),
                   parts[0].block)  # fmt: skip


def to_device(w: QWeight) -> QWeight:
    return QWeight(jnp.asarray(w.q), jnp.asarray(w.exp), w.block)


def split_size(sizes: Any, ax: Any) -> int:
    """Devices a dimension is split over (`sizes`: the mesh's axis sizes): one mesh axis,
    several together (experts over data × expert), or none (1)."""
    if ax is None:
        return 1
    return int(np.prod([sizes[a] for a in (ax if isinstance(ax, tuple) else (ax,))]))


def shardings_like(sharding: Any, w: QWeight) -> QWeight:
    """The sharding of a `QWeight` from its dense weight's `NamedSharding`: values split as
    the weight is; each exponent dim split along the same mesh axis when it divides (a
    block never straddles two shards then), else replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (w.q.ndim - len(sharding.spec))

    axes = [
        ax if ax is not None and d % split_size(mesh.shape, ax) == 0 else None
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


def hold_bf16_where_exact(tree: Any) -> Any:
    """`tree` with every f32 matrix whose values are all bfloat16 values held in bf16: the
    same numbers in half the bytes (a release stores its head, embedding and most linears
    in BF16, or in FP8 with power-of-two scales, which widen to f32 exactly). Every use
    widens a weight to the activations' f32 first (`dequantize`, the native GEMV), so the
    model computes what it computed from the f32 copy, bit for bit, reading half the bytes
    per decode step (issue 27: `--weights fp4-experts`, like for like with llama.cpp's
    as-converted GGUF, which keeps these tensors in BF16)."""

    def hold(w: Any) -> Any:
        if not (
            isinstance(w, jax.Array)
            and w.dtype == jnp.float32
            and w.ndim == 2
            and w.is_fully_addressable
        ):  # (a multi-host array stays as it is)
            return w
        half = w.astype(jnp.bfloat16)
        return half if bool(jnp.array_equal(half.astype(jnp.float32), w)) else w

    return jax.tree.map(hold, tree)
