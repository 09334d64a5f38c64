"""What the three kernels share: backend choice, Triton's shape rules, and the dots.

GPU Pallas has two backends; since jax 0.10 a bare `pallas_call` on GPU goes to Mosaic GPU,
whose `pallas_call` path stages every block in shared memory (these kernels' key sets do not
fit) and is deprecated for `pl.kernel`. The kernels are written in the Triton style (whole
blocks as register tensors, loops inside the program), so on GPU they ask for Triton by
passing its `CompilerParams`. Triton wants every loaded or stored block, and every dot
operand, to have a power-of-two size, and tensor-core dots want each side >= 16; the
wrappers pad to that on GPU only, so CPU (interpret) and TPU keep their exact shapes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def on_gpu() -> bool:
    """Trace-time backend test (the kernels' jit caches are per backend anyway)."""
    return jax.default_backend() == "gpu"


def pow2(n: int, at_least: int = 1) -> int:
    """Smallest power of two >= max(n, at_least)."""
    n = max(n, at_least, 1)
    return 1 << (n - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def compiler_params(triton: bool, num_warps: int | None, num_stages: int | None) -> Any:
    if not triton:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def gpu_programs_wanted() -> int:
    """Programs that fill the GPU about twice (an H200 has 132 SMs)."""
    try:
        cores = int(getattr(jax.devices()[0], "core_count", 0) or 0)
    except RuntimeError:
        cores = 0
    return 2 * (cores or 132)


def _precision() -> lax.Precision | None:
    """Honour `jax_default_matmul_precision` as XLA's dots do: Triton lowers a float32 dot
    with no precision to TF32 on tensor cores (as XLA does on GPU by default), and to IEEE
    float32 for HIGHEST; an explicit "highest"/"float32" setting asks for the latter."""
    setting = jax.config.jax_default_matmul_precision
    return lax.Precision.HIGHEST if setting in ("highest", "float32") else None


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] · b [n, k]ᵀ → [m, n] in float32, without materialising a transpose."""
    dims = (((1,), (1,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=_precision(), preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] · b [k, n] → [m, n] in float32."""
    dims = (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=_precision(), preferred_element_type=jnp.float32)


def online_softmax_step(
    m: jax.Array, mass: jax.Array, acc: jax.Array, s: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block into a running (max m [R], mass [R], acc [R, D]): scores s [R, bk]
    (−∞ where hidden), values v [bk, D]. `m` must start finite (the sink), so a block with
    nothing visible leaves the state unchanged instead of producing exp(−∞ + ∞)."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    return m_new, mass * alpha + jnp.sum(p, axis=-1), acc * alpha[:, None] + dot_nn(p, v)
