"""Attention with per-head sinks over the raw window plus compressed rows held in pages
(issue 26): the rows of a sequence live in `pages [P, R, D]` (a layer's page array, R =
256 / ratio rows a page) at the physical pages its table names, logical block j at
`pages[table[j]]`; page 0 is the null page that unused table entries point at.

Why a kernel: the twin gathers `pages[table]` into a dense `[N·R, D]` copy of the
sequence's rows on every call and then attends over all of it, so its cost follows the
table's width (the context capacity it is padded to). The kernel reads each page once,
straight from the page array, and only the pages some query of its block can see: the
work follows the pages a sequence holds, not the capacity, and nothing is copied.

How: the table and, per query block, the number of grid steps holding visible rows are
scalar-prefetch arguments (`PrefetchScalarGridSpec`), so each grid step's `BlockSpec`
index map reads the physical page id and the pipeline DMAs just that page. The grid is
(query blocks, head blocks, page steps), each page step `block_pages` logical pages (one
`pages` operand per page of the step, each with its own index map, so an HCA step is not
a 2-row dot). Online softmax over the raw keys (first page step) and then the pages, in
VMEM scratch carried along the page axis; the sink enters as the initial running maximum
(`_common.online_softmax_step`). Steps wholly past a block's visible rows are skipped
(`pl.when`) and their index maps repeat the last needed page, so they cost no DMA either.

Not called by the model's steps yet: they run on a dense state at the span of its tokens
(`model.state.spans`), materialized from pages (`kvstore.page_store`); this op is the
piece a step reading pages directly will call, kept tested against its twin until then.

Lowering (jax 0.10.2): `interpret=True` on CPU (tests);
Mosaic TPU is the target (scalar prefetch lands in SMEM). Not GPU: neither the Triton
backend nor Mosaic GPU implements scalar prefetch ("scalar prefetch not implemented in the
Triton backend"), so the kernel raises `NotImplementedError` there and `select("auto")`
takes the twin on GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ds4jax.pallas_kernels._common import dot_nt, on_gpu, online_softmax_step, round_up
from ds4jax.pallas_kernels.sink_attention import sink_attention_reference

NEG_INF = -jnp.inf


@dataclass(frozen=True)
class BlockSizes:
    block_t: int = 8  # queries per program (× block_h rows of work)
    block_h: int | None = None  # heads per program; None: all
    block_k: int = 128  # raw keys per inner step
    block_pages: int | None = None  # logical pages per grid step; None: ≈ 128 rows a step

    def __post_init__(self) -> None:
        if min(self.block_t, self.block_h or 1, self.block_k, self.block_pages or 1) < 1:
            raise ValueError(f"{self=}: block sizes must be positive")

    def pages_per_step(self, R: int, N: int) -> int:
        """At most 16 page operands a step (each is double-buffered in VMEM on TPU)."""
        want = self.block_pages or max(1, min(16, 128 // R))
        return max(1, min(want, N))


def _kernel(steps_ref, table_ref, q_ref, k_ref, mask_ref, vis_ref, sink_ref, *refs,
            n_pages: int, block_k: int, scale: float):  # fmt: skip
    # prefetch: steps [Tb] · table [Np]; q [bt, bh, D] · raw keys [Kr, D] · mask [bt, Kr] ·
    # visible [bt, 1] · sink [bh] · n_pages × page [R, D]; out: o [bt, bh, D];
    # scratch: running max [rows, 1] · mass [rows, 1] · acc [rows, D]
    del table_ref  # read by the index maps only
    page_refs, (o_ref, m_ref, mass_ref, acc_ref) = refs[:n_pages], refs[n_pages:]
    i, j = pl.program_id(0), pl.program_id(2)
    bt, bh, D = q_ref.shape
    rows = bt * bh
    q = q_ref[...].astype(jnp.float32).reshape(rows, D)
    sink = jnp.broadcast_to(sink_ref[...].astype(jnp.float32)[None, :], (bt, bh)).reshape(rows)

    def load() -> tuple[jax.Array, jax.Array, jax.Array]:
        return m_ref[...].reshape(rows), mass_ref[...].reshape(rows), acc_ref[...]

    def store(m: jax.Array, mass: jax.Array, acc: jax.Array) -> None:
        m_ref[...], mass_ref[...], acc_ref[...] = m.reshape(rows, 1), mass.reshape(rows, 1), acc

    def scores(keys: jax.Array, seen: jax.Array) -> jax.Array:  # seen [bt, n] → s [rows, n]
        s = (dot_nt(q, keys) * scale).reshape(bt, bh, keys.shape[0])
        return jnp.where(seen[:, None, :], s, NEG_INF).reshape(rows, keys.shape[0])

    @pl.when(j == 0)
    def _raw() -> None:  # the sink is the first "key": running max = sink, mass added last
        def step(b, carry):
            keys = k_ref[pl.ds(b * block_k, block_k), :].astype(jnp.float32)
            seen = mask_ref[:, pl.ds(b * block_k, block_k)]
            return online_softmax_step(*carry, scores(keys, seen), keys)

        init = (sink, jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, D), jnp.float32))
        store(*jax.lax.fori_loop(0, k_ref.shape[0] // block_k, step, init))

    @pl.when(j < steps_ref[i])
    def _pages() -> None:
        keys = jnp.concatenate([p[...] for p in page_refs], axis=0).astype(jnp.float32)
        n = keys.shape[0]  # rows this step: logical rows [j·n, (j+1)·n)
        logical = j * n + jax.lax.broadcasted_iota(jnp.int32, (bt, n), 1)
        store(*online_softmax_step(*load(), scores(keys, logical < vis_ref[...]), keys))

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish() -> None:
        m, mass, acc = load()
        o = acc / (mass + jnp.exp(sink - m))[:, None]
        o_ref[...] = o.reshape(bt, bh, D).astype(o_ref.dtype)


def _page_spec(R: int, D: int, k: int, n_pages: int) -> pl.BlockSpec:
    """Operand k of a page step: the physical page of logical page `step·n_pages + k`, the
    step clamped to the block's last visible one so skipped steps fetch nothing new."""

    def index_map(i, h, j, steps_ref, table_ref):
        last = jnp.maximum(steps_ref[i] - 1, 0)
        return table_ref[jnp.minimum(j, last) * n_pages + k], 0, 0

    return pl.BlockSpec((pl.squeezed, R, D), index_map)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def paged_attention(
    q: jax.Array,
    keys: jax.Array,
    mask: jax.Array,
    pages: jax.Array,
    table: jax.Array,
    visible: jax.Array,
    sink: jax.Array,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q [T,H,D]; raw keys [Kr,D] with mask [T,Kr]; pages [P,R,D] with this sequence's
    table [N] (int32 physical page ids in [0, P)); visible [T]: query t sees logical rows
    [0, visible[t]); sink [H] → [T,H,D]. Same function as `paged_attention_reference`."""
    T, H, D = q.shape
    Kr, (P, R, _), N = keys.shape[0], pages.shape, table.shape[0]
    if keys.shape[1] != D or pages.shape[2] != D or mask.shape != (T, Kr):
        raise ValueError(f"{q.shape=} {keys.shape=} {mask.shape=} {pages.shape=} disagree")
    if visible.shape != (T,) or sink.shape != (H,):
        raise ValueError(f"{q.shape=} {visible.shape=} {sink.shape=} disagree")
    if on_gpu() and not interpret:
        raise NotImplementedError(
            "paged_attention: scalar prefetch has no GPU lowering (Triton, Mosaic GPU) in "
            f"jax {jax.__version__}; use paged_attention_reference there"
        )
    bs = block_sizes or BlockSizes()
    bt, bh = min(bs.block_t, T), min(bs.block_h or H, H)
    bk = min(bs.block_k, max(Kr, 1))
    n_pages = bs.pages_per_step(R, N)
    Tp, Hp, Krp = round_up(T, bt), round_up(H, bh), round_up(max(Kr, 1), bk)
    Np = round_up(max(N, 1), n_pages)
    n_steps = Np // n_pages
    q = jnp.pad(q, ((0, Tp - T), (0, Hp - H), (0, 0)))
    keys = jnp.pad(keys, ((0, Krp - Kr), (0, 0)))
    mask = jnp.pad(mask, ((0, Tp - T), (0, Krp - Kr)))  # padding is never visible
    table = jnp.pad(jnp.clip(table.astype(jnp.int32), 0, P - 1), (0, Np - N))  # null pages
    visible = jnp.pad(jnp.clip(visible.astype(jnp.int32), 0, N * R), (0, Tp - T))
    # per query block, the page steps holding a row one of its queries sees
    steps = -(-jnp.max(visible.reshape(Tp // bt, bt), axis=1) // (n_pages * R))
    params = None
    if jax.default_backend() == "tpu" and not interpret:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    rows = bt * bh
    out = pl.pallas_call(
        functools.partial(_kernel, n_pages=n_pages, block_k=bk, scale=D**-0.5),
        out_shape=jax.ShapeDtypeStruct((Tp, Hp, D), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(Tp // bt, Hp // bh, n_steps),
            in_specs=[
                pl.BlockSpec((bt, bh, D), lambda i, h, j, *_: (i, h, 0)),
                pl.BlockSpec((Krp, D), lambda i, h, j, *_: (0, 0)),
                pl.BlockSpec((bt, Krp), lambda i, h, j, *_: (i, 0)),
                pl.BlockSpec((bt, 1), lambda i, h, j, *_: (i, 0)),
                pl.BlockSpec((bh,), lambda i, h, j, *_: (h,)),
                *[_page_spec(R, D, k, n_pages) for k in range(n_pages)],
            ],
            out_specs=pl.BlockSpec((bt, bh, D), lambda i, h, j, *_: (i, h, 0)),
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, D), jnp.float32),
            ],
        ),
        compiler_params=params,
        interpret=interpret,
    )(steps, table, q, keys, mask, visible[:, None], jnp.pad(sink, (0, Hp - H)), *[pages] * n_pages)
    return out[:T, :H]


def paged_attention_reference(
    q: jax.Array,
    keys: jax.Array,
    mask: jax.Array,
    pages: jax.Array,
    table: jax.Array,
    visible: jax.Array,
    sink: jax.Array,
) -> jax.Array:
    """The jnp twin: gather the sequence's rows through its table, then dense sink
    attention over raw keys and rows (`sink_attention_reference`, the one copy of the math)."""
    N, R = table.shape[0], pages.shape[1]
    rows = pages[table].reshape(N * R, pages.shape[2])
    row_mask = jnp.arange(N * R)[None, :] < visible[:, None]
    return sink_attention_reference(
        q, jnp.concatenate([keys, rows]), jnp.concatenate([mask, row_mask], axis=1), sink
    )
