"""Orbax checkpoints of the parameter pytree, and `convert` from any supported layout.

A params checkpoint is one Orbax composite directory with two items:

* `params`: the pytree (`StandardSave`), in the dtype it was saved with;
* `meta`: JSON `{"format": "ds4jax-params", "version", "config": cfg.to_dict(), "dtype",
  "mtp_layers"}`, so a checkpoint is self-describing and restores without any other file.

A checkpoint may hold multi-token-prediction blocks (`params["mtp"]`, `mtp_layers` of them;
absent from the metadata means none): they are restored only when asked (`mtp=True`), so
code that runs the model alone reads the same tree with or without them.

Restoring builds the abstract tree from `param_shapes(cfg)` with the requested shardings, so
Orbax reads each shard straight onto its devices (resharding on load) instead of
materializing full arrays on one device first. Orbax writes to a temporary directory and
renames on commit, so an interrupted save never looks like a checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ds4jax.config import CONFIG_DIR, Config
from ds4jax.model import quantized
from ds4jax.model.params import Params, param_shapes
from ds4jax.weights.loading import CheckpointError, load_hf_checkpoint
from ds4jax.weights.official import is_official_layout, load_official_checkpoint

T = TypeVar("T")  # the tokenizer: whatever `load_model`'s caller's loader makes

FORMAT = "ds4jax-params"
VERSION = 1


def _checkpointer() -> ocp.Checkpointer:
    """A synchronous checkpointer: `save` returns only after the checkpoint is committed."""
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def is_params_checkpoint(directory: str | Path) -> bool:
    """Whether `directory` is a committed ds4jax params checkpoint (reads the metadata)."""
    return _try_metadata(Path(directory).absolute()) is not None


def _try_metadata(directory: Path) -> dict[str, Any] | None:
    if not ((directory / "meta").is_dir() and (directory / "params").is_dir()):
        return None
    try:
        with _checkpointer() as ckptr:
            meta = ckptr.restore(directory, ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
    except Exception:  # any failure means "not a readable params checkpoint"
        return None
    return dict(meta) if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _safe_to_replace(directory: Path) -> bool:
    """`force` may only delete an earlier params checkpoint or an empty directory, never an
    unrelated directory someone passed by mistake (a source checkpoint, a home dir)."""
    return (
        not directory.exists()
        or is_params_checkpoint(directory)
        or (directory.is_dir() and not any(directory.iterdir()))
    )


def save_params(params: Params, cfg: Config, directory: str | Path, *, force: bool = False) -> Path:
    """Save `params` (+ config) as an Orbax checkpoint at `directory`; returns once committed.

    An existing `directory` is refused (FileExistsError) unless `force`, and even with
    `force` only an earlier params checkpoint or an empty directory is replaced."""
    directory = Path(directory).absolute()
    if directory.exists():
        if not force:
            raise FileExistsError(f"{directory} exists (pass force=True to overwrite)")
        if not _safe_to_replace(directory):
            raise FileExistsError(f"{directory} exists and is not a ds4jax params checkpoint")
        shutil.rmtree(directory)
    dtypes = sorted(
        {str(np.dtype(x.dtype)) for x in jax.tree.leaves(params) if x.dtype != jnp.int32}
    )
    meta = {"format": FORMAT, "version": VERSION, "config": cfg.to_dict(), "dtype": dtypes[0],
            "mtp_layers": len(params.get("mtp", ()))}  # fmt: skip
    if len(dtypes) > 1:
        raise ValueError(f"params mix float dtypes {dtypes}; cast them to one first")
    with _checkpointer() as ckptr:
        ckptr.save(
            directory,
            ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
        )
    _forget_paths(directory)
    return directory


#: what Orbax's commit markers say once `_forget_paths` has rewritten them
COMMIT_MARK = "Checkpoint commit was successful"


def _forget_paths(directory: Path) -> None:
    """Orbax's commit markers (`commit_success.txt`, read for existence only) name the
    absolute path they were written at — a temporary one when the checkpoint is written
    beside its target and renamed. A shipped checkpoint (the demo's, in the repository)
    would carry the writer's machine paths; the markers keep their meaning without them."""
    for mark in directory.rglob("commit_success.txt"):
        mark.write_text(COMMIT_MARK, encoding="utf-8")


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """The `meta` item of a params checkpoint (config dict, dtype, format version,
    `mtp_layers`: the MTP blocks it holds, 0 when it has none or predates the key)."""
    directory = Path(directory).absolute()
    meta = _try_metadata(directory)
    if meta is None:
        raise CheckpointError(f"{directory} is not a ds4jax params checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{directory}: unsupported checkpoint version {meta.get('version')}")
    return {**meta, "mtp_layers": int(meta.get("mtp_layers") or 0)}


def _sharding_tree(abstract: Params, shardings: Any) -> Params:
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda _: shardings, abstract)
    if "mtp" in abstract and "mtp" not in shardings:  # a mesh's rules place the model alone
        mesh = next(s.mesh for s in jax.tree.leaves(shardings))
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        shardings = {**shardings, "mtp": jax.tree.map(lambda _: whole, abstract["mtp"])}
    if jax.tree.structure(shardings) != jax.tree.structure(abstract):
        raise ValueError("shardings must be one Sharding or a pytree matching the params")
    return shardings


def restore_params(
    directory: str | Path, shardings: Any = None, dtype: Any = None, *, mtp: bool = False
) -> tuple[Config, Params]:
    """(config, params) from a params checkpoint, placed per `shardings`.

    `shardings`: None (the default device), one `jax.sharding.Sharding` for every leaf, a
    pytree of them matching the params, or a function of the config returning either (the
    leaves are read straight onto their devices: across processes, each reads its own
    shards). `dtype`: float dtype of the restored leaves (default
    the saved one; tid2eid stays int32). `mtp`: the checkpoint's multi-token-prediction
    blocks too, as `params["mtp"]` (a CheckpointError when it has none); without it they
    are not read, and the params are the model's alone."""
    directory = Path(directory).absolute()
    meta = read_metadata(directory)
    cfg = Config.from_dict(meta["config"])
    stored = meta["mtp_layers"]
    if mtp and not stored:
        raise CheckpointError(f"{directory}: the checkpoint has no MTP block (mtp_layers 0)")
    shardings = _for_config(shardings, cfg)
    abstract = param_shapes(cfg, jnp.dtype(dtype or meta["dtype"]), stored if mtp else 0)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        _sharding_tree(abstract, shardings),
    )
    if stored and not mtp:  # the blocks on disk are left unread
        item = ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        )  # fmt: skip
    else:
        item = ocp.args.StandardRestore(target)
    with _checkpointer() as ckptr:
        restored = ckptr.restore(directory, ocp.args.Composite(params=item))
    return cfg, restored["params"]


def detect_layout(directory: str | Path) -> str:
    """ "orbax" (a params checkpoint), "official" (FP8/FP4 release) or "hf" (transformers
    `save_pretrained`); CheckpointError for anything else."""
    directory = Path(directory)
    if is_params_checkpoint(directory):
        return "orbax"
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    if not (directory / "config.json").is_file() or not (
        any(directory.glob("*.safetensors"))
        or (directory / "model.safetensors.index.json").is_file()
    ):
        raise CheckpointError(
            f"{directory}: not a params checkpoint and no config.json + *.safetensors"
        )
    return "official" if is_official_layout(directory) else "hf"


def load_any(
    src: str | Path, dtype: Any = jnp.bfloat16, shardings: Any = None,
    resident: Collection[str] = (), *, mtp: bool = False,
) -> tuple[Config, Params]:  # fmt: skip
    """(config, params) from any supported layout (see `detect_layout`). `resident`: the
    kinds ("fp8", "fp4") kept in their formats (`model.quantized`; the official layout
    only). `mtp`: the multi-token-prediction blocks too (`params["mtp"]`; a params
    checkpoint or the official layout)."""
    layout = detect_layout(src)
    if resident and layout != "official":
        raise CheckpointError(
            f"{src}: keeping the release's {'/'.join(sorted(resident)).upper()} tensors on "
            "device (--weights fp8 / fp4-experts) needs a checkpoint in the official layout, "
            f"not {layout}"
        )
    if layout == "orbax":
        return restore_params(src, shardings, dtype, mtp=mtp)
    if layout == "official":
        cfg, params = load_official_checkpoint(src, dtype=dtype, resident=resident, mtp=mtp)
    elif mtp:
        raise CheckpointError(f"{src}: no MTP block is read from the {layout} layout")
    else:
        cfg, params = load_hf_checkpoint(src, dtype=dtype)
    return cfg, _placed(params, cfg, shardings)


def _for_config(shardings: Any, cfg: Config) -> Any:
    return shardings(cfg) if callable(shardings) else shardings


def _placed(params: Params, cfg: Config, shardings: Any) -> Params:
    """Params read on the host, put on `shardings` (None: where they are)."""
    shardings = _for_config(shardings, cfg)
    if shardings is None:
        return params
    if jax.process_count() > 1:  # a global sharding takes host data, the same everywhere
        params = jax.tree.map(np.asarray, params)
    if not isinstance(shardings, jax.sharding.Sharding):
        # a resident FP8/FP4 weight: its values and exponents, from the weight's sharding
        shardings = jax.tree.map(
            lambda s, w: quantized.shardings_like(s, w) if quantized.is_quantized(w) else s,
            shardings, params, is_leaf=quantized.is_quantized,
        )  # fmt: skip
    return jax.device_put(params, shardings)


def convert(
    src: str | Path, dst: str | Path, *, dtype: Any = jnp.bfloat16, force: bool = False
) -> Path:
    """Read a checkpoint in any supported layout and write it as a params checkpoint at
    `dst` (in `dtype`), with the source's own tokenizer files beside it (a model trained
    with its own vocabulary, the demo's, is unusable without them); returns `dst`. Silent:
    the CLI does the talking."""
    src_p, dst_p = Path(src).absolute(), Path(dst).absolute()
    if src_p == dst_p or src_p in dst_p.parents:
        raise ValueError(f"destination {dst_p} must lie outside the source {src_p}")
    if dst_p.exists() and not (force and _safe_to_replace(dst_p)):
        raise FileExistsError(f"{dst_p} exists (--force replaces only a params checkpoint)")
    cfg, params = load_any(src_p, dtype)
    out = save_params(params, cfg, dst_p, force=force)
    for name in TOKENIZER_FILES:
        for f in sorted(src_p.glob(name)):
            shutil.copy2(f, out / f.name)
    return out


#: what a checkpoint directory may hold of its tokenizer (`chat.tokenizer.load_tokenizer`)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "*.model", "*.vocab")


def resolve_model_dir(
    name_or_path: str | Path, revision: str | None = None, download_dir: str | Path | None = None
) -> Path:
    """A checkpoint directory, a named model shipped beside the named configs
    (`configs/<name>/`, e.g. `demo`), or else a Hugging Face Hub repo id `org/name`: its
    snapshot in the Hub cache (`weights.hub.snapshot`; `revision` and `download_dir` apply to
    it alone), fetched first when online."""
    p = Path(name_or_path)
    if p.exists():
        return p
    named = CONFIG_DIR / str(name_or_path)
    if named.is_dir():
        return named
    from ds4jax.weights import hub

    if hub.is_repo_id(str(name_or_path)):
        return hub.snapshot(str(name_or_path), revision, download_dir)
    names = sorted(q.name for q in CONFIG_DIR.iterdir() if q.is_dir())
    raise FileNotFoundError(
        f"no model {str(name_or_path)!r}: no such directory, not a named model ({names}) "
        "and not a Hub repo id org/name"
    )


#: `--weights` → the dtype of what is not kept quantized
WEIGHTS: dict[str, Any] = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.bfloat16,
                           "fp4-experts": jnp.float32}  # fmt: skip
#: `--weights` → the release's quantized kinds kept so on device (`model.quantized`):
#: `fp4-experts` holds the routed experts in as many bits as llama.cpp's MXFP4 GGUF, the
#: rest f32 (issue 27's like-for-like comparison on CPU)
RESIDENT: dict[str, frozenset[str]] = {"fp8": frozenset({"fp8", "fp4"}),
                                        "fp4-experts": frozenset({"fp4"})}  # fmt: skip


def load_model(
    model: str | Path | None,
    config: str | None = None,
    seed: int = 0,
    dtype: Any = jnp.float32,
    *,
    load_tokenizer: Callable[[Path | None], T],
    attention_impl: str | None = None,
    shardings: Any = None,
    weights: str | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    mtp: bool = False,
) -> tuple[Config, Params, T, str]:
    """(config, params, tokenizer, description) for the CLI and the server: a checkpoint
    directory, named model or Hub repo id (`resolve_model_dir`, with `revision` and
    `download_dir`), or a named config with random weights.
    `load_tokenizer` makes the tokenizer (`ds4jax.chat.tokenizer.load_tokenizer`): it is
    handed the checkpoint directory when that ships its own tokenizer.json or SentencePiece
    `.model`, else None (the official V4 tokenizer). The caller passes it because model/ sits
    below chat/: this module knows where a checkpoint keeps its tokenizer, not how to read it.
    `attention_impl` overrides the config's (xla / pallas / auto). `shardings`: where the
    params go, as `restore_params` takes it (`model.sharding.Placement` for a `--mesh`).
    `weights` (`WEIGHTS`, overrides `dtype`): f32, bf16, fp8 — the release's FP8/FP4
    tensors kept as they are on device, the rest bf16 — or fp4-experts — the routed experts
    kept in FP4, the rest f32 values (the matrices whose values are all bf16 held in bf16,
    `model.quantized.hold_bf16_where_exact`: the same numbers in half the bytes). `mtp`:
    the model's multi-token-prediction block too (`params["mtp"]`: from a checkpoint that
    has one, see `load_any`; random with a config)."""
    resident = RESIDENT.get(weights or "", frozenset())
    if weights is not None:
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {sorted(WEIGHTS)}, not {weights!r}")
        dtype = WEIGHTS[weights]
    cfg, params, tokenizer_dir, what = _load(
        model, config, seed, dtype, shardings, resident, revision, download_dir, mtp
    )
    if weights == "fp4-experts":
        from ds4jax.model.quantized import hold_bf16_where_exact

        params = hold_bf16_where_exact(params)
    if attention_impl is not None:
        cfg = cfg.replace(attention_impl=attention_impl)
    return cfg, params, load_tokenizer(tokenizer_dir), what


def _load(
    model: str | Path | None,
    config: str | None,
    seed: int,
    dtype: Any,
    shardings: Any,
    resident: Collection[str] = (),
    revision: str | None = None,
    download_dir: str | None = None,
    mtp: bool = False,
) -> tuple[Config, Params, Path | None, str]:
    """`load_model`'s work, the tokenizer named by the directory that holds it (None: the
    official one)."""
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params

    if model is not None:
        d = resolve_model_dir(model, revision, download_dir)
        cfg, params = load_any(d, dtype=dtype, shardings=shardings, resident=resident, mtp=mtp)
        own = (d / "tokenizer.json").is_file() or any(d.glob("*.model"))
        return cfg, params, d if own else None, f"model {model}"
    if config is None:
        raise ValueError("name a model or a config")
    if resident:
        raise ValueError("--weights fp8 / fp4-experts needs a checkpoint in the official "
                         "layout (--model)")  # fmt: skip
    cfg = load_config(config)
    params = _placed(init_params(cfg, seed=seed, dtype=dtype, mtp_layers=int(mtp)), cfg,
                     shardings)  # fmt: skip
    what = (
        f"config {config!r} with RANDOM weights (seed {seed}): it shows the plumbing, "
        "its text is noise"
    )
    return cfg, params, None, what
