"""Disk checkpoints in the state dtype (issue 26): rows are stored as the bytes of their
bf16 / fp8 records, so a state of that dtype (whose rows are values of it) comes back bit
for bit at a fraction of the f32 bytes; a checkpoint of the previous format is ignored
with a log line, never misread."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.kvstore.checkpoint import sha1_hex
from ds4jax.kvstore.payload import pack
from ds4jax.model.pages import rows_from_bytes, rows_to_bytes
from tests.kvstore.conftest import convo, fake_state, make_store, states_equal, tokens_for

SYSTEM = "You are a careful coding agent. " * 20
N = 300


def _in_dtype(cfg, n: int):
    """A fake state whose rows are values of `cfg.state_dtype`, as the model makes them."""
    state = fake_state(cfg, n)
    if cfg.state_dtype == "f32":
        return state

    def rnd(rows, index):
        if rows is None:
            return None
        a = np.asarray(rows)
        back = rows_from_bytes(rows_to_bytes(a, cfg.rope_dim, cfg.state_dtype, index),
                               a.shape[-1], cfg.rope_dim, cfg.state_dtype, index)  # fmt: skip
        return jnp.asarray(back)

    layers = tuple(replace(ls, raw=rnd(ls.raw, False), comp=rnd(ls.comp, False),
                           idx=rnd(ls.idx, True)) for ls in state.layers)  # fmt: skip
    return replace(state, layers=layers)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_state_of_the_dtype_comes_back_bit_for_bit_in_fewer_bytes(tmp_path, cfg, dtype) -> None:
    typed = cfg.replace(state_dtype=dtype)
    state = _in_dtype(typed, N)
    store = make_store(tmp_path / "kv", typed)
    store.save(tokens_for(N), convo(SYSTEM, "hello"), state, "evict", None)
    hit = make_store(tmp_path / "kv", typed).lookup(convo(SYSTEM, "hello", "hi"))
    assert hit is not None and states_equal(hit.load(), state)
    f32 = sum(a.nbytes for a in pack(state, N, cfg).values())
    ours = sum(a.nbytes for a in pack(state, N, typed).values())
    rows_only = {"bf16": 0.5, "fp8": 584 / 2048}[dtype]  # tiny's rows: 64 dims in 2 bytes
    assert ours < f32 and ours / f32 < rows_only + 0.35  # the frontiers stay f32


def test_rows_are_stored_as_their_records(cfg) -> None:
    """On disk a row is its record's bytes (584 B at Flash in fp8), not float32 values."""
    typed = cfg.replace(state_dtype="fp8")
    arrays = pack(fake_state(cfg, N), N, typed)
    assert arrays["l2_comp"].dtype == np.uint8  # records, not floats


def test_a_stored_row_reads_by_hand_as_the_release_lays_it_out() -> None:
    """The bytes `records` makes on the device, read with numpy alone: 448 E4M3 codes, the
    64 RoPE dims as little-endian BF16, 7 UE8M0 scale bytes and one pad byte (Flash's
    584-byte row); an indexer row's 128 E4M3 codes and its float32 scale (132 bytes)."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((5, 512)) * rng.uniform(0.01, 40, (5, 1))).astype(np.float32)
    rows = rows_from_bytes(rows_to_bytes(rows, 64, "fp8"), 512, 64, "fp8")  # values of fp8
    data = rows_to_bytes(rows, 64, "fp8")
    assert data.shape == (5, 584) and data.dtype == np.uint8
    codes = data[:, :448].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    rope = data[:, 448:576].copy().view("<u2").astype(np.uint32) << 16
    scales = np.exp2(data[:, 576:583].astype(np.float32) - 127)
    nope = (codes.reshape(5, 7, 64) * scales[..., None]).reshape(5, 448)
    assert np.array_equal(nope, rows[:, :448]) and not data[:, 583].any()
    assert np.array_equal(rope.view(np.float32), rows[:, 448:])

    keys = rng.standard_normal((5, 128)).astype(np.float32)
    keys = rows_from_bytes(rows_to_bytes(keys, 0, "fp8", True), 128, 0, "fp8", True)
    data = rows_to_bytes(keys, 0, "fp8", True)
    assert data.shape == (5, 132)
    codes = data[:, :128].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scale = data[:, 128:].copy().view("<f4")
    assert np.array_equal(codes * scale, keys)


def test_a_checkpoint_of_the_previous_format_is_ignored_with_a_log_line(
    tmp_path, cfg, caplog
) -> None:
    store = make_store(tmp_path, cfg)
    store.save(tokens_for(N), convo(SYSTEM, "old"), fake_state(cfg, N), "evict", None)
    meta = tmp_path / sha1_hex("".join(s.text for s in convo(SYSTEM, "old")).encode())
    doc = json.loads((meta / "meta.json").read_text())
    doc["format"] = "ds4jax-kv/2"
    (meta / "meta.json").write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="ds4jax.kvstore"):
        fresh = make_store(tmp_path, cfg)
        assert fresh.lookup(convo(SYSTEM, "old")) is None
    assert "not a ds4jax-kv/4 checkpoint" in caplog.text
