"""The native CPU kernels against their jnp twins, and the build's fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax import native
from ds4jax.config import load_config
from ds4jax.model import layers
from ds4jax.model.quantized import QWeight, stack
from ds4jax.weights import official

CFG = load_config("bench-192m")

pytestmark = pytest.mark.skipif(
    os.environ.get("DS4JAX_NATIVE") == "0", reason="DS4JAX_NATIVE=0: the kernels are off"
)


def test_the_library_builds_here():
    """This machine has a compiler, so the kernels must be on: a broken build fails here
    rather than quietly running the twins."""
    assert native.library() is not None
    assert native.active()
    assert native.library_path().exists()


def _experts(E: int, F: int, D: int, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    shapes = {"w1": (E, F, D), "w3": (E, F, D), "w2": (E, D, F)}
    return {n: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.05)
            for n, s in shapes.items()}  # fmt: skip


def _fp4_experts(ex: dict[str, jax.Array]) -> dict[str, QWeight]:
    """The experts as `--weights fp4-experts` keeps them (the release's FP4 layout)."""

    def one(w: np.ndarray) -> QWeight:
        packed, scale = official.quantize_fp4(w)
        return QWeight(packed.view(np.uint8), scale.view(np.uint8), (1, 32))

    return {
        n: QWeight(*(jnp.asarray(a) for a in (q.q, q.exp)), q.block)
        for n, q in ((n, stack([one(np.asarray(e)) for e in w])) for n, w in ex.items())
    }


def _routed_both(ex, x, sel, w, rows: bool):
    """(the kernel's result, the twin's), each traced in a program of its own."""
    E = ex["w1"].q.shape[0] if isinstance(ex["w1"], QWeight) else ex["w1"].shape[0]
    cfg = CFG.replace(num_experts=E)

    def run(x, sel, w):
        return layers._routed(cfg, ex, x, sel, w, rows)

    got = jax.jit(lambda *a: run(*a))(x, sel, w)
    with native.disabled():
        want = jax.jit(lambda *a: run(*a))(x, sel, w)
    return np.asarray(got), np.asarray(want)


# (tokens, rows): one decode token; a batched step's rows; a short chunk of one sequence
@pytest.mark.parametrize("fp4", [False, True], ids=["f32", "fp4"])
@pytest.mark.parametrize("T,rows", [(1, False), (2, True), (4, True), (8, True), (3, False)])
def test_routed_matches_twin(T, rows, fp4):
    E, F, D, k = 16, 224, 512, 4
    ex = _experts(E, F, D)
    if fp4:
        ex = _fp4_experts(ex)
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.standard_normal((T, D), dtype=np.float32))
    sel = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    if T > 1:
        sel[1] = sel[0]  # two tokens on the same experts: each expert read once for both
    w = jnp.asarray(rng.random((T, k), dtype=np.float32))
    got, want = _routed_both(ex, x, jnp.asarray(sel), w, rows)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_routed_clamps_like_the_twin():
    """Products past the SwiGLU limit are clamped the same way (large inputs)."""
    ex = _experts(8, 40, 72, seed=3)  # widths off the kernel's 8-float vectors
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 72), dtype=np.float32) * 200)
    sel = jnp.asarray([[0, 7], [7, 3]], jnp.int32)
    w = jnp.asarray([[0.7, 0.3], [0.5, 0.5]], jnp.float32)
    got, want = _routed_both(ex, x, sel, w, rows=True)
    assert np.abs(want).max() > 1.0
    # rounding of the sums scales with their largest terms, not with each output (on an
    # AVX2 machine one output of 0.16 among outputs up to 29 differed by 1.4e-5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())


def test_a_token_alone_equals_the_same_token_in_a_batch():
    """A row's routed sum does not depend on the rows beside it: bit for bit."""
    E, F, D, k = 16, 224, 512, 4
    ex = _experts(E, F, D, seed=1)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((8, D), dtype=np.float32))
    sel = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(8)]), jnp.int32)
    w = jnp.asarray(rng.random((8, k), dtype=np.float32))
    f = jax.jit(native.routed, static_argnums=4)
    ex = [ex[n] for n in ("w1", "w3", "w2")]
    batch = np.asarray(f(x, sel, w, ex, CFG.swiglu_limit))
    for t in (0, 5):
        alone = np.asarray(f(x[t : t + 1], sel[t : t + 1], w[t : t + 1], ex, CFG.swiglu_limit))
        assert np.array_equal(alone[0], batch[t])


@pytest.mark.parametrize("T,N,K", [(1, 1000, 512), (3, 130, 77), (8, 64, 256), (9, 200, 512)])
def test_gemv_matches_xla(T, N, K):
    rng = np.random.default_rng(N)
    x = jnp.asarray(rng.standard_normal((T, K), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((N, K), dtype=np.float32))
    assert native.gemv_supported(x, w)
    got = np.asarray(jax.jit(native.gemv)(x, w))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gemv_of_a_bf16_weight_is_that_of_its_f32_values():
    """A weight held in bf16 (`--weights fp4-experts`, `--weights bf16`) is widened exactly:
    the product of its f32 values, bit for bit."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 517), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((70, 517), dtype=np.float32)).astype(jnp.bfloat16)
    assert native.gemv_supported(x, w)
    got = np.asarray(jax.jit(native.gemv)(x, w))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(native.gemv)(x, w.astype(jnp.float32))))


def test_what_the_kernels_do_not_take():
    x = jnp.zeros((2, 8), jnp.float32)
    assert not native.gemv_supported(x.astype(jnp.bfloat16), jnp.zeros((4, 8)))
    assert not native.gemv_supported(jnp.zeros((native.GEMV_ROWS + 1, 8)), jnp.zeros((4, 8)))
    assert not native.routed_supported(x, [jnp.zeros((2, 4, 8), jnp.bfloat16)] * 3)
    assert native.routed_supported(x, [jnp.zeros((2, 4, 8), jnp.float32)] * 3)
    codes, exps = jnp.zeros((2, 4, 32), jnp.uint8), jnp.zeros((2, 4, 2), jnp.uint8)
    assert native.routed_supported(x, [(codes, exps)] * 3)
    assert not native.routed_supported(x, [(codes, exps[..., :1])] * 3)  # a partial block
    q = jnp.zeros((1, 4, 8), jnp.float32)
    assert not native.attend_supported(q, jnp.zeros((3, 8), jnp.bfloat16))  # bf16 keys
    assert not native.attend_supported(jnp.zeros((native.GEMV_ROWS + 1, 4, 8)))  # a prefill


def test_no_compiler_runs_the_twins(tmp_path):
    """Where the library cannot be built, a warning says so and the callers of every kernel
    (a decode step's linears, its routed experts, greedy selection) take their twins."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from ds4jax import native, sampling
        from ds4jax.config import load_config
        from ds4jax.model import layers
        from ds4jax.model.params import init_params
        assert not native.active()
        cfg = load_config("tiny")
        p = init_params(cfg, 0)["layers"][3]["ffn"]
        x = jnp.ones((2, cfg.hidden_size), jnp.float32)
        sel, w = jnp.array([[0, 1], [1, 2]]), jnp.full((2, 2), 0.5)
        y = jax.jit(lambda x: layers.linear(x, p["gate"]))(x)
        r = jax.jit(lambda x: layers._routed(cfg, p, x, sel, w, rows=True))(x)
        print("ok", bool(jnp.isfinite(y).all() & jnp.isfinite(r).all()),
              int(jax.jit(sampling.argmax)(jnp.arange(5.0)[None])[0]))
    """)
    env = dict(os.environ, CXX="false", DS4JAX_NATIVE_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok True 4" in done.stdout
    assert "native CPU kernels unavailable" in done.stderr


def test_gemv_under_vmap_reads_the_weight_once_for_every_row():
    """A batched step's per-row attention calls `linear` inside `vmap`: one call takes the
    rows' tokens together (`expand_dims`), and each row gets its own product."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((4, 1, 96), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((130, 96), dtype=np.float32))
    got = np.asarray(jax.jit(jax.vmap(lambda r: layers.linear(r, w)))(x))
    assert got.shape == (4, 1, 130)
    hlo = jax.jit(jax.vmap(lambda r: layers.linear(r, w))).lower(x).as_text()
    assert hlo.count("ds4jax_gemv_f32") == 1
    want = np.einsum("btk,nk->btn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_argmax_matches_the_twin_on_ties_nans_and_infinities():
    from ds4jax.sampling import argmax

    rng = np.random.default_rng(11)
    x = rng.integers(-3, 3, size=(12, 1037)).astype(np.float32)  # many ties
    x[1, [5, 900]] = np.nan
    x[2, 1030] = np.nan  # in the tail past the last 8-float vector
    x[3] = -np.inf
    x[4, [7, 8]] = np.inf
    x[5, 1036] = 99.0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    with native.disabled():
        twin = np.asarray(jax.jit(lambda v: argmax(v))(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(twin, got)
    assert "ds4jax_argmax_f32" in jax.jit(argmax).lower(jnp.asarray(x)).as_text()


def _drawn_by_definition(x: np.ndarray, t: np.ndarray, m: np.ndarray, u: np.ndarray):
    """Each row's token by the definition in f64 (temperature, min-p's kept set, the
    inverted CDF at u), and whether u lands within rounding (1e-5 of the total) of a
    boundary (1e-6 of the total) or a token within rounding of min-p's floor, where f32
    sums may choose either."""
    tokens, unsure = [], []
    for row, temp, mp, uu in zip(x.astype(np.float64), t, m, u, strict=True):
        if temp <= 0:
            tokens.append(int(np.argmax(row)))
            unsure.append(False)
            continue
        z = row / temp
        floor = z.max() + np.log(mp) if mp > 0 else -np.inf
        w = np.where(z >= floor, np.exp(z - z.max()), 0.0)
        ends = np.cumsum(w)
        target = uu * ends[-1]
        tokens.append(int(min(np.searchsorted(ends, target, side="right"), np.flatnonzero(w)[-1])))
        near_floor = mp > 0 and bool(np.any(np.abs(z - floor) < 1e-6 * max(1.0, abs(floor))))
        unsure.append(bool(np.min(np.abs(ends - target)) < 1e-6 * ends[-1]) or near_floor)
    return np.array(tokens), np.array(unsure)


def test_draw_matches_the_definition_and_the_twin():
    """The sampled rows of a step under temperature and min-p (the server's default), on
    a V4-sized vocabulary: peaked rows (a few dozen tokens kept), a flat one (every token
    kept: exp in every group of 8), a greedy one; drawn at 200 keys each. The
    kernel's token is the definition's wherever rounding cannot decide, and the twin's."""
    from ds4jax import sampling

    V, draws = 129_280, 200
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, V)) * np.array([[3.0], [3.0], [1.0], [0.01], [3.0], [6.0]])
    x = x.astype(np.float32)
    t = np.array([1.0, 0.7, 1.5, 1.0, 0.0, 2.0], np.float32)
    m = np.array([0.05, 0.05, 0.3, 0.05, 0.05, 0.01], np.float32)
    zeros, ones = jnp.zeros(6, jnp.int32), jnp.ones(6, jnp.float32)
    args = (jnp.asarray(x), jnp.asarray(t), zeros, ones, jnp.asarray(m))

    def rows(xs, keys, t, k, p, m):
        return sampling.sample_rows(xs, keys, t, k, p, m)

    kernel = jax.jit(lambda xs, keys, t, k, p, m: rows(xs, keys, t, k, p, m))
    assert "ds4jax_draw_f32" in kernel.lower(args[0], jax.random.split(jax.random.key(0), 6),
                                             *args[1:]).as_text()  # fmt: skip
    with native.disabled():
        twin = jax.jit(lambda xs, keys, t, k, p, m: rows(xs, keys, t, k, p, m))
        twin.lower(args[0], jax.random.split(jax.random.key(0), 6), *args[1:]).compile()
    agree, unsure_n = np.zeros(6, int), np.zeros(6, int)
    seen = [set() for _ in range(6)]
    for d in range(draws):
        keys = jax.random.split(jax.random.key(d), 6)
        got = np.asarray(kernel(args[0], keys, *args[1:]))
        want_twin = np.asarray(twin(args[0], keys, *args[1:]))
        u = np.asarray(sampling.uniforms(keys))
        want, unsure = _drawn_by_definition(x, t, m, u)
        np.testing.assert_array_equal(got[~unsure], want[~unsure])
        agree += got == want_twin
        unsure_n += unsure
        for r in range(6):
            seen[r].add(int(got[r]))
    # the flat row's tokens are each ~8e-6 of its total: a quarter of its draws land within
    # 1e-6 of a boundary, where the definition is checked no further; the peaked ones never
    assert unsure_n[3] <= 0.4 * draws and unsure_n.sum() - unsure_n[3] <= 2
    # the twin's f32 block sums move a target by up to ~1e-6 of the total: on the flat row
    # (each token ~8e-6 of it) now and then to the next token, on the peaked ones never
    assert agree[3] >= 0.9 * draws and all(agree[r] == draws for r in (0, 1, 2, 4, 5))
    assert seen[4] == {int(np.argmax(x[4]))}  # greedy
    assert len(seen[3]) > 150  # the flat row: every token kept, draws spread over them
    assert all(len(s) > 3 for s in seen[:3])


def test_draw_without_min_p_keeps_every_token():
    """The kernel alone, min-p off (every token kept, the last group partly past the row's
    end: 3,001 tokens), on a short vocabulary at fixed uniforms, 0 among them."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((4, 3001)) * 2).astype(np.float32)
    u = np.array([0.0, 0.25, 0.9, 0.999], np.float32)
    t, m = np.array([1.0, 0.5, 3.0, 1.0], np.float32), np.zeros(4, np.float32)
    got = np.asarray(jax.jit(native.draw)(*(jnp.asarray(a) for a in (x, u, t, m))))
    want, unsure = _drawn_by_definition(x, t, m, u)
    assert not unsure.any()
    np.testing.assert_array_equal(got, want)


def test_ranked_rows_leave_the_draw_to_the_twin():
    """A row asking top-k or top-p sends the whole step to the twin (the kernel does not
    rank): top-k 1 on a flat row is its argmax every time."""
    from ds4jax import sampling

    rng = np.random.default_rng(3)
    x = jnp.asarray((rng.standard_normal((2, 4096)) * 0.01).astype(np.float32))
    t, k = jnp.ones(2), jnp.array([0, 1], jnp.int32)
    p, m = jnp.ones(2), jnp.full(2, 0.05)
    f = jax.jit(sampling.sample_rows)
    picks = [int(f(x, jax.random.split(jax.random.key(i), 2), t, k, p, m)[1]) for i in range(20)]
    assert set(picks) == {int(jnp.argmax(x[1]))}


def test_on_a_mesh_the_products_are_left_to_xla():
    """An FFI call has no partitioning rule (XLA would gather a sharded weight whole onto
    every device), so with a mesh set the linears and argmax take their twins."""
    x, w = jnp.ones((1, 64), jnp.float32), jnp.ones((32, 64), jnp.float32)
    q, keys = jnp.ones((1, 4, 64), jnp.float32), jnp.ones((8, 64), jnp.float32)
    assert native.gemv_supported(x, w) and native.attend_supported(q, keys)
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        assert not native.gemv_supported(x, w)
        assert not native.attend_supported(q, keys)
        hlo = jax.jit(lambda v: layers.linear(v, w)).lower(x).as_text()
    assert "ds4jax_gemv_f32" not in hlo


def _attention_operands(T: int, seed: int = 3, H: int = 8, D: int = 128, R: int = 130,
                        C: int = 300, P: int = 64) -> dict[str, jax.Array]:  # fmt: skip
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    raw_ok = rng.random((T, R)) < 0.7
    raw_ok[0] = False  # the first query sees no raw key …
    pick_ok = rng.random((T, P)) < 0.8
    pick_ok[0] = False  # … and no compressed row: the sink alone
    return dict(q=f(T, H, D), raw=f(R, D), raw_ok=jnp.asarray(raw_ok), own=f(T, D),
                own_ok=jnp.tril(jnp.ones((T, T), bool)).at[0].set(False), sink=f(H),
                comp=f(C, D), pick=jnp.asarray(rng.choice(C, (T, P), replace=True), jnp.int32),
                pick_ok=jnp.asarray(pick_ok))  # fmt: skip


@pytest.mark.parametrize("T", [1, 3, native.GEMV_ROWS])
@pytest.mark.parametrize("picks", [False, True], ids=["window", "picks"])
def test_attend_matches_the_twins(T, picks):
    """The ring, the step's own keys and (CSA/HCA) the picked compressed rows, read where
    they are: the twins' result over the keys concatenated. A query that sees no key gets
    the sink's share alone, zero output."""
    from ds4jax.pallas_kernels.sink_attention import sink_attention_reference
    from ds4jax.pallas_kernels.sparse_attention import sparse_attention_reference

    a = _attention_operands(T)
    keys = jnp.concatenate([a["raw"], a["own"]])
    mask = jnp.concatenate([a["raw_ok"], a["own_ok"]], 1)
    assert native.attend_supported(a["q"], a["raw"], a["own"], a["comp"])
    if picks:
        got = jax.jit(native.attend)(**a)
        want = sparse_attention_reference(a["q"], keys, mask, a["comp"], a["pick"],
                                          a["pick_ok"], a["sink"])  # fmt: skip
    else:
        operands = {k: a[k] for k in ("q", "raw", "raw_ok", "own", "own_ok", "sink")}
        got = jax.jit(native.attend)(**operands)
        want = sink_attention_reference(a["q"], keys, mask, a["sink"])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    assert not np.asarray(got[0]).any()


def test_attend_under_vmap_is_one_call_and_a_row_alone_equals_it_in_the_batch():
    """A batched step's per-row attention: every operand takes the row axis, one call
    serves the rows, and each row's result is bit for bit the row attended alone."""
    rows = [_attention_operands(1, seed=s) for s in range(4)]
    batch = {k: jnp.stack([r[k] for r in rows]) for k in rows[0]}
    f = jax.jit(jax.vmap(lambda a: native.attend(**a)))
    got = np.asarray(f(batch))
    assert f.lower(batch).as_text().count("ds4jax_attend_f32") == 1
    for i in (0, 3):
        alone = np.asarray(jax.jit(lambda a: native.attend(**a))(rows[i]))
        assert np.array_equal(alone, got[i])


@pytest.mark.parametrize("n_valid", [3, 1, 0])
def test_attend_writes_the_ring_as_ring_write_does(n_valid):
    """With `slot`, the call also returns the ring with the step's own keys in their slots
    (`layers.ring_write`'s ring, bit for bit: a copy), the attention over the ring as it was
    before (the same result as without `slot`); per row under `vmap`, rows at different
    positions."""
    from ds4jax.model.layers import ring_slots, ring_write

    a = _attention_operands(3, R=7)
    n = jnp.int32(12)
    got, ring = jax.jit(lambda a: native.attend(**a, slot=ring_slots(7, 3, n, n_valid)))(a)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(native.attend)(**a)))
    np.testing.assert_array_equal(np.asarray(ring), np.asarray(ring_write(a["raw"], a["own"], n,
                                                                          n_valid)))  # fmt: skip
    rows = [_attention_operands(3, seed=s, R=7) for s in range(3)]
    batch = {k: jnp.stack([r[k] for r in rows]) for k in rows[0]}
    ns = jnp.array([0, 5, 13], jnp.int32)

    def one(a, n):
        return native.attend(**a, slot=ring_slots(7, 3, n, n_valid))

    _, rings = jax.jit(jax.vmap(one))(batch, ns)
    for i in range(3):
        want = ring_write(rows[i]["raw"], rows[i]["own"], ns[i], n_valid)
        np.testing.assert_array_equal(np.asarray(rings[i]), np.asarray(want))


def test_a_batched_step_copies_no_window_ring():
    """The rows' window rings are read by the attention and written by the step: with the
    kernel writing them in place, the compiled step at B=4 copies none of them (XLA copied
    each twice per layer and step, ~0.2 ms apiece at B=8 on bench-192m)."""
    import re

    from bench.ops import step_args, step_program
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    cfg = load_config("tiny")
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    state = jax.eval_shape(lambda: init_state(cfg, 256))
    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct((4, *x.shape), x.dtype), state)
    hlo = step_program(True).lower(params, rows, *step_args(4), cfg=cfg, size=4)
    text = hlo.compile().as_text()
    assert text.count("ds4jax_attend_write_f32") == cfg.num_layers
    ring = f"f32[4,{state.layers[0].raw.shape[0]},{cfg.head_dim}]"
    copies = [ln for ln in text.splitlines() if re.search(r"= f32\[[\d,]+\]\{[\d,]+\} copy\(", ln)]
    assert copies, "no copy at all: the pattern no longer matches XLA's text"
    assert not [ln for ln in copies if ring in ln], [ln for ln in copies if ring in ln][:2]


def test_decode_steps_attend_natively_as_the_twins_do():
    """Every layer kind of `tiny` (sliding, CSA past its indexer's top-k, HCA) decoding
    through the native attention and indexer: the twins' logits, step after step."""
    from ds4jax.model.forward import decode_step, prefill
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    cfg = load_config("tiny")
    params = init_params(cfg, 0)
    prompt = (np.arange(2, 150) * 7 % 1000).astype(np.int32)  # 37 CSA rows > top-16
    state, _ = prefill(params, init_state(cfg, 192), prompt, cfg)
    step = jax.jit(decode_step, static_argnames="cfg")
    text = step.lower(params, state, 5, cfg=cfg).as_text()
    assert "ds4jax_attend_write_f32" in text and "ds4jax_index_top_f32" in text
    with native.disabled():
        twin = jax.jit(lambda p, s, t: decode_step(p, s, t, cfg))
        theirs = state
        for t in (5, 9, 11):
            theirs = twin(params, theirs, t)
    ours = state
    for t in (5, 9, 11):
        ours = step(params, ours, t, cfg=cfg)
    np.testing.assert_allclose(np.asarray(ours.logits), np.asarray(theirs.logits), atol=1e-5)


def _indexer_operands(T: int, IH: int, d: int, C: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((C, d), dtype=np.float32)
    rows[C // 2 :: 7] = rows[C // 3]  # equal scores: top_k puts the lower index first
    visible = rng.random((T, C)) < 0.7
    visible[0, :4], visible[0, 4:] = True, False  # 4 < k: −∞ scores fill the rest, in order
    f = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    return f(T, IH, d), f(T, IH), jnp.asarray(rows), jnp.asarray(visible)


@pytest.mark.parametrize(("T", "IH", "d", "C", "k"),
                         [(1, 16, 64, 2059, 512), (3, 16, 64, 700, 512), (2, 5, 20, 90, 30),
                          (native.GEMV_ROWS, 64, 128, 600, 512),
                          (64, 16, 64, 700, 512)])  # fmt: skip
def test_index_top_picks_what_top_k_of_the_twin_scores_picks(T, IH, d, C, k):
    """The indexer's scores (the twin's up to summation order) and `jax.lax.top_k`'s order
    of them: each pick's twin score is the twin's score of that rank (two rows whose scores
    differ by rounding alone may trade places), equal scores by the lower index first, the
    rows a query does not see last as −∞ in index order."""
    from ds4jax.pallas_kernels.indexer_scores import indexer_scores_reference

    q, w, rows, visible = _indexer_operands(T, IH, d, C)
    assert native.index_top_supported(q, rows)
    got_v, got_i = map(np.asarray, jax.jit(lambda *a: native.index_top(*a, k))(q, w, rows, visible))
    scores = np.asarray(indexer_scores_reference(q, w, rows, visible))
    want_v, want_i = map(np.asarray, jax.lax.top_k(scores, k))
    np.testing.assert_allclose(np.take_along_axis(scores, got_i, 1), want_v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5, atol=1e-5)
    assert (got_i != want_i).mean() < 0.01  # trades of near-equal neighbours only
    for t in range(T):
        same = got_v[t, 1:] == got_v[t, :-1]
        assert (got_i[t, 1:][same] > got_i[t, :-1][same]).all()
    assert same.any()  # the copied rows gave equal scores within one query's picks
    np.testing.assert_array_equal(np.sort(got_i[0, :4]), np.arange(4))
    np.testing.assert_array_equal(got_i[0, 4:], np.arange(4, k))
    assert np.isneginf(got_v[0, 4:]).all()


def test_index_top_of_a_prefill_chunk_gives_each_query_its_picks_alone():
    """A prefill chunk's CSA picks come from the same kernel as a decode step's: each
    query's scores and picks are a function of that query alone, so a state prefilled and
    one decoded token by token pick the same rows, bit for bit."""
    q, w, rows, visible = _indexer_operands(48, 16, 64, 700)
    f = jax.jit(lambda *a: native.index_top(*a, 512))
    chunk_v, chunk_i = map(np.asarray, f(q, w, rows, visible))
    for t in (0, 17, 47):
        v, i = map(np.asarray, f(q[t : t + 1], w[t : t + 1], rows, visible[t : t + 1]))
        assert np.array_equal(v[0], chunk_v[t]) and np.array_equal(i[0], chunk_i[t])


def test_index_top_under_vmap_is_one_call_and_a_row_alone_equals_it_in_the_batch():
    rows = [_indexer_operands(1, 16, 64, 300, seed=s) for s in range(3)]
    batch = [jnp.stack(parts) for parts in zip(*rows, strict=True)]
    f = jax.jit(jax.vmap(lambda *a: native.index_top(*a, 64)))
    got_v, got_i = f(*batch)
    assert f.lower(*batch).as_text().count("ds4jax_index_top_f32") == 1
    for i in range(3):
        v, ix = jax.jit(lambda *a: native.index_top(*a, 64))(*rows[i])
        assert np.array_equal(np.asarray(v), np.asarray(got_v[i]))
        assert np.array_equal(np.asarray(ix), np.asarray(got_i[i]))


def test_kernels_called_from_several_threads_at_once_give_their_results():
    """One call at a time holds the library's helper threads; calls made meanwhile from
    other threads run on XLA's pool instead: every result is still the call's own."""
    import concurrent.futures

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((2048, 512), dtype=np.float32))
    xs = [jnp.asarray(rng.standard_normal((1 + i % 8, 512), dtype=np.float32)) for i in range(12)]
    f = jax.jit(native.gemv)
    want = [np.asarray(f(x, w)) for x in xs]

    def calls(i: int) -> bool:
        return all(np.array_equal(np.asarray(f(xs[j], w)), want[j])
                   for _ in range(20) for j in (i, (i + 5) % 12))  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(calls, range(12)))


@pytest.mark.parametrize("T", [1, 4, native.GEMV_ROWS])
def test_gemv_many_is_each_weights_gemv_bit_for_bit(T):
    """A layer's projections of one input in one call: each result is its own `gemv`'s, bit
    for bit, whatever the weights' sizes (one of more rows than a work item, one of a single
    row, f32 and bf16 mixed); under `vmap` one call for every row and weight, and a row alone
    equals it in the batch; with a weight it cannot take, `linears` runs each `linear`."""
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.standard_normal((T, 512), dtype=np.float32))
    ws = tuple(jnp.asarray(rng.standard_normal((n, 512), dtype=np.float32))
               for n in (256, 1, 2000, 128))  # fmt: skip
    ws = (*ws[:3], ws[3].astype(jnp.bfloat16))
    assert native.gemv_many_supported(x, ws)
    got = jax.jit(native.gemv_many)(x, ws)
    one = jax.jit(native.gemv)
    assert [g.shape for g in got] == [(T, w.shape[0]) for w in ws]
    for g, w in zip(got, ws, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(one(x, w)))
    rows = jnp.stack([x, 2 * x, -x])
    many = jax.jit(jax.vmap(lambda r: layers.linears(r, *ws)))
    assert many.lower(rows).as_text().count("ds4jax_gemv_many_f32") == 1
    batched = many(rows)
    for g, b in zip(got, batched, strict=True):
        assert np.array_equal(np.asarray(b)[0], np.asarray(g))
    q = (ws[0], ws[1].astype(jnp.float16))  # a weight no GEMV takes
    assert not native.gemv_many_supported(x, q)
    assert not native.gemv_many_supported(x, ws[:1])  # one weight: `gemv`
    hlo = jax.jit(lambda x: layers.linears(x, *q)).lower(x).as_text()
    assert "ds4jax_gemv_many_f32" not in hlo


@pytest.mark.parametrize("T", [1, 3, native.GEMV_ROWS])
def test_gemv_grouped_matches_the_einsum(T):
    """The attention's grouped output projection: each group's inputs through its own
    weight, the twin's einsum up to summation order; a bf16 weight gives exactly the
    products of its f32 values; under `vmap` one call, a row alone equal to it in the batch."""
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.standard_normal((T, 4, 256), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((4, 96, 256), dtype=np.float32))
    assert native.gemv_grouped_supported(x, w)
    f = jax.jit(native.gemv_grouped)
    got = np.asarray(f(x, w))
    np.testing.assert_allclose(got, np.asarray(jnp.einsum("tgi,goi->tgo", x, w)), rtol=1e-5,
                               atol=1e-4)  # fmt: skip
    half = w.astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(f(x, half)), np.asarray(f(x, half.astype(jnp.float32))))
    rows = jnp.stack([x, 2 * x])
    g = jax.jit(jax.vmap(native.gemv_grouped, in_axes=(0, None)))
    assert g.lower(rows, w).as_text().count("ds4jax_gemv_grouped_f32") == 1
    assert np.array_equal(np.asarray(g(rows, w))[0], got)
    assert not native.gemv_grouped_supported(x, w[:3])  # groups differ


@pytest.mark.parametrize(("C", "k"), [(2059, 512), (300, 300), (90, 1), (1000, 999)])
def test_top_k_is_lax_top_k(C, k):
    """Values and indices bit for bit `jax.lax.top_k`'s: larger first, NaN above +∞, +0
    above −0, −∞ last, equal values by the lower index — with many ties (values drawn from
    a few), rows of one value, and rows sharing all but their last bytes."""
    rng = np.random.default_rng(C + k)
    rows = [
        rng.standard_normal(C),
        rng.choice([-1.5, 0.0, 2.0, 7.25], C),
        np.full(C, 3.0),
        1.0 + rng.integers(0, 4, C) * np.finfo(np.float32).eps,
    ]
    special = rng.standard_normal(C)
    special[rng.choice(C, min(C, 40), replace=False)] = rng.choice(
        [np.nan, np.inf, -np.inf, 0.0, -0.0], min(C, 40)
    )
    x = jnp.asarray(np.stack([*rows, special]), jnp.float32)
    assert native.top_k_supported(x)
    got_v, got_i = map(np.asarray, jax.jit(lambda a: native.top_k(a, k))(x))
    want_v, want_i = map(np.asarray, jax.lax.top_k(x, k))
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_v.view(np.uint32), want_v.view(np.uint32))


def test_prefill_chunks_attend_natively_as_the_twins_do():
    """A prefill chunk past the CSA indexer's top-k: its CSA layers take the native
    indexer (scores and top-k, the kernel a decode step takes) and the native attention
    over each query's picks (the twin attends over every compressed row, masked), its HCA
    and sliding layers the native attention over each query's window and visible rows —
    one call a layer — and the logits at every position are the twins'."""
    from ds4jax.model.forward import forward_chunk, prefill
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    cfg = load_config("tiny")
    params = init_params(cfg, 0)
    prompt = (np.arange(2, 150) * 7 % 1000).astype(np.int32)  # 37 CSA rows > top-16
    state, _ = prefill(params, init_state(cfg, 256), prompt, cfg)
    chunk = jnp.asarray((np.arange(64) * 11 % 997).astype(np.int32))
    text = forward_chunk.lower(params, state, chunk, 64, cfg=cfg, all_logits=True,
                               streams=False).as_text()  # fmt: skip
    assert "ds4jax_index_top_f32" in text
    assert text.count("@ds4jax_attend_f32(") == cfg.num_layers
    ours = forward_chunk(params, state, chunk, 64, cfg=cfg, all_logits=True, streams=False)
    with native.disabled():
        theirs = jax.jit(
            lambda p, s, c: forward_chunk.__wrapped__(
                p, s, c, 64, cfg=cfg, all_logits=True, streams=False
            )
        )(params, state, chunk)
    np.testing.assert_allclose(np.asarray(ours[1]), np.asarray(theirs[1]), atol=1e-5)


def test_rows_of_a_bf16_table_are_its_gather():
    """`table[idx].astype(f32)` bit for bit, negative indices from the end and indices past
    either end clamped as the gather clamps them; under `vmap` one call for every row."""
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.standard_normal((50, 24)), jnp.bfloat16)
    idx = jnp.asarray([[0, 49, -1, -50], [7, 60, -80, 3]], jnp.int32)
    assert native.rows_supported(table, idx)
    assert not native.rows_supported(table.astype(jnp.float32), idx)
    got = np.asarray(jax.jit(native.rows)(table, idx))
    want = np.asarray(table[idx].astype(jnp.float32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    f = jax.jit(jax.vmap(native.rows, in_axes=(None, 0)))
    np.testing.assert_array_equal(np.asarray(f(table, idx)), want)
    assert f.lower(table, idx).as_text().count("ds4jax_rows_f32") == 1


def test_a_burst_never_converts_a_bf16_embedding_whole():
    """Inside a burst's loop XLA hoisted the f32 convert of a bf16 embedding table (its way
    to gather bf16) out as loop-invariant; with `native.rows` no op of the compiled burst
    has the table's shape in f32."""
    from bench.ops import step_args
    from ds4jax.model import batch as batch_ops
    from ds4jax.model.params import init_params
    from ds4jax.model.state import init_state

    cfg = load_config("tiny")
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    for name in ("embed", "head"):  # in bf16, as `--weights fp4-experts` keeps them
        params[name] = jax.ShapeDtypeStruct(params[name].shape, jnp.bfloat16)
    state = jax.eval_shape(lambda: init_state(cfg, 64))
    rows = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), state)
    _, *args = step_args(1)
    text = batch_ops.burst.lower(params, rows, np.ones(1, np.int32), *args, cfg=cfg,
                                 size=1).compile().as_text()  # fmt: skip
    V, D = params["embed"].shape
    assert "ds4jax_rows_f32" in text and f"f32[{V},{D}]" not in text
