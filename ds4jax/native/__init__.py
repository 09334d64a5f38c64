"""Native CPU kernels: XLA FFI calls built from C++ on first use (issue 27).

XLA:CPU runs a decode step as hundreds of small library calls, most of them products below
the machine's bandwidth, and it copies each selected expert out of the stacked expert
weights before its product. `routed_cpu.cc` (named for its first kernel) holds the decode
step's kernels, each reading a weight in place once for all the tokens of the call, the
work spread over the library's own helper threads (XLA's pool when another call holds
them): `routed` (the routed experts, f32 or FP4; twin: `model.layers._routed`), `gemv`
(every f32 or bf16 linear of up to `GEMV_ROWS` tokens, the head included; twin: XLA's dot
in `model.quantized.matmul`; `gemv_grouped`, the grouped output projection's, twin: its
einsum; `gemv_many`, a layer's projections of one input in one call, twin: each
`linear`), `argmax` (greedy selection; twin: `sampling.argmax`'s reductions), `draw` (a
sampled row's token under temperature and min-p; twin: `sampling`'s unranked mask and
`draw_rows`), `attend` (a decode step's attention over a layer's key sources in place; twins:
`pallas_kernels.sink_attention_reference` and `sparse_attention_reference`) and
`index_top` (the CSA indexer's scores and top-k picks; twins:
`pallas_kernels.indexer_scores_reference` and `jax.lax.top_k`) and `top_k` (a prefill
chunk's indexer picks from its scores; twin: `jax.lax.top_k`) and `rows` (the embedding
lookup of a bf16 table; twin: the gather). The callers take a
kernel when `active()` and its `*_supported` say so, else the twin; `disabled()` forces the
twins, and `tests/native` compares each pair.

The library is compiled with the machine's C++ compiler (`$CXX`, else `c++`, `-O3
-march=native`) into `~/.cache/ds4jax/native/` (`DS4JAX_NATIVE_CACHE`), under a name that
hashes the source, the flags, the compiler, jaxlib and this CPU, so a shared home directory
never serves a library built for another CPU; a build writes a temporary file and renames
it, so processes building at once never load half a file. Where no compiler works, a
warning says so once and the twins run: nothing else changes. `DS4JAX_NATIVE=0` turns the
kernels off (the twins then run everywhere).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("ds4jax.native")

SOURCE = Path(__file__).with_name("routed_cpu.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
         "-Wall", "-Wno-attributes", "-Wno-return-type", "-Wno-sign-compare")  # fmt: skip
#: the FFI targets the library defines
TARGETS = (
    "ds4jax_routed_f32",
    "ds4jax_routed_fp4",
    "ds4jax_gemv_f32",
    "ds4jax_gemv_grouped_f32",
    "ds4jax_gemv_many_f32",
    "ds4jax_argmax_f32",
    "ds4jax_draw_f32",
    "ds4jax_attend_f32",
    "ds4jax_attend_write_f32",
    "ds4jax_index_top_f32",
    "ds4jax_top_k_f32",
    "ds4jax_rows_f32",
)

_enabled = os.environ.get("DS4JAX_NATIVE", "1") != "0"


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Programs traced inside take the jnp twins (the tests' reference; training, which
    differentiates through the MoE; a side-by-side comparison)."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def _build(cxx: str, target: Path) -> None:
    include = jax.ffi.include_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path() -> Path:
    import jaxlib

    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        version = "none"
    key = hashlib.sha256("\0".join(
        [SOURCE.read_text(), " ".join(FLAGS), cxx, version, jaxlib.__version__, _cpu_id()]
    ).encode()).hexdigest()[:16]  # fmt: skip
    root = Path(os.environ.get("DS4JAX_NATIVE_CACHE", "~/.cache/ds4jax/native")).expanduser()
    return root / f"routed_cpu-{key}.so"


@cache
def library() -> ctypes.CDLL | None:
    """The built library with its targets registered for the CPU platform, or None where it
    cannot be built or loaded (warned once; `active` is then False)."""
    path = library_path()
    try:
        if not path.exists():
            t0 = time.perf_counter()
            _build(os.environ.get("CXX", "c++"), path)
            log.info("native kernels built in %.1f s: %s", time.perf_counter() - t0, path)
        lib = ctypes.cdll.LoadLibrary(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels unavailable, the jnp twins run instead: %s", e)
        return None
    for name in TARGETS:
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    return lib


def _ffi(name: str, out: Any, **kwargs: Any) -> Any:
    """The FFI call of one of the library's targets, registered first (a kernel called
    directly, before any `active()`, finds its handler)."""
    if library() is None:
        raise RuntimeError(f"{name}: the native CPU kernels are unavailable here")
    return jax.ffi.ffi_call(name, out, **kwargs)


def on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def active() -> bool:
    """Whether a program traced now takes the native kernels: on, on CPU, and built."""
    return _enabled and on_cpu() and library() is not None


def unpartitioned() -> bool:
    """No mesh is set for the program traced now (`jax.set_mesh`, as the engine does around
    its programs on a mesh). An FFI call has no partitioning rule, so on a mesh XLA would
    gather its operands — a sharded weight whole — onto every device: there the jnp twins
    run, except inside `shard_map`'s per-device code (`model.sharding.expert_parallel`)."""
    return jax.sharding.get_abstract_mesh().empty


#: the routed experts' weights as `routed` takes them: three f32 arrays (w1, w3 [E, F, D],
#: w2 [E, D, F]), or three FP4 pairs (codes packed two per byte [E, out, in/2] — the low
#: nibble the even input — and E8M0 exponents [E, out, in/32], as `--weights fp4-experts`
#: keeps them in `model.quantized.QWeight`)
Experts = list[Any]


def _fp4(part: Any) -> bool:
    if not isinstance(part, tuple) or len(part) != 2:
        return False
    q, e = part
    return (q.dtype == jnp.uint8 and e.dtype == jnp.uint8 and q.shape[:-1] == e.shape[:-1]
            and q.shape[-1] * 2 == e.shape[-1] * 32)  # fmt: skip


def routed_supported(x: jax.Array, experts: Experts) -> bool:
    """Whether `routed` takes these operands: f32 tokens, and expert weights all f32 or all
    FP4 in whole 32-input blocks."""
    dense = all(isinstance(w, jax.Array | np.ndarray) and w.dtype == jnp.float32 for w in experts)
    return x.dtype == jnp.float32 and (dense or all(_fp4(w) for w in experts))


def routed(x: jax.Array, sel: jax.Array, w: jax.Array, experts: Experts,
           limit: float) -> jax.Array:  # fmt: skip
    """The routed experts' weighted sum for tokens x [T, D] (`sel` [T, k] their experts,
    `w` [T, k] their weights) — `model.layers._routed`'s result, each selected expert read
    once in place (FP4: its 4-bit codes, expanded in registers)."""
    if isinstance(experts[0], tuple):
        name, arrays = "ds4jax_routed_fp4", [a for pair in experts for a in pair]
    else:
        name, arrays = "ds4jax_routed_f32", list(experts)
    call = _ffi(name, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, sel.astype(jnp.int32), w.astype(jnp.float32), *arrays,
                limit=np.float32(limit))  # fmt: skip


#: the most tokens `gemv` takes (past them a product is a GEMM, compute-bound: XLA's)
GEMV_ROWS = 9


def gemv_supported(x: jax.Array, w: Any) -> bool:
    """Whether `gemv` takes these operands: f32 tokens [..., K], at most `GEMV_ROWS` of them,
    and a plain f32 or bf16 weight [N, K] (bf16 widened exactly, products in f32, as the
    twin's `dequantize` does), with no mesh set (`unpartitioned`)."""
    return _gemv_operands(x, w, 1)


def _gemv_operands(x: jax.Array, w: Any, groups: int) -> bool:
    """The GEMVs' terms: no mesh, f32 tokens [..., (G,) K] (at most `GEMV_ROWS`), a plain
    f32 or bf16 weight [(G,) N, K] — `groups` 1: no G axis, else the G of x's [-2]."""
    g = () if groups == 1 else x.shape[-2:-1]
    lead = x.shape[: x.ndim - 1 - len(g)]
    return (unpartitioned() and x.ndim >= 1 + len(g) and math.prod(lead) <= GEMV_ROWS
            and x.dtype == jnp.float32 and isinstance(w, jax.Array | np.ndarray)
            and w.ndim == 2 + len(g) and tuple(w.shape[: len(g)]) == g
            and w.dtype in (jnp.float32, jnp.bfloat16) and w.shape[-1] == x.shape[-1])  # fmt: skip


def gemv(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [N, K]ᵀ for a few tokens, the weight read once in place for all of
    them: XLA:CPU runs one token's product at ~70% of this machine's bandwidth and several
    tokens' as a GEMM that packs the whole weight first. Under `vmap` (a batched step's
    per-row attention) the rows' tokens go to one call (`expand_dims`), not one each."""
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[0]), x.dtype)
    return _ffi("ds4jax_gemv_f32", out, vmap_method="expand_dims")(x, w)


def gemv_many_supported(x: jax.Array, ws: tuple[Any, ...]) -> bool:
    """Whether `gemv_many` takes these operands: two or more weights `gemv` takes for x."""
    return len(ws) > 1 and all(_gemv_operands(x, w, 1) for w in ws)


def gemv_many(x: jax.Array, ws: tuple[jax.Array, ...]) -> list[jax.Array]:
    """`[gemv(x, w) for w in ws]` in one call (its twin: `layers.linear` of each): a decode
    layer's projections of one input — the attention's 2 to 6, the MoE's 3 — as one
    call's work items, not one call each (per-call dispatch and thread start paid once)."""
    outs = [jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[0]), x.dtype) for w in ws]
    return list(_ffi("ds4jax_gemv_many_f32", outs, vmap_method="expand_dims")(x, *ws))


def gemv_grouped_supported(x: jax.Array, w: Any) -> bool:
    """Whether `gemv_grouped` takes these operands: f32 tokens [..., G, K], at most
    `GEMV_ROWS` of them, a plain f32 or bf16 weight [G, O, K], no mesh set."""
    return x.ndim >= 2 and _gemv_operands(x, w, 0)


def gemv_grouped(x: jax.Array, w: jax.Array) -> jax.Array:
    """`einsum("...gi,goi->...go", x, w)`: each group's tokens through its own [O, K] weight,
    read once in place (XLA:CPU ran the attention's grouped output projection as a batched
    GEMM: ~80 µs per layer for 8 tokens, the weight read in ~25)."""
    out = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[1]), x.dtype)
    return _ffi("ds4jax_gemv_grouped_f32", out, vmap_method="expand_dims")(x, w)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` of f32 rows as int32 (the first maximum, the first NaN if any)."""
    out = jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32)
    return _ffi("ds4jax_argmax_f32", out, vmap_method="expand_dims")(x)


def draw(logits: jax.Array, u: jax.Array, temperature: jax.Array,
         min_p: jax.Array) -> jax.Array:  # fmt: skip
    """Each f32 row's token [...] (int32) drawn at its uniform `u` as `sampling.sample_rows`
    draws without ranking (temperature and min-p only; no top-k or top-p): a row with
    temperature ≤ 0 (or holding a NaN) takes its argmax. exp is taken only for groups of 8
    tokens holding one min-p keeps. The twin: `sampling`'s unranked mask and `draw_rows`; its
    f32 sums over blocks of 1,024 and this kernel's (f32 within 8 tokens, f64 across) can
    pick neighbouring tokens where the target lies within rounding of a boundary."""
    out = jax.ShapeDtypeStruct(logits.shape[:-1], jnp.int32)
    f32 = [a.astype(jnp.float32) for a in (u, temperature, min_p)]
    return _ffi("ds4jax_draw_f32", out, vmap_method="expand_dims")(logits, *f32)


def attend_supported(q: jax.Array, *keys: jax.Array, chunk: bool = False) -> bool:
    """Whether `attend` takes these operands: f32 queries [T, H, D] of at most `GEMV_ROWS`
    tokens (a decode step, a speculative verification) — any number for a prefill `chunk`
    — and f32 keys, no mesh set."""
    return (unpartitioned() and q.ndim == 3 and (chunk or q.shape[0] <= GEMV_ROWS)
            and all(a.dtype == jnp.float32 for a in (q, *keys)))  # fmt: skip


def attend(q: jax.Array, raw: jax.Array, raw_ok: jax.Array, own: jax.Array, own_ok: jax.Array,
           sink: jax.Array, comp: jax.Array | None = None, pick: jax.Array | None = None,
           pick_ok: jax.Array | None = None, slot: jax.Array | None = None) -> Any:  # fmt: skip
    """Sink attention of q [T, H, D] over the keys (= values) each query sees: the raw
    window's ring raw [R, D] where raw_ok [T, R], the step's own keys own [T', D] where
    own_ok [T, T'], and the compressed rows comp [C, D] named by pick [T, P] where
    pick_ok [T, P] — the twins' result over the concatenated keys, without concatenating
    them (XLA copied a CSA layer's 2,192 keys twice per step at an 8k context, once
    transposed). Under `vmap` every operand takes the row axis (`broadcast_all`).

    `slot` [T'] (int32): also return the ring with each own key written to its slot (one
    outside [0, R): not written) — `layers.ring_write`'s result, `(out, ring)`, the ring
    updated in place after every query read it (aliased: where the ring was both read here
    and written by a scatter, XLA copied it twice per layer and step)."""
    T, _, D = q.shape
    if comp is None:
        comp = jnp.zeros((0, D), jnp.float32)
        pick, pick_ok = jnp.zeros((T, 0), jnp.int32), jnp.zeros((T, 0), bool)
    operands = [q, raw, raw_ok.astype(bool), own, own_ok.astype(bool), comp,
                pick.astype(jnp.int32), pick_ok.astype(bool), sink.astype(jnp.float32)]  # fmt: skip
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    if slot is None:
        return _ffi("ds4jax_attend_f32", out, vmap_method="broadcast_all")(*operands)
    ring = jax.ShapeDtypeStruct(raw.shape, raw.dtype)
    call = _ffi("ds4jax_attend_write_f32", (out, ring), vmap_method="broadcast_all",
                input_output_aliases={1: 1})  # fmt: skip
    return call(*operands, slot.astype(jnp.int32))


def index_top_supported(q: jax.Array, rows: jax.Array) -> bool:
    """Whether `index_top` takes these operands: f32 queries [T, IH, d] (any number: a
    decode step's or a prefill chunk's) and f32 rows, no mesh set."""
    return (unpartitioned() and q.ndim == 3 and q.dtype == jnp.float32
            and rows.dtype == jnp.float32)  # fmt: skip


def index_top(q: jax.Array, w: jax.Array, rows: jax.Array, visible: jax.Array,
              k: int) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`jax.lax.top_k(indexer_scores_reference(q, w, rows, visible), k)` for q [T, IH, d],
    w [T, IH], rows [C, d], visible [T, C]: (values [T, k], indices [T, k]), the rows read
    in place (XLA transposed a CSA layer's 2,059 indexer rows every decode step at an 8k
    context, then ran a generic top-k). Scores differ from the twin's only in summation
    order; the picks are `top_k`'s order of them. Under `vmap` every operand takes the row
    axis (`broadcast_all`)."""
    T = q.shape[0]
    out = (jax.ShapeDtypeStruct((T, k), jnp.float32), jax.ShapeDtypeStruct((T, k), jnp.int32))
    call = _ffi("ds4jax_index_top_f32", out, vmap_method="broadcast_all")
    return call(q, w.astype(jnp.float32), rows, visible.astype(bool))


def top_k_supported(x: jax.Array) -> bool:
    """Whether `top_k` takes x: f32 [..., C] with C < 2³¹, no mesh set."""
    return unpartitioned() and x.ndim >= 1 and x.dtype == jnp.float32 and x.shape[-1] < 2**31


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)`: (values, int32 indices) [..., k], larger first, NaN largest,
    −0 below +0, ties by the lower index. XLA:CPU's generic TopK took ~48 µs a row for a
    prefill chunk's indexer scores (512 rows of 2,059, keeping 512): 1.2 s of an
    8,192-token prefill's 7.3 s on `bench-192m`."""
    shape = (*x.shape[:-1], k)
    out = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32))
    return _ffi("ds4jax_top_k_f32", out, vmap_method="expand_dims")(x)


def rows_supported(table: Any, idx: jax.Array) -> bool:
    """Whether `rows` takes these operands: a bf16 table [V, D] (f32 tables gather as they
    are in XLA) and integer indices, no mesh set."""
    return (unpartitioned() and isinstance(table, jax.Array | np.ndarray) and table.ndim == 2
            and table.dtype == jnp.bfloat16 and jnp.issubdtype(idx.dtype, jnp.integer))  # fmt: skip


def rows(table: jax.Array, idx: jax.Array) -> jax.Array:
    """`table[idx].astype(float32)` for a bf16 table [V, D]: XLA:CPU gathers bf16 by
    converting the whole table to f32 first, and inside a loop (`model.batch.burst`) hoists
    that convert out as loop-invariant — 265 MB written per burst on bench-192m with
    `--weights fp4-experts`, the burst 4x slower than its steps."""
    out = jax.ShapeDtypeStruct((*idx.shape, table.shape[-1]), jnp.float32)
    return _ffi("ds4jax_rows_f32", out, vmap_method="expand_dims")(table, idx.astype(jnp.int32))
