"""Orbax params checkpoints (`save_params` / `restore_params`) and `convert` from every
supported source layout.

Resharding on restore is checked on a 1-device mesh in-process and, because the test
process usually has a single CPU device, on 8 forced host devices in a subprocess (the
device count is fixed when JAX initializes, so it cannot be changed in-process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from ds4jax.config import Config
from ds4jax.model.params import Params, init_params, path_name
from ds4jax.weights import names
from ds4jax.weights.checkpoint import (
    COMMIT_MARK,
    convert,
    detect_layout,
    is_params_checkpoint,
    read_metadata,
    restore_params,
    save_params,
)
from ds4jax.weights.loading import CheckpointError, load_hf_checkpoint
from ds4jax.weights.official import (
    load_official_checkpoint,
    release_config,
    write_official_checkpoint,
)
from tests.conftest import forced_devices_env
from tests.model.tiny_model import assert_same, random_params, tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg() -> Config:
    return tiny_config()


@pytest.fixture(scope="module")
def params(cfg: Config) -> Params:
    return jax.tree.map(jnp.asarray, random_params(cfg, seed=1))


@pytest.fixture(scope="module")
def saved(params: Params, cfg: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_params(params, cfg, tmp_path_factory.mktemp("orbax") / "ckpt")


def expert_shardings(params: Params, mesh: Mesh) -> Params:
    """Routed experts split over the mesh's "expert" axis, everything else replicated."""

    def spec(path: tuple, _: Any) -> NamedSharding:
        is_expert = path_name(path).endswith(("ffn.w1", "ffn.w2", "ffn.w3"))
        return NamedSharding(mesh, P("expert") if is_expert else P())

    return jax.tree_util.tree_map_with_path(spec, params)


# ------------------------------------------------ save / restore


def test_save_restore_round_trip(saved: Path, params: Params, cfg: Config) -> None:
    assert is_params_checkpoint(saved)
    meta = read_metadata(saved)
    assert meta["dtype"] == "float32" and Config.from_dict(meta["config"]) == cfg
    got_cfg, got = restore_params(saved)
    assert got_cfg == cfg
    assert_same(got, params)
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(got))


def test_a_saved_checkpoint_names_no_machine_path(saved: Path) -> None:
    """Orbax's commit markers are rewritten without the absolute path they were written at
    (the demo checkpoint ships in the repository), and the checkpoint still restores."""
    marks = list(saved.rglob("commit_success.txt"))
    assert marks
    for mark in marks:
        assert mark.read_text(encoding="utf-8") == COMMIT_MARK
    for mark in (Path(__file__).resolve().parents[2] / "configs" / "demo").rglob(
        "commit_success.txt"
    ):
        assert mark.read_text(encoding="utf-8") == COMMIT_MARK


def test_restore_casts_floats_but_not_tid2eid(saved: Path, params: Params) -> None:
    _, got = restore_params(saved, dtype=jnp.bfloat16)
    assert got["embed"].dtype == jnp.bfloat16
    assert got["layers"][0]["ffn"]["tid2eid"].dtype == jnp.int32
    np.testing.assert_array_equal(
        np.asarray(got["head"]), np.asarray(params["head"].astype(jnp.bfloat16))
    )


def test_restore_onto_a_named_sharding(saved: Path, params: Params) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    one = NamedSharding(mesh, P())
    _, got = restore_params(saved, shardings=one)
    assert all(x.sharding == one for x in jax.tree.leaves(got))
    assert_same(got, params)
    tree = expert_shardings(params, mesh)
    _, got = restore_params(saved, shardings=tree)
    assert jax.tree.leaves(got["layers"][1])[0].sharding in jax.tree.leaves(tree)
    assert_same(got, params)
    with pytest.raises(ValueError, match="pytree"):
        restore_params(saved, shardings={"embed": one})


def test_an_mtp_block_is_restored_only_when_asked(
    saved: Path, params: Params, cfg: Config, tmp_path: Path
) -> None:
    """A checkpoint with the MTP block (the demo's) says so in its metadata; restored
    without asking it gives the model's params alone, as a checkpoint without it does (the
    block left unread, any dtype); asked for, the block too. Asked of a checkpoint without
    one (`saved`, or one that predates the key): a clear error."""
    mtp = init_params(cfg, 2, mtp_layers=1)["mtp"]
    path = save_params({**params, "mtp": mtp}, cfg, tmp_path / "with")
    assert read_metadata(path)["mtp_layers"] == 1
    _, plain = restore_params(path)
    assert_same(plain, params)
    _, cast = restore_params(path, dtype=jnp.bfloat16)
    assert "mtp" not in cast and cast["embed"].dtype == jnp.bfloat16
    _, full = restore_params(path, mtp=True)
    assert_same(full, {**params, "mtp": mtp})
    _, full = restore_params(path, jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                             jnp.bfloat16, mtp=True)  # fmt: skip
    assert full["mtp"][0]["e_proj"].dtype == jnp.bfloat16
    assert read_metadata(saved)["mtp_layers"] == 0
    with pytest.raises(CheckpointError, match="no MTP block"):
        restore_params(saved, mtp=True)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2+ devices (see the subprocess test)")
def test_restore_shards_experts_across_devices(saved: Path, params: Params) -> None:
    n = max(d for d in (2, 4) if d <= len(jax.devices()))
    mesh = Mesh(np.array(jax.devices()[:n]), ("expert",))
    _, got = restore_params(saved, shardings=expert_shardings(params, mesh))
    w1 = got["layers"][2]["ffn"]["w1"]
    assert {s.data.shape[0] for s in w1.addressable_shards} == {w1.shape[0] // n}
    assert_same(got, params)


_SUBPROCESS = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ds4jax.weights.checkpoint import restore_params, save_params
from ds4jax.model.params import path_name
from tests.model.tiny_model import random_params, tiny_config

assert len(jax.devices()) == 8, jax.devices()
cfg = tiny_config()
params = jax.tree.map(jnp.asarray, random_params(cfg, seed=2))
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("expert", "tp"))

def spec(path, leaf):
    name = path_name(path)
    if name.endswith(("ffn.w1", "ffn.w3")):
        return NamedSharding(mesh, P("expert", "tp"))
    if name.endswith("ffn.w2"):
        return NamedSharding(mesh, P("expert", None, "tp"))
    return NamedSharding(mesh, P())

shardings = jax.tree_util.tree_map_with_path(spec, params)
# (saving a sharded tree works too, but Orbax's first sharded save costs ~7 s here)
save_params(params, cfg, sys.argv[1] + "/ckpt")
_, got = restore_params(sys.argv[1] + "/ckpt", shardings=shardings)
for (path, x), y, s in zip(jax.tree_util.tree_leaves_with_path(got),
                           jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert x.sharding == s, path_name(path)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
w2 = got["layers"][1]["ffn"]["w2"]
assert {sh.data.shape for sh in w2.addressable_shards} == {(1, 256, 64)}
assert len(w2.sharding.device_set) == 8
print("OK")
"""


def test_restore_reshards_over_8_forced_host_devices(tmp_path: Path) -> None:
    env = forced_devices_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_overwrite_is_refused_without_force(
    saved: Path, params: Params, cfg: Config, tmp_path: Path
) -> None:
    with pytest.raises(FileExistsError, match="force"):
        save_params(params, cfg, saved)
    again = save_params(params, cfg, tmp_path / "again")
    save_params(
        jax.tree.map(lambda x: x * 0 if x.dtype != jnp.int32 else x, params), cfg, again, force=True
    )
    _, got = restore_params(again)
    assert float(jnp.abs(got["embed"]).max()) == 0.0
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a ds4jax params checkpoint"):
        save_params(params, cfg, unrelated, force=True)
    assert (unrelated / "notes.txt").read_text() == "keep me"


# ------------------------------------------------ convert


def write_hf_layout(params: Params, cfg: Config, directory: Path) -> Path:
    """What transformers' `save_pretrained` writes: float32 tensors, official names under a
    `model.` prefix (alternate spellings where names.py lists them), two shards + index,
    and a config.json without quantization_config."""
    directory.mkdir(parents=True)
    tensors: dict[str, np.ndarray] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        p = path_name(path)
        rest = p.split(".", 2)[-1] if p.startswith("layers.") else p
        if rest in names.EXPERT_LEAVES:
            for e in range(cfg.num_experts):
                tensors[names.expert_candidates(p, e)[1]] = np.asarray(x[e])
        else:
            tensors[names.candidates(p)[-1 if p.startswith("layers.") else 1]] = np.asarray(x)
    keys = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for fname, ks in halves.items():
        save_file({k: tensors[k] for k in ks}, str(directory / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(ks, fname)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = release_config(cfg)
    del config["quantization_config"], config["expert_dtype"]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_convert_from_transformers_layout(params: Params, cfg: Config, tmp_path: Path) -> None:
    src = write_hf_layout(params, cfg, tmp_path / "hf")
    assert detect_layout(src) == "hf"
    assert (
        "model.layers.0.attn.norm.weight"
        in json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    )
    dst = convert(src, tmp_path / "out", dtype=jnp.float32)
    assert dst == (tmp_path / "out").absolute()
    got_cfg, got = restore_params(dst)
    assert got_cfg == cfg
    assert_same(got, params)
    assert_same(got, load_hf_checkpoint(src)[1])


def test_convert_from_official_release(params: Params, cfg: Config, tmp_path: Path) -> None:
    src = write_official_checkpoint(params, cfg, tmp_path / "release", shard_bytes=500_000)
    assert detect_layout(src) == "official"
    dst = convert(src, tmp_path / "out")
    got_cfg, got = restore_params(dst)
    assert got_cfg == cfg.replace(quant_sim=True)  # a release defaults to its own graph
    assert got["layers"][0]["attn"]["wq_a"].dtype == jnp.bfloat16
    assert_same(got, load_official_checkpoint(src)[1])


def test_convert_from_params_checkpoint(saved: Path, params: Params, tmp_path: Path) -> None:
    assert detect_layout(saved) == "orbax"
    dst = convert(saved, tmp_path / "copy", dtype=jnp.float32)
    assert_same(restore_params(dst)[1], params)
    with pytest.raises(FileExistsError):
        convert(saved, dst)
    convert(saved, dst, dtype=jnp.bfloat16, force=True)
    assert restore_params(dst)[1]["embed"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="outside the source"):
        convert(saved, saved / "inner")


def test_unrecognized_source_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        convert(tmp_path, tmp_path.parent / "never")
    assert not (tmp_path.parent / "never").exists()
