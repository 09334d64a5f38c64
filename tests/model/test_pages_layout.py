"""What a page and a session cost in each state dtype (`ds4jax.model.pages`), counted on
the arrays' shapes: the release's 584-byte record, Flash's bytes per token of context, and
pages that hold every row a frontier's tokens complete."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4jax.config import load_config
from ds4jax.kvstore.pages import pages_for
from ds4jax.model import pages, quant_sim
from ds4jax.model.page_table import PAGE_TOKENS
from ds4jax.model.state import capacity, capacity_bytes

FLASH = load_config("deepseek-v4-flash")


def test_the_fp8_record_is_the_releases() -> None:
    assert pages.record_bytes(FLASH, "fp8") == (584, 132)  # 448 + 7 scales + 1 pad + 128; 128 + 4
    assert pages.record_bytes(FLASH, "bf16") == (1024, 256)
    assert pages.record_bytes(FLASH, "f32") == (2048, 512)


def test_flash_bytes_per_token_of_context() -> None:
    kinds = [FLASH.layer_kind(i) for i in range(FLASH.num_layers)]
    csa, hca = kinds.count("csa"), kinds.count("hca")
    assert (csa, hca) == (21, 20)
    per_token = {d: pages.bytes_per_token(FLASH, d) for d in pages.STATE_DTYPES}
    # per token: a CSA layer completes 1/4 of a row and of an indexer row, HCA 1/128 of a row
    for d, (comp, idx) in ((d, pages.record_bytes(FLASH, d)) for d in pages.STATE_DTYPES):
        assert per_token[d] == pytest.approx(csa * (comp + idx) / 4 + hca * comp / 128)
    assert per_token["fp8"] <= 3900  # the goal: ≤ 3.9 KB
    assert per_token["f32"] == 2 * per_token["bf16"]


@pytest.mark.parametrize("name", ["tiny", "bench-192m", "deepseek-v4-flash"])
def test_pages_hold_every_row_a_frontiers_tokens_complete(name: str) -> None:
    cfg = load_config(name)
    shapes = jax.eval_shape(lambda: pages.page_arrays(cfg, 3, "fp8"))
    for i, layer in enumerate(shapes):
        if cfg.layer_kind(i) == "sliding":
            assert layer is None
            continue
        rows = layer["comp"]["nope"].shape[1]
        assert rows * cfg.compress_ratios[i] == PAGE_TOKENS
        for n in (1, 255, 256, 4000, 65536):
            # the fixed-capacity state holds n // r + 1 rows; the pages of n tokens as many
            assert pages_for(n) * rows >= capacity(cfg, i, n) - 1
        if cfg.layer_kind(i) == "csa":
            assert layer["idx"]["key"].shape[:2] == (3, rows)


def test_the_session_part_does_not_grow_with_the_context_and_pages_do() -> None:
    """A 2k-token conversation held in pages costs its pages and one session part, the
    same at any --ctx; today's state costs its capacity."""
    fixed = pages.session_bytes(FLASH, "fp8")
    held = pages_for(2048) * pages.page_bytes(FLASH, "fp8") + fixed
    assert held < capacity_bytes(FLASH, 8192) < capacity_bytes(FLASH, 1 << 20)
    assert pages.session_bytes(FLASH, "fp8") < pages.session_bytes(FLASH, "f32")
    with pytest.raises(ValueError):
        pages.page_bytes(FLASH, "int4")


# ---------------------------------------------------------------------- the record codec


@given(
    st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=200),
    st.sampled_from([1e-6, 1e-2, 1.0, 1e3]),
)
@settings(max_examples=60, deadline=None)
def test_fp8_encode_is_the_simulation_as_bytes(values: list[float], scale: float) -> None:
    """The stored codes and UE8M0 bytes decode to exactly what `fp8sim` computes; each
    byte is a power-of-two scale's exponent + 127."""
    x = jnp.asarray(np.asarray(values, np.float32) * np.float32(scale))
    codes, exps = quant_sim.fp8_encode(x)
    assert codes.dtype == jnp.float8_e4m3fn and exps.dtype == jnp.uint8
    assert exps.shape == (-(-len(values) // 64),)
    got = np.asarray(quant_sim.fp8_decode(codes, exps))
    assert np.array_equal(got.view(np.uint32), np.asarray(quant_sim.fp8sim(x)).view(np.uint32))


@pytest.fixture(scope="module")
def tiny_rows(paged_states) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The compressed and indexer rows a tiny model's prefill wrote (quant_sim on)."""
    cfg = load_config("tiny")
    assert cfg.quant_sim
    out = []
    for i, ls in enumerate(paged_states["prompt"].layers):
        if cfg.layer_kind(i) != "sliding":
            n = 600 // cfg.compress_ratios[i]
            idx = None if ls.idx is None else np.asarray(ls.idx[:n])
            out.append((np.asarray(ls.comp[:n]), idx))
    return out


def test_fp8_records_keep_the_models_rows(tiny_rows) -> None:
    """Rows the official graph produced are FP8-simulated already on their non-RoPE dims:
    stored as records they come back bit for bit there, and the RoPE dims as BF16 rounds
    them; f32 is the identity, bf16 rounds every dim."""
    cfg = load_config("tiny")
    nope = cfg.head_dim - cfg.rope_dim
    for comp, _ in tiny_rows:
        stored = pages.encode_rows(jnp.asarray(comp), cfg.rope_dim, "fp8")
        n = comp.shape[0]
        like = jax.eval_shape(lambda n=n: pages._rows((n,), cfg.head_dim, cfg.rope_dim, "fp8"))
        assert {k: (v.shape, v.dtype) for k, v in stored.items()} == {
            k: (v.shape, v.dtype) for k, v in like.items()}  # fmt: skip
        back = np.asarray(pages.decode_rows(stored))
        assert np.array_equal(back[:, :nope], comp[:, :nope])
        rope = np.asarray(jnp.asarray(comp[:, nope:]).astype(jnp.bfloat16).astype(jnp.float32))
        assert np.array_equal(back[:, nope:], rope)
        assert np.array_equal(np.asarray(pages.decode_rows(pages.encode_rows(comp, 0, "f32"))),
                              comp)  # fmt: skip
        bf16 = np.asarray(pages.decode_rows(pages.encode_rows(jnp.asarray(comp), 0, "bf16")))
        assert np.allclose(bf16, comp, rtol=2**-8, atol=0)


def test_fp8_indexer_rows_within_e4m3_rounding(tiny_rows) -> None:
    for _, idx in tiny_rows:
        if idx is None:
            continue
        stored = pages.encode_index_rows(jnp.asarray(idx), "fp8")
        assert stored["key"].dtype == jnp.float8_e4m3fn and stored["scale"].shape == idx.shape[:1]
        back = np.asarray(pages.decode_index_rows(stored))
        scale = np.asarray(stored["scale"])[:, None]
        # E4M3 rounds to 3 mantissa bits (half an ulp: 2^-4 relative); below its normal range
        # the step is 2^-9 of the scale (half of it absolute)
        assert np.all(np.abs(back - idx) <= np.maximum(np.abs(idx) * 2**-4, scale * 2**-10))
