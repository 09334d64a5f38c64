"""Pallas kernels vs their jnp twins: time and achieved memory bandwidth.

On CPU the kernels run interpreted (a correctness mode, not a speed one), so CPU figures
say nothing about TPU/GPU performance; run this on an accelerator for the real comparison.
Bandwidth = bytes of keys (and queries) the kernel must read / time.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from ds4jax.pallas_kernels.indexer_scores import indexer_scores, indexer_scores_reference
from ds4jax.pallas_kernels.sink_attention import sink_attention, sink_attention_reference


def _time(fn, *args, repeat: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def main(quick: bool = False) -> dict:
    interpret = jax.default_backend() == "cpu"
    shapes = [(1, 64, 512, 1152), (256, 64, 512, 1152)]  # decode and a prefill chunk, Flash heads
    if quick:
        shapes = [(1, 8, 128, 512), (64, 8, 128, 512)]
    rows = []
    print(f"backend {jax.default_backend()} (kernels interpreted: {interpret})", flush=True)
    for T, H, D, K in shapes:
        k = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(k[0], (T, H, D))
        keys = jax.random.normal(k[1], (K, D))
        mask = jax.random.bernoulli(k[2], 0.9, (T, K))
        sink = jax.random.normal(k[3], (H,))
        kern = jax.jit(lambda *a: sink_attention(*a, interpret=interpret))
        ref = jax.jit(sink_attention_reference)
        t_k, t_r = _time(kern, q, keys, mask, sink), _time(ref, q, keys, mask, sink)
        nbytes = (q.size + keys.size + mask.size // 4 + T * H * D) * 4
        row = {"op": "sink_attention", "T": T, "H": H, "D": D, "K": K, "kernel_ms": t_k * 1e3,
               "twin_ms": t_r * 1e3, "kernel_GBps": nbytes / t_k / 1e9}  # fmt: skip
        rows.append(row)
        print(
            f"sink_attention T={T:<4} H={H} D={D} K={K}: kernel {t_k * 1e3:8.2f} ms "
            f"({row['kernel_GBps']:.2f} GB/s)  twin {t_r * 1e3:8.2f} ms",
            flush=True,
        )
    T, IH, d, C = (64, 16, 64, 1024) if quick else (256, 64, 128, 4096)
    k = jax.random.split(jax.random.key(1), 4)
    args = (
        jax.random.normal(k[0], (T, IH, d)),
        jax.random.normal(k[1], (T, IH)),
        jax.random.normal(k[2], (C, d)),
        jnp.ones((T, C), bool),
    )
    kern = jax.jit(lambda *a: indexer_scores(*a, interpret=interpret))
    t_k, t_r = _time(kern, *args), _time(jax.jit(indexer_scores_reference), *args)
    rows.append({"op": "indexer_scores", "T": T, "IH": IH, "d": d, "C": C,
                 "kernel_ms": t_k * 1e3, "twin_ms": t_r * 1e3})  # fmt: skip
    print(f"indexer_scores T={T} IH={IH} d={d} C={C}: kernel {t_k * 1e3:.2f} ms  twin "
          f"{t_r * 1e3:.2f} ms", flush=True)  # fmt: skip
    return {"backend": jax.default_backend(), "interpreted": interpret, "quick": quick,
            "rows": rows}  # fmt: skip


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
