"""The official DeepSeek V4 release layout: FP8 block-scaled linears, FP4 routed experts.

Format (as read and as written here):

* **FP8 weights.** A 2-D `<base>.weight` stored as `F8_E4M3` has a companion `<base>.scale`
  with one power-of-two scale per 128×128 block (`weight_block_size` of the release's
  `quantization_config`), shape `[ceil(out/128), ceil(in/128)]`; the last row/column of
  blocks may be partial. Value = fp8 · scale.
* **FP4 routed experts.** `layers.L.ffn.experts.E.w{1,2,3}.weight` is E2M1 packed two per
  byte, stored as `I8` (or `U8`) of shape `[out, in/2]`. **Nibble order: the low nibble
  (bits 0–3) of byte j holds column 2j, the high nibble (bits 4–7) column 2j+1.** Each
  nibble is an E2M1 code: bit 3 sign, then 2 exponent bits and 1 mantissa bit
  (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6). `<base>.scale` has one scale per 32 consecutive
  input elements, shape `[out, in/32]`.
* **Scales** are E8M0 (a bare biased exponent, 2^(e−127)); stored as `F8_E8M0`
  (`ml_dtypes.float8_e8m0fnu`) or as raw `U8` exponent bytes — both are read; the writer
  emits `F8_E8M0` unless asked for `U8`. Plain float scales (F32/BF16) are accepted too.
* **Everything else** (norms, `hc_*`, `ape`, `attn_sink`, router weight/bias, embedding,
  head) is a plain BF16/F16/F32 tensor, `tid2eid` an integer tensor; any 2-D weight may
  instead be FP8 with a `.scale` (the head, for instance). `mtp.*` tensors are ignored.

Weights are **dequantized at load** by default: kept in bf16 (or f32) on device. The
dequantization is exact in bf16 (an FP8/FP4 value times a power of two has at most 4
significant bits), so loading in bf16 loses nothing relative to f32. With `resident`
naming "fp8" and/or "fp4" (`--weights fp8`: both; `--weights fp4-experts`: the routed
experts) those tensors stay so on device instead (`model.quantized`).

Quantization choices of the writer (used by tests and tooling, not needed to serve): the
scale of a block is the smallest power of two that keeps every element representable,
`2^ceil(log2(amax / 448))` for FP8 (448 = E4M3 max) and `2^ceil(log2(amax / 6))` for FP4;
values are rounded to nearest-even by ml_dtypes' casts.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ds4jax.config import Config, from_hf_config, load_config, to_hf_config
from ds4jax.model.params import Params, path_name
from ds4jax.weights import names
from ds4jax.weights.loading import CheckpointError, assemble, safetensor_files
from ds4jax.weights.safetensors_raw import RawTensorSource, read_tensor, write_safetensors

FP8_BLOCK: tuple[int, int] = (128, 128)
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
E8M0_BIAS = 127

_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_PLAIN_FLOATS = frozenset(
    np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)
)
#: E2M1 code → value (bit 3 is the sign).
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
#: Packed byte → (value of the low nibble, value of the high nibble) as one 8-byte word, so
#: dequantizing is a single 1-D gather (4× faster than unpacking nibbles, then a lookup).
_E2M1_PAIRS = (
    np.stack([_E2M1[np.arange(256) & 0x0F], _E2M1[np.arange(256) >> 4]], axis=1)
    .copy()
    .view(np.uint64)
    .reshape(256)
)
#: E4M3 byte → float32 (a table lookup is ~3× faster than ml_dtypes' cast).
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(_FP8).astype(np.float32)

#: Leaves (inside `layers.L.`) the writer stores as block-scaled FP8: the 2-D projections of
#: attention, compressor, indexer and shared expert.
FP8_LEAVES = frozenset(
    {
        "attn.wq_a",
        "attn.wq_b",
        "attn.wkv",
        "attn.wo_a",
        "attn.wo_b",
        "attn.compressor.wkv",
        "attn.compressor.wgate",
        "attn.indexer.wq_b",
        "attn.indexer.weights_proj",
        "attn.indexer.compressor.wkv",
        "attn.indexer.compressor.wgate",
        "ffn.shared_w1",
        "ffn.shared_w2",
        "ffn.shared_w3",
        "e_proj",  # the MTP block's input projections (`mtp.D.`)
        "h_proj",
    }
)


# ---------------------------------------------------------------------------- scales


def scale_name(weight_name: str) -> str | None:
    """`layers.0.attn.wq_a.weight` → `layers.0.attn.wq_a.scale` (None for non-weights)."""
    return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else None


def _e8m0_bytes(scale: np.ndarray, what: str) -> np.ndarray | None:
    """E8M0 scales (`float8_e8m0fnu`, or `uint8` exponent bytes) as their bytes, checked;
    None for a float scale."""
    if scale.dtype not in (_E8M0, np.dtype(np.uint8)):
        return None
    e = scale.view(np.uint8)
    if np.any(e == 0xFF):
        raise CheckpointError(f"{what}: E8M0 scale 0xFF (NaN)")
    return e


def scale_values(scale: np.ndarray, what: str = "scale") -> np.ndarray:
    """E8M0 scales (`float8_e8m0fnu`, or `uint8` exponent bytes) → float32 2^(e−127);
    float scales pass through."""
    e = _e8m0_bytes(scale, what)
    if e is not None:
        return np.ldexp(np.float32(1.0), e.astype(np.int32) - E8M0_BIAS).astype(np.float32)
    if scale.dtype.kind == "f" or scale.dtype == np.dtype(ml_dtypes.bfloat16):
        return scale.astype(np.float32)
    raise CheckpointError(f"{what}: unsupported scale dtype {scale.dtype}")


def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest e with amax / 2^e <= qmax, exactly (frexp, no log rounding); 0 for amax=0."""
    m, k = np.frexp(amax.astype(np.float64) / qmax)  # x = m·2^k, m in [0.5, 1)
    e = np.where(m == 0.5, k - 1, k)
    e = np.where(amax > 0, e, 0)
    if np.any(e > E8M0_BIAS) or np.any(e < -E8M0_BIAS):
        raise ValueError("block scale outside the E8M0 range")
    return e.astype(np.int32)


def _encode_scale(e: np.ndarray, scale_format: str) -> np.ndarray:
    codes = (e + E8M0_BIAS).astype(np.uint8)
    if scale_format == "e8m0":
        return codes.view(_E8M0)
    if scale_format == "u8":
        return codes
    raise ValueError(f"scale_format must be 'e8m0' or 'u8', not {scale_format!r}")


# ---------------------------------------------------------------------------- FP8


def _blocks(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def quantize_fp8(
    w: np.ndarray, block: tuple[int, int] = FP8_BLOCK, scale_format: str = "e8m0"
) -> tuple[np.ndarray, np.ndarray]:
    """2-D float → (E4M3 values [out, in], E8M0 scales [ceil(out/b0), ceil(in/b1)])."""
    w = np.asarray(w, np.float32)
    (o, i), (bo, bi) = w.shape, _blocks(w.shape, block)
    pad = np.zeros((bo * block[0], bi * block[1]), np.float32)
    pad[:o, :i] = w
    tiles = pad.reshape(bo, block[0], bi, block[1])
    e = _pow2_exponent(np.abs(tiles).max(axis=(1, 3)), FP8_MAX)
    scaled = tiles / np.ldexp(np.float32(1.0), e)[:, None, :, None].astype(np.float32)
    q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(_FP8).reshape(pad.shape)[:o, :i]
    return np.ascontiguousarray(q), _encode_scale(e, scale_format)


def _check_fp8(
    q: np.ndarray, scale: np.ndarray, block: tuple[int, int], what: str
) -> tuple[int, int]:
    """A 2-D FP8 weight with one scale per block; the scale grid's shape."""
    if q.ndim != 2:
        raise CheckpointError(f"{what}: FP8 weight must be 2-D, has shape {q.shape}")
    want = _blocks(q.shape, block)
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"{what}: FP8 scale has shape {tuple(scale.shape)}, expected {want} for a "
            f"{tuple(q.shape)} weight in {block[0]}x{block[1]} blocks"
        )
    return want


def dequantize_fp8(
    q: np.ndarray, scale: np.ndarray, block: tuple[int, int] = FP8_BLOCK, what: str = "tensor"
) -> np.ndarray:
    """E4M3 [out, in] with per-block scales → float32 [out, in] (partial edge blocks ok)."""
    want = _check_fp8(q, scale, block, what)
    s = scale_values(scale, what)
    w = _FP8_VALUES[q.view(np.uint8)]
    o, i = q.shape
    if o % block[0] == 0 and i % block[1] == 0:
        w.reshape(want[0], block[0], want[1], block[1])[...] *= s[:, None, :, None]
    else:
        w *= np.repeat(np.repeat(s, block[0], axis=0)[:o], block[1], axis=1)[:, :i]
    return w


# ---------------------------------------------------------------------------- FP4


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8 in 0..15) [out, in] → int8 [out, in/2]: low nibble = even column."""
    c = codes.astype(np.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).view(np.int8)


def quantize_fp4(
    w: np.ndarray, block: int = FP4_BLOCK, scale_format: str = "e8m0"
) -> tuple[np.ndarray, np.ndarray]:
    """2-D float [out, in] → (packed int8 [out, in/2], E8M0 scales [out, in/block])."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    if i % block or block % 2:
        raise ValueError(f"FP4 needs the input dim ({i}) to be a multiple of {block}")
    tiles = w.reshape(o, i // block, block)
    e = _pow2_exponent(np.abs(tiles).max(axis=2), FP4_MAX)
    scaled = np.clip(tiles / np.ldexp(np.float32(1.0), e)[:, :, None], -FP4_MAX, FP4_MAX)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(o, i) & 0x0F
    return pack_fp4(codes), _encode_scale(e, scale_format)


def _check_fp4(packed: np.ndarray, scale: np.ndarray, block: int, what: str) -> tuple[int, int]:
    """A 2-D packed FP4 weight with one scale per `block` inputs; its (out, in)."""
    if packed.ndim != 2:
        raise CheckpointError(f"{what}: FP4 weight must be 2-D, has shape {packed.shape}")
    o, i = packed.shape[0], 2 * packed.shape[1]
    if i % block or tuple(scale.shape) != (o, i // block):
        raise CheckpointError(
            f"{what}: FP4 scale has shape {tuple(scale.shape)}, expected {(o, i // block)} "
            f"for a packed {tuple(packed.shape)} weight ({i} inputs, blocks of {block})"
        )
    return o, i


def dequantize_fp4(
    packed: np.ndarray, scale: np.ndarray, block: int = FP4_BLOCK, what: str = "tensor"
) -> np.ndarray:
    """Packed E2M1 [out, in/2] with per-`block` scales [out, in/block] → float32 [out, in]."""
    o, i = _check_fp4(packed, scale, block, what)
    w = _E2M1_PAIRS[packed.view(np.uint8)].view(np.float32).reshape(o, i // block, block)
    w *= scale_values(scale, what)[:, :, None]
    return w.reshape(o, i)


# ---------------------------------------------------------------------------- loading


def _read_release_config(directory: Path) -> dict[str, Any]:
    p = directory / "config.json"
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def read_weight_map(directory: Path) -> dict[str, str] | None:
    """The index's tensor → shard file map; None without an index (one unsharded file)."""
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: corrupt index ({e})") from None


def open_source(directory: str | Path) -> RawTensorSource:
    """All tensors of a (possibly sharded) safetensors directory, any dtype."""
    directory = Path(directory)
    weight_map = read_weight_map(directory)
    if weight_map is not None:
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise CheckpointError(f"{directory}: index names missing shard files {missing}")
    return RawTensorSource(safetensor_files(directory), weight_map)


def is_official_layout(directory: str | Path) -> bool:
    """A release directory: its config declares a quantization_config, or some tensor has a
    `.scale` companion. Reads headers only."""
    directory = Path(directory)
    if "quantization_config" in _read_release_config(directory):
        return True
    return any(n.endswith(".scale") for n in open_source(directory).names())


_EXPERT_NAME = re.compile(r"^(.*\.experts\.)(\d+)(\..*\.weight)$")


class OfficialReader:
    """`read(name)` for `assemble`, returning numpy arrays already in `dtype` (int32 for
    tid2eid), so stacking 256 experts never holds float32 copies of all of them.

    Dequantizes when `<base>.scale` exists, and marks the weight and its scale used only
    when `assemble` asks for the weight. When expert E of a leaf is requested, the other
    experts of that leaf are dequantized ahead on a thread pool (numpy releases the GIL,
    and assemble reads them next, in order); with 256 experts × 3 × 43 layers this is
    where a release load spends its time. Use as a context manager to stop the pool."""

    def __init__(
        self,
        src: RawTensorSource,
        dtype: Any,
        block: tuple[int, int] = FP8_BLOCK,
        workers: int | None = None,
        resident: Collection[str] = (),
    ) -> None:
        self.src, self.out_dtype, self.block = src, np.dtype(dtype), block
        self.resident = resident
        workers = workers if workers is not None else min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(workers) if workers > 1 else None
        self._pending: dict[str, Future[np.ndarray]] = {}
        groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
        for n in src.names():
            m = _EXPERT_NAME.match(n)
            if m:
                groups.setdefault((m[1], m[3]), []).append((int(m[2]), n))
        self._siblings = {k: [n for _, n in sorted(v)] for k, v in groups.items()}

    def __enter__(self) -> OfficialReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()

    def __call__(self, name: str) -> np.ndarray:
        sname = scale_name(name)
        self.src.used.add(name)
        if sname is not None and sname in self.src:
            self.src.used.add(sname)
        fut = self._pending.pop(name, None)
        if fut is not None:
            return fut.result()
        m = _EXPERT_NAME.match(name)
        if m and self._pool is not None:
            later = self._siblings[(m[1], m[3])]
            for sib in later[later.index(name) + 1 :]:
                if sib not in self._pending:
                    self._pending[sib] = self._pool.submit(self.load, sib)
        return self.load(name)

    def load(self, name: str) -> Any:
        """One tensor, dequantized and cast — or, where its kind ("fp8", "fp4") is
        `resident`, as a `quantized.QWeight` (does not mark anything used)."""
        src = self.src
        a = read_tensor(src.info(name), name)
        sname = scale_name(name)
        if sname is not None and sname in src:
            s = read_tensor(src.info(sname), sname)
            if ("fp8" if a.dtype == _FP8 else "fp4") in self.resident:
                return _resident(a, s, self.block, name)
            if a.dtype == _FP8:
                w = dequantize_fp8(a, s, self.block, what=name)
            elif a.dtype in (np.dtype(np.int8), np.dtype(np.uint8)):
                w = dequantize_fp4(a, s, FP4_BLOCK, what=name)
            else:
                raise CheckpointError(f"{name}: dtype {a.dtype} with a .scale is not FP8/FP4")
            return w.astype(self.out_dtype)
        if name.endswith("tid2eid"):
            if a.dtype.kind not in "iu":
                raise CheckpointError(f"{name}: expected an integer tensor, got {a.dtype}")
            return a.astype(np.int32)
        if a.dtype not in _PLAIN_FLOATS:
            raise CheckpointError(
                f"{name}: {a.dtype} tensor without a {sname or '.scale'} companion"
            )
        return a.astype(self.out_dtype)


def _resident(a: np.ndarray, scale: np.ndarray, block: tuple[int, int], what: str) -> Any:
    """An FP8 or packed-FP4 tensor and its scale as a `QWeight`: values in their own dtype,
    scales as E8M0 exponent bytes (checked as `dequantize_*` check them)."""
    from ds4jax.model.quantized import QWeight

    if a.dtype == _FP8:
        _check_fp8(a, scale, block, what)
        return QWeight(a, _exponents(scale, what), block)
    if a.dtype in (np.dtype(np.int8), np.dtype(np.uint8)):
        _check_fp4(a, scale, FP4_BLOCK, what)
        return QWeight(a.view(np.uint8), _exponents(scale, what), (1, FP4_BLOCK))
    raise CheckpointError(f"{what}: dtype {a.dtype} with a .scale is not FP8/FP4")


def _exponents(scale: np.ndarray, what: str) -> np.ndarray:
    """Scales → E8M0 exponent bytes; a float scale must be a power of two."""
    e = _e8m0_bytes(scale, what)
    if e is not None:
        return e.copy()
    m, k = np.frexp(scale_values(scale, what).astype(np.float64))
    if np.any(m != 0.5):
        raise CheckpointError(f"{what}: a scale that is not a power of two cannot stay E8M0")
    return (k - 1 + E8M0_BIAS).astype(np.uint8)


def load_official_checkpoint(
    directory: str | Path,
    cfg: Config | None = None,
    dtype: Any = jnp.bfloat16,
    *,
    quant_sim: bool | None = None,
    workers: int | None = None,
    resident: Collection[str] = (),
    mtp: bool = False,
) -> tuple[Config, Params]:
    """An official release directory → (config, params), dequantized at load to `dtype`.

    `cfg` defaults to `load_config(directory)`; `quant_sim` overrides its flag (the release's
    own graph simulates FP8 KV and the FP4 indexer, transformers' reading does not).
    `workers`: threads dequantizing routed experts ahead (default min(8, CPUs); 1 = none).
    `resident`: the kinds ("fp8", "fp4") that stay in their formats
    (`model.quantized.QWeight`, `--weights fp8` / `fp4-experts`), expanded inside the step;
    the rest is `dtype`. `mtp`: the release's multi-token-prediction blocks too
    (`num_nextn_predict_layers` of them, as `params["mtp"]`; issue 29).
    Any missing, unknown, mis-shaped or malformed tensor is a `CheckpointError` naming it."""
    directory = Path(directory)
    cfg = cfg or load_config(directory)
    if quant_sim is not None:
        cfg = cfg.replace(quant_sim=quant_sim)
    release = _read_release_config(directory)
    qc = release.get("quantization_config") or {}
    block = tuple(int(b) for b in qc.get("weight_block_size", FP8_BLOCK))
    if len(block) != 2:
        raise CheckpointError(f"{directory}: weight_block_size {block} is not 2-D")
    mtp_layers = int(release.get("num_nextn_predict_layers") or 0)
    if mtp and not mtp_layers:
        raise CheckpointError(f"{directory}: the release has no MTP block "
                              "(num_nextn_predict_layers is 0)")  # fmt: skip
    src = open_source(directory)
    with OfficialReader(src, dtype, block, workers, resident) as read:
        return cfg, assemble(cfg, src, read, dtype, mtp_layers=mtp_layers if mtp else 0)


# ---------------------------------------------------------------------------- writing


def release_config(cfg: Config, *, mtp_layers: int = 1) -> dict[str, Any]:
    """An HF-style release `config.json` (model_type deepseek_v4) that `from_hf_config` maps
    back to `cfg` (quant_sim aside, which it does not carry). `compress_ratios` lists
    `mtp_layers` extra entries like the release does; `layer_types` is authoritative.

    `to_hf_config(cfg)` with the release's differences, in the release's key order:
    `torch_dtype`, `qk_rope_head_dim` for `partial_rotary_factor`, `compress_ratios`,
    `num_hash_layers`, `num_nextn_predict_layers`, nested `rope_parameters`, the FP8/FP4
    quantization fields."""
    hf = to_hf_config(cfg)
    # transformers' nested form: "main" for sliding layers, "compress" (YaRN) for the others
    flat = dict(hf["rope_parameters"])
    compress = {"rope_type": flat.pop("rope_type"), "rope_theta": cfg.compress_rope_theta}
    compress |= flat
    if cfg.yarn is not None:
        compress["attention_factor"] = 1.0
    inserted_after: dict[str, dict[str, Any]] = {
        "model_type": {"torch_dtype": "bfloat16"},
        "layer_types": {"compress_ratios": list(cfg.compress_ratios) + [0] * mtp_layers},
        "mlp_layer_types": {
            "num_hash_layers": sum(cfg.hash_layers),
            "num_nextn_predict_layers": mtp_layers,
        },
    }
    d: dict[str, Any] = {"architectures": hf.pop("architectures")}
    for k, v in hf.items():
        if k == "partial_rotary_factor":
            d["qk_rope_head_dim"] = cfg.rope_dim
            continue
        d[k] = v
        d.update(inserted_after.get(k, {}))
    d["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "compress": compress,
    }
    d["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(FP8_BLOCK),
    }
    d["expert_dtype"] = "fp4"
    back = from_hf_config(d, quant_sim=cfg.quant_sim)
    if back != cfg:
        diff = {k: v for k, v in cfg.to_dict().items() if back.to_dict()[k] != v}
        raise ValueError(f"config not representable as a release config.json: {diff}")
    return d


def _entries(
    params: Params, cfg: Config, fp8_head: bool, fp8_linears: bool = True
) -> list[tuple[str, str, Any, int]]:
    """(checkpoint name, kind, leaf, expert index or -1) for every tensor to write; kind is
    "fp8", "fp4", "int" or "bf16"."""
    out: list[tuple[str, str, Any, int]] = []

    def visit(path: tuple, leaf: Any) -> None:
        p = path_name(path)
        kind = leaf_kind(p, fp8_head)
        if kind == "fp8" and not fp8_linears:
            kind = "bf16"
        if kind == "fp4":
            for e in range(cfg.num_experts):
                out.append((names.expert_candidates(p, e)[0], "fp4", leaf, e))
            return
        out.append((names.candidates(p)[0], kind, leaf, -1))

    jax.tree_util.tree_map_with_path(visit, params)
    return out


def leaf_kind(path: str, fp8_head: bool = False) -> str:
    """How the release stores a parameter (by its params path): "fp4" (routed experts),
    "fp8" (block-scaled linears), "int" (tid2eid) or "bf16" (the rest)."""
    rest = names.split_block(path)[1]
    if rest in names.EXPERT_LEAVES:
        return "fp4"
    if rest in FP8_LEAVES or (path == "head" and fp8_head):
        return "fp8"
    return "int" if rest.endswith("tid2eid") else "bf16"


def stored_bytes(kind: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this kind and shape with its scales (the release's own sizes)."""
    n = math.prod(shape)
    if kind == "fp8":
        return n + math.prod(_blocks(shape, FP8_BLOCK))  # type: ignore[arg-type]
    if kind == "fp4":
        return n // 2 + n // FP4_BLOCK
    return n * (4 if kind == "int" else 2)


def write_official_checkpoint(
    params: Params,
    cfg: Config,
    directory: str | Path,
    *,
    shard_bytes: int = 4 * 2**30,
    fp8_head: bool = False,
    scale_format: str = "e8m0",
    force: bool = False,
    fp8_linears: bool = True,
) -> Path:
    """Quantize `params` into the release layout under `directory`: shards of at most about
    `shard_bytes`, `model.safetensors.index.json` and a release `config.json`.

    FP8 (128×128 blocks) for `FP8_LEAVES` (and the head when `fp8_head`), FP4 for routed
    experts, int32 tid2eid, bf16 for the rest (the FP8 linears too with `fp8_linears=False`,
    which the release format allows: a peer that re-quantizes FP8 then reads the same values);
    `scale_format` "e8m0" or "u8". A directory already holding a checkpoint is refused
    unless `force`."""
    directory = Path(directory)
    if directory.exists() and not force and any(directory.glob("*.safetensors")):
        raise FileExistsError(f"{directory} already holds a checkpoint (pass force=True)")
    directory.mkdir(parents=True, exist_ok=True)
    config = release_config(cfg, mtp_layers=len(params.get("mtp", ())) or 1)
    entries = _entries(params, cfg, fp8_head, fp8_linears)
    shards: list[list[tuple[str, str, Any, int]]] = [[]]
    size = 0
    total = 0
    for ent in entries:
        shape = tuple(ent[2].shape[1:] if ent[3] >= 0 else ent[2].shape)
        nb = stored_bytes(ent[1], shape)
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ent)
        size += nb
        total += nb
    for old in directory.glob("model-*-of-*.safetensors"):
        old.unlink()
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, np.ndarray] = {}
        for name, kind, leaf, e in shard:
            w = np.asarray(leaf[e] if e >= 0 else leaf)
            base = name[: -len(".weight")]
            if kind == "fp8":
                tensors[name], tensors[base + ".scale"] = quantize_fp8(w, FP8_BLOCK, scale_format)
            elif kind == "fp4":
                tensors[name], tensors[base + ".scale"] = quantize_fp4(w, FP4_BLOCK, scale_format)
            elif kind == "int":
                tensors[name] = w.astype(np.int32)
            else:
                tensors[name] = w.astype(ml_dtypes.bfloat16)
        write_safetensors(directory / fname, tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
