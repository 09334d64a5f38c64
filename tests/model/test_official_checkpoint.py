"""The official release layout: FP8 block-scaled linears, FP4 routed experts, E8M0 scales.

A random tiny model is quantized with `write_official_checkpoint` and read back with
`load_official_checkpoint`. Expected values are recomputed here independently (block amax,
power-of-two scale, ml_dtypes casts) rather than through the module's own helpers, and the
file headers are parsed by hand and by the `safetensors` library, so a writer/reader pair that
agreed on a wrong convention would still fail.

Params come from numpy (`tests.model.tiny_model`), not `init_params`.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ds4jax.config import Config, load_config
from ds4jax.model.params import Params, param_shapes, path_name
from ds4jax.weights import official
from ds4jax.weights.loading import CheckpointError
from ds4jax.weights.safetensors_raw import RawTensorSource, write_safetensors
from tests.model.tiny_model import random_params, tiny_config


def leaves(params: Params) -> dict[str, np.ndarray]:
    return {
        path_name(p): np.asarray(x, dtype=np.float32 if x.dtype != np.int32 else np.int32)
        for p, x in jax.tree_util.tree_leaves_with_path(params)
    }


def is_fp8_leaf(name: str) -> bool:
    rest = name.split(".", 2)[-1] if name.startswith("layers.") else name
    return rest in official.FP8_LEAVES or name == "head"


def is_expert_leaf(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".ffn." in name


# ------------------------------------------------ independent reference quantization


def ref_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dequantized value, per-element block scale) for 128×128 blocks."""
    out = np.empty_like(w)
    scale = np.empty_like(w)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            blk = w[r : r + 128, c : c + 128]
            amax = np.abs(blk).max().astype(np.float64)  # float32 division could round
            s = 2.0 ** np.ceil(np.log2(amax / 448.0)) if amax > 0 else 1.0
            q = (blk / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            out[r : r + 128, c : c + 128] = q * s
            scale[r : r + 128, c : c + 128] = s
    return out, scale


def ref_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dequantized value, per-element scale) for blocks of 32 along the input axis."""
    o, i = w.shape
    blk = w.reshape(o, i // 32, 32)
    amax = np.abs(blk).max(axis=2, keepdims=True).astype(np.float64)
    s = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 1.0)
    q = (blk / s).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * s).reshape(o, i), np.broadcast_to(s, blk.shape).reshape(o, i)


def header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


# ------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cfg() -> Config:
    return tiny_config()


@pytest.fixture(scope="module")
def originals(cfg: Config) -> Params:
    return random_params(cfg, seed=0)


@pytest.fixture(scope="module")
def release(cfg: Config, originals: Params, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("release")
    official.write_official_checkpoint(originals, cfg, d, shard_bytes=300_000, fp8_head=True)
    return d


@pytest.fixture(scope="module")
def loaded(release: Path) -> tuple[Config, Params]:
    return official.load_official_checkpoint(release)


# ------------------------------------------------ layout


def test_release_layout_on_disk(release: Path, cfg: Config) -> None:
    index = json.loads((release / "model.safetensors.index.json").read_text())
    shards = sorted(release.glob("*.safetensors"))
    assert len(shards) >= 3
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    hdr: dict[str, Any] = {}
    for f in shards:
        h = header(f)
        h.pop("__metadata__", None)
        assert all(index["weight_map"][k] == f.name for k in h)
        hdr |= h
    assert set(hdr) == set(index["weight_map"])

    def entry(name: str) -> tuple[str, list[int]]:
        return hdr[name]["dtype"], hdr[name]["shape"]

    assert entry("layers.0.attn.wq_a.weight") == ("F8_E4M3", [128, 256])
    assert entry("layers.0.attn.wq_a.scale") == ("F8_E8M0", [1, 2])
    assert entry("head.weight") == ("F8_E4M3", [300, 256])
    assert entry("head.scale") == ("F8_E8M0", [3, 2])
    assert entry("layers.1.attn.indexer.weights_proj.scale") == ("F8_E8M0", [1, 2])
    assert entry("layers.2.ffn.experts.3.w1.weight") == ("I8", [128, 128])
    assert entry("layers.2.ffn.experts.3.w1.scale") == ("F8_E8M0", [128, 8])
    assert entry("layers.2.ffn.experts.0.w2.weight") == ("I8", [256, 64])
    assert entry("layers.2.ffn.experts.0.w2.scale") == ("F8_E8M0", [256, 4])
    assert entry("layers.0.ffn.gate.tid2eid") == ("I32", [300, 2])
    assert entry("embed.weight") == ("BF16", [300, 256])
    assert entry("layers.1.attn.compressor.ape") == ("BF16", [4, 256])
    assert not any(k.startswith("model.") for k in hdr)

    written = json.loads((release / "config.json").read_text())
    assert written["model_type"] == "deepseek_v4"
    assert written["quantization_config"]["weight_block_size"] == [128, 128]
    assert written["expert_dtype"] == "fp4"
    assert len(written["compress_ratios"]) > cfg.num_layers  # MTP entry, as in the release
    # a release config means DeepSeek's own graph: quantization simulation on by default
    assert load_config(release) == cfg.replace(quant_sim=True)


def test_files_are_readable_by_the_safetensors_library(release: Path, originals: Params) -> None:
    from safetensors import safe_open

    for f in release.glob("*.safetensors"):
        with safe_open(str(f), framework="numpy") as h:
            keys = set(h.keys())
            if "embed.weight" in keys:
                got = h.get_tensor("embed.weight")
                want = np.asarray(originals["embed"]).astype(ml_dtypes.bfloat16)
                np.testing.assert_array_equal(got, want)
                return
    pytest.fail("embed.weight not found")


# ------------------------------------------------ values


def test_loaded_weights_are_the_exact_dequantization(
    loaded: tuple[Config, Params], originals: Params, cfg: Config
) -> None:
    got_cfg, params = loaded
    assert got_cfg == cfg.replace(quant_sim=True)  # a release defaults to its own graph
    assert jax.tree.structure(params) == jax.tree.structure(param_shapes(cfg))
    got, want = leaves(params), leaves(originals)
    fp8_err = fp4_err = 0.0
    for p, x in jax.tree_util.tree_leaves_with_path(params):
        name = path_name(p)
        assert x.dtype == (jnp.int32 if name.endswith("tid2eid") else jnp.bfloat16), name
        w = want[name]
        if is_fp8_leaf(name):
            deq, s = ref_fp8(w)
            np.testing.assert_array_equal(got[name], deq, err_msg=name)
            assert np.all(np.abs(deq - w) <= np.abs(w) / 16 + s * 2.0**-10), name
            normal = np.abs(w) >= s * 2.0**-6  # E4M3's normal range at this block scale
            fp8_err = max(fp8_err, float((np.abs(deq - w) / np.abs(w))[normal].max()))
        elif is_expert_leaf(name):
            for e in range(cfg.num_experts):
                deq, s = ref_fp4(w[e])
                np.testing.assert_array_equal(got[name][e], deq, err_msg=f"{name}[{e}]")
                assert np.all(np.abs(deq - w[e]) <= s), name  # half the widest E2M1 step
                fp4_err = max(fp4_err, float((np.abs(deq - w[e]) / (6 * s)).max()))
        elif name.endswith("tid2eid"):
            np.testing.assert_array_equal(got[name], w, err_msg=name)
        else:
            bf16 = w.astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(got[name], bf16, err_msg=name)
    # E4M3 keeps 3 mantissa bits (≤ 2^-4 relative for normals); E2M1 steps ≤ 1/6 of 6·scale
    assert 0 < fp8_err <= 2.0**-4 and 0 < fp4_err <= 1 / 6 + 1e-9
    print(f"max FP8 error {fp8_err:.4f} (relative, normals); FP4 {fp4_err:.4f} of block range")


def test_expert_prefetch_does_not_change_results(
    release: Path, loaded: tuple[Config, Params]
) -> None:
    _, serial = official.load_official_checkpoint(release, workers=1)
    for a, b in zip(jax.tree.leaves(serial), jax.tree.leaves(loaded[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("scale_format", ["e8m0", "u8"])
def test_partial_fp8_blocks_and_scale_formats(scale_format: str) -> None:
    w = np.random.default_rng(3).standard_normal((300, 200)).astype(np.float32)
    w[:128, :128] *= 1e-3  # blocks with very different ranges
    w[256:, 128:] = 0.0  # an all-zero (partial) block
    q, s = official.quantize_fp8(w, scale_format=scale_format)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (300, 200)
    assert s.shape == (3, 2)
    assert s.dtype == (np.uint8 if scale_format == "u8" else ml_dtypes.float8_e8m0fnu)
    deq = official.dequantize_fp8(q, s)
    np.testing.assert_array_equal(deq, ref_fp8(w)[0])
    with pytest.raises(CheckpointError, match="expected \\(3, 2\\)"):
        official.dequantize_fp8(q, s[:2], what="x.weight")

    v = np.random.default_rng(4).standard_normal((8, 64)).astype(np.float32)
    packed, s4 = official.quantize_fp4(v, scale_format=scale_format)
    assert packed.dtype == np.int8 and packed.shape == (8, 32) and s4.shape == (8, 2)
    np.testing.assert_array_equal(official.dequantize_fp4(packed, s4), ref_fp4(v)[0])
    np.testing.assert_array_equal(official.dequantize_fp4(packed.view(np.uint8), s4), ref_fp4(v)[0])


def test_fp4_nibble_order_low_nibble_is_the_even_column() -> None:
    # scale 1 (amax 6): 0.5 is code 1, -6 is code 15, 3 is code 5, 0 is code 0
    v = np.zeros((1, 32), np.float32)
    v[0, :4] = [0.5, -6.0, 3.0, 0.0]
    packed, s = official.quantize_fp4(v)
    assert s.view(np.uint8).tolist() == [[127]]
    assert packed.view(np.uint8)[0, :2].tolist() == [0xF1, 0x05]
    np.testing.assert_array_equal(official.dequantize_fp4(packed, s), v)


def test_logits_from_dequantized_weights_track_the_originals(
    release: Path, originals: Params, cfg: Config
) -> None:
    from ds4jax.model.forward import prefill
    from ds4jax.model.state import init_state

    _, deq = official.load_official_checkpoint(release, dtype=jnp.float32)
    orig = jax.tree.map(jnp.asarray, originals)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, 12)
    state = init_state(cfg, 32)
    _, a = prefill(orig, state, tokens, cfg, chunk_sizes=(16,), all_logits=True)
    _, b = prefill(deq, state, tokens, cfg, chunk_sizes=(16,), all_logits=True)
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(b).all()
    corr = [np.corrcoef(a[t], b[t])[0, 1] for t in range(len(tokens))]
    print("logit correlation per position", np.round(corr, 3))
    # Measured: mean 0.97, min 0.84 (a routing/top-k flip); a nibble swap in the experts
    # gives mean 0.53, reversed wq_a rows 0.77 — the bound separates them.
    assert np.mean(corr) > 0.95 and min(corr) > 0.75, corr


# ------------------------------------------------ errors


def rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """Copy a release, apply `edit(tensors)` to the union of its tensors (a dict it may
    change), and write it back as one shard with a matching index."""
    shutil.copytree(src, dst)
    rs = RawTensorSource(sorted(dst.glob("*.safetensors")))
    tensors = {n: rs.get(n) for n in sorted(rs.names())}
    for f in dst.glob("*.safetensors"):
        f.unlink()
    edit(tensors)
    write_safetensors(dst / "model-00001-of-00001.safetensors", tensors)
    index = {"weight_map": dict.fromkeys(tensors, "model-00001-of-00001.safetensors")}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop("layers.1.attn.wkv.weight"), "layers.1.attn.wkv"),
        (lambda t: t.pop("layers.2.ffn.experts.1.w3.weight"), r"layers.2.ffn.w3\[expert 1\]"),
        (
            lambda t: t.update({"layers.0.attn.bogus.weight": np.zeros(3, np.float32)}),
            "layers.0.attn.bogus.weight",
        ),
        (
            lambda t: t.update({"layers.1.attn.wq_b.scale_extra": np.zeros(3, np.uint8)}),
            "wq_b.scale_extra",
        ),
        (
            lambda t: t.update({"layers.0.attn.kv_norm.weight": np.ones(5, ml_dtypes.bfloat16)}),
            "layers.0.attn.kv_norm.*shape",
        ),
        (
            lambda t: t.update({"layers.0.attn.wq_a.scale": np.zeros((2, 2), np.uint8)}),
            "layers.0.attn.wq_a.weight.*scale",
        ),
        (
            lambda t: t.update({"layers.2.ffn.experts.0.w1.scale": np.zeros((128, 3), np.uint8)}),
            "layers.2.ffn.experts.0.w1.weight.*scale",
        ),
        (
            lambda t: t.update({"layers.1.ffn.experts.2.w2.scale": np.zeros((256, 3), np.uint8)}),
            "layers.1.ffn.experts.2.w2.weight.*scale",
        ),
        (
            lambda t: t.update(
                {
                    f"layers.2.ffn.experts.4.w1.{k}": t[f"layers.2.ffn.experts.0.w1.{k}"]
                    for k in ("weight", "scale")
                }
            ),
            r"unknown.*layers\.2\.ffn\.experts\.4\.w1\.scale",
        ),
        (lambda t: t.pop("layers.0.attn.wo_b.scale"), "layers.0.attn.wo_b.weight"),
        (
            lambda t: t.update({"layers.0.ffn.gate.tid2eid": np.zeros((300, 2), np.float32)}),
            "tid2eid",
        ),
    ],
    ids=[
        "missing",
        "missing-expert",
        "unknown",
        "unknown-scale",
        "shape",
        "fp8-scale-shape",
        "fp4-scale-shape",
        "fp4-scale-shape-prefetched",
        "extra-expert",
        "no-scale",
        "int-dtype",
    ],
)
def test_bad_tensors_are_named(release: Path, tmp_path: Path, edit: Any, match: str) -> None:
    bad = rewrite(release, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        official.load_official_checkpoint(bad)


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _huge_header(f: Path) -> None:
    f.write_bytes(struct.pack("<Q", 1 << 40) + f.read_bytes()[8:])


def _garbage_header(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"not json at "
    f.write_bytes(bytes(raw))


def _tiny_file(f: Path) -> None:
    f.write_bytes(b"\x01\x02")


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (_truncate, "truncated or corrupt"),
        (_huge_header, "header"),
        (_garbage_header, "corrupt safetensors header"),
        (_tiny_file, "truncated safetensors file"),
    ],
)
def test_damaged_files_are_named(release: Path, tmp_path: Path, damage: Any, match: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    f = sorted(bad.glob("*.safetensors"))[1]
    damage(f)
    with pytest.raises(CheckpointError, match=match) as e:
        official.load_official_checkpoint(bad)
    assert f.name in str(e.value)


def test_missing_shard_is_named(release: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    f = sorted(bad.glob("*.safetensors"))[0]
    f.unlink()
    with pytest.raises(CheckpointError, match=f.name):
        official.load_official_checkpoint(bad)


def test_writer_refuses_to_overwrite(release: Path, originals: Params, cfg: Config) -> None:
    with pytest.raises(FileExistsError):
        official.write_official_checkpoint(originals, cfg, release)


def test_index_pointing_at_the_wrong_shard_is_named(release: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    other = next(f for f in sorted(set(wm.values())) if f != wm["embed.weight"])
    wm["embed.weight"] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"embed\.weight"):
        official.load_official_checkpoint(bad)


@pytest.mark.parametrize(
    "cfg",
    [tiny_config(), tiny_config(yarn=None), Config(quant_sim=False)],
    ids=["tiny", "no-yarn", "flash"],
)
def test_release_config_round_trips(cfg: Config, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(official.release_config(cfg)))
    assert load_config(tmp_path) == cfg.replace(quant_sim=True)


def test_mtp_tensors_are_ignored(
    release: Path, tmp_path: Path, loaded: tuple[Config, Params]
) -> None:
    def add_mtp(t: dict[str, np.ndarray]) -> None:
        for k in ("weight", "scale"):
            t[f"mtp.0.attn.wq_a.{k}"] = t[f"layers.0.attn.wq_a.{k}"]
        t["mtp.0.norm.weight"] = t["norm.weight"]

    _, params = official.load_official_checkpoint(rewrite(release, tmp_path / "mtp", add_mtp))
    np.testing.assert_array_equal(np.asarray(params["head"]), np.asarray(loaded[1]["head"]))
