"""`--model org/name` and `plan --config org/name` through a Hugging Face cache, offline: the
cache is written by hand (`tests.fake_hub`) around a tiny official-layout release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError
from huggingface_hub.utils import filter_repo_objects

from ds4jax import cli
from ds4jax.chat.tokenizer import load_tokenizer
from ds4jax.config import load_config
from ds4jax.weights import hub
from ds4jax.weights.checkpoint import load_model, resolve_model_dir
from ds4jax.weights.official import read_weight_map, release_config
from tests.fake_hub import (
    NOT_FETCHED,
    STALE_SHARD,
    cache_release,
    write_cached_repo,
    write_release,
)
from tests.model.tiny_model import assert_same, tiny_config

REPO_ID = "tiny-org/tiny-v4"
#: revision v1 of the repo: a smaller model's config.json alone (all `plan` reads)
V1_CONFIG = tiny_config(num_layers=2, compress_ratios=(0, 4), hash_layers=(True, False))
PLAN = ["plan", "--devices", "2", "--hbm-gb", "1", "--ctx", "1024", "--json"]


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_release(tmp_path_factory.mktemp("release") / "tiny-v4")


@pytest.fixture(scope="module")
def v1_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v1") / "config.json"
    path.write_text(json.dumps(release_config(V1_CONFIG)))
    return path


@pytest.fixture(scope="module")
def cache(release: Path, v1_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    cache_release(cache, REPO_ID, release)
    write_cached_repo(cache, REPO_ID, {"config.json": v1_config}, ref="v1")
    return cache


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `HF_HUB_OFFLINE=1` sets when huggingface_hub is imported."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def snapshot_of(cache: Path, ref: str) -> Path:
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    return repo / "snapshots" / (repo / "refs" / ref).read_text()


# ---------------------------------------------------------------------- what is fetched


def test_the_patterns_fetch_what_the_loaders_read_and_no_unnamed_shard(release: Path) -> None:
    shards = {p.name for p in release.glob("*.safetensors")}
    assert len(shards) > 1
    assert hub.weight_patterns(read_weight_map(release)) == sorted(shards)
    release_files = {str(p.relative_to(release)) for p in release.rglob("*") if p.is_file()}
    repo_files = release_files | set(NOT_FETCHED)
    patterns = [*hub.META_PATTERNS, *hub.weight_patterns(read_weight_map(release))]
    # matched as snapshot_download matches them
    assert set(filter_repo_objects(repo_files, allow_patterns=patterns)) == release_files
    assert {"demo.model", "encoding/encoding_dsv4.py", "generation_config.json"} <= release_files


def test_without_an_index_the_patterns_name_the_single_file_or_the_orbax_items() -> None:
    assert hub.weight_patterns(None) == ["model.safetensors"]
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo"
    files = {str(p.relative_to(demo)) for p in demo.rglob("*") if p.is_file()}
    patterns = [*hub.META_PATTERNS, *hub.weight_patterns(None, orbax=True)]
    fetched = set(filter_repo_objects(files, allow_patterns=patterns))
    assert hub.ORBAX_MARKER in fetched and "demo.model" in fetched
    assert {f for f in files if f.startswith(("meta/", "params/"))} <= fetched
    assert files - fetched == {"commit_success.txt", "demo.vocab", "training.json"}


@pytest.mark.parametrize(
    ("value", "repo"),
    [("deepseek-ai/DeepSeek-V4-Flash", True), ("org/name.v2", True), ("demo", False),
     ("./ckpt", False), ("/data/ckpt", False), ("a/b/c", False), ("org/", False),
     ("org/../x", False), ("org--x/y", False)],
)  # fmt: skip
def test_only_the_hub_s_repo_id_shape_is_looked_up_on_the_hub(value: str, repo: bool) -> None:
    assert hub.is_repo_id(value) is repo


# ---------------------------------------------------------------------- resolving, offline


@pytest.mark.usefixtures("offline")
def test_a_repo_id_loads_the_model_its_directory_holds(cache: Path, release: Path) -> None:
    cfg, params, tokenizer, what = load_model(
        REPO_ID, download_dir=str(cache), load_tokenizer=load_tokenizer
    )
    ref_cfg, ref_params, ref_tokenizer, _ = load_model(release, load_tokenizer=load_tokenizer)
    assert what == f"model {REPO_ID}"
    assert cfg == ref_cfg
    assert_same(params, ref_params)
    assert type(tokenizer).__name__ == "SpmTokenizer"  # the repo's own demo.model
    assert tokenizer.encode_text("a b c") == ref_tokenizer.encode_text("a b c")


@pytest.mark.usefixtures("offline")
def test_a_shard_the_index_does_not_name_is_not_required(cache: Path) -> None:
    main = snapshot_of(cache, "main")
    assert resolve_model_dir(REPO_ID, download_dir=cache) == main
    assert not (main / STALE_SHARD).exists()
    # the cached tree listing is read: the whole repo would be missing the stale shard
    with pytest.raises(IncompleteSnapshotError, match=STALE_SHARD):
        snapshot_download(REPO_ID, cache_dir=cache, local_files_only=True)


@pytest.mark.usefixtures("offline")
def test_a_revision_resolves_a_named_ref_or_a_commit(cache: Path) -> None:
    main, v1 = snapshot_of(cache, "main"), snapshot_of(cache, "v1")
    assert main != v1
    assert hub.snapshot(REPO_ID, "v1", cache) == v1
    assert resolve_model_dir(REPO_ID, main.name, cache) == main
    with pytest.raises(hub.HubError) as err:
        hub.snapshot(REPO_ID, "v2", cache)
    message = str(err.value)
    assert "\n" not in message
    assert f"{REPO_ID} (revision v2)" in message and str(cache) in message


@pytest.mark.usefixtures("offline")
def test_plan_reads_the_config_json_of_a_repo_and_revision(
    cache: Path, release: Path, v1_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def plans(*config: str) -> list[dict[str, object]]:
        cli.main([*PLAN, "--config", *config])
        return json.loads(capsys.readouterr().out)["plans"]

    at_main = plans(REPO_ID, "--download-dir", str(cache))
    assert at_main == plans(str(release / "config.json"))
    at_v1 = plans(REPO_ID, "--download-dir", str(cache), "--revision", "v1")
    assert at_v1 == plans(str(v1_config)) and at_v1 != at_main
    assert load_config(hub.config_file(REPO_ID, "v1", cache)) == V1_CONFIG.replace(quant_sim=True)


# ---------------------------------------------------------------------- a repo not cached


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize(
    "argv",
    [["dump-logits", "--prompt", "x", "--out", "x.npy"], ["generate", "-p", "x"],
     ["convert", "org/missing", "out"]],
    ids=lambda argv: argv[0],
)  # fmt: skip
def test_every_model_command_passes_revision_and_download_dir(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = [] if argv[0] == "convert" else ["--model", "org/missing"]
    flags = ["--revision", "r1", "--download-dir", str(tmp_path)]
    assert cli.main([*argv, *model, *flags]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"ds4jax {argv[0]}: org/missing (revision r1) is not in the Hugging Face cache "
        f"{tmp_path} and HF_HUB_OFFLINE is set: fetch it once online, or point HF_HUB_CACHE "
        "or --download-dir at a cache that holds it\n"
    )


def ds4jax(*args: str, env: dict[str, str | None]) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess with `env` over this one's (None: unset), as huggingface_hub
    reads its variables when it is imported."""
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "ds4jax", *args], capture_output=True,
                          text=True, timeout=120, env=full)  # fmt: skip


def assert_one_line_error(out: subprocess.CompletedProcess[str], command: str, cache: Path) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"ds4jax {command}: org/missing is not in the Hugging Face cache")
    assert f"cache {cache} and HF_HUB_OFFLINE is set" in lines[0]


def test_serve_offline_without_the_repo_is_one_line_and_exit_2(tmp_path: Path) -> None:
    home = tmp_path / "hf-home"  # the cache is $HF_HOME/hub when HF_HUB_CACHE is unset
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": None, "HF_HUB_OFFLINE": "1"}
    out = ds4jax("serve", "--model", "org/missing", env=env)
    assert_one_line_error(out, "serve", home / "hub")


def test_plan_offline_without_the_repo_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env: dict[str, str | None] = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = ds4jax("plan", "--config", "org/missing", "--devices", "1", "--hbm-gb", "1", env=env)
    assert_one_line_error(out, "plan", tmp_path)


def test_an_unreachable_hub_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(hub.HubError) as err:
        hub.snapshot("org/missing", download_dir=tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        f"org/missing: could not fetch it from the Hugging Face Hub into {tmp_path}"
    )
