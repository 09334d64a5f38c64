"""A Hugging Face Hub cache written by hand, so that tests resolve `--model org/name` with no
network: the layout an online `snapshot_download` leaves behind.

    models--org--name/blobs/<sha1>                  the file's bytes
    models--org--name/refs/<ref>                    the commit (no trailing newline)
    models--org--name/snapshots/<commit>/<path>     a relative symlink into blobs/
    models--org--name/trees/<commit>.json           the commit's tree listing: every file the
                                                    repo holds, fetched or not

The tree listing is what lets an offline `snapshot_download` tell a complete snapshot from a
partial one: a listed file its patterns ask for and the snapshot lacks is an
`IncompleteSnapshotError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ds4jax.weights.official import write_official_checkpoint
from tests.model.tiny_model import random_params, tiny_config

ROOT = Path(__file__).resolve().parents[1]
#: the trained demo's SentencePiece vocabulary: a tokenizer the tiny release can be served with
DEMO_TOKENIZER = ROOT / "configs" / "demo" / "demo.model"


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_cached_repo(
    cache: Path,
    repo_id: str,
    files: Mapping[str, Path],
    *,
    ref: str = "main",
    not_fetched: Iterable[str] = (),
) -> str:
    """Put `files` (path in the repo → a local file) into `cache` as a download of `repo_id`
    at `ref`; `not_fetched`: more files the repo holds (in its tree listing) that were not
    downloaded. Returns the commit hash."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    blobs = {path: Path(src).read_bytes() for path, src in files.items()}
    commit = hashlib.sha1(
        json.dumps({p: git_sha1(b) for p, b in blobs.items()}, sort_keys=True).encode()
    ).hexdigest()
    snapshot = repo / "snapshots" / commit
    listing: dict[str, dict[str, object]] = {}
    for path, data in blobs.items():
        sha = git_sha1(data)
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / sha).write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / sha, link.parent))
        listing[path] = {"size": len(data), "blob_id": sha}
    for path in not_fetched:
        listing[path] = {"size": 1, "blob_id": git_sha1(path.encode())}
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    (repo / "trees").mkdir(exist_ok=True)
    tree = {"format_version": 1, "files": listing}
    (repo / "trees" / f"{commit}.json").write_text(json.dumps(tree))
    return commit


#: in the repo, not named by its index: an earlier export's shard, the release's reference code
STALE_SHARD = "stale-00001-of-00001.safetensors"
NOT_FETCHED = (STALE_SHARD, "inference/model.py")


def write_release(directory: Path, vocab_size: int = 1024) -> Path:
    """A tiny random model in the official layout (several shards and their index), with the
    demo's SentencePiece tokenizer and the small files a release ships beside its weights."""
    cfg = tiny_config(vocab_size=vocab_size)
    write_official_checkpoint(random_params(cfg, seed=4), cfg, directory, shard_bytes=300_000)
    (directory / "demo.model").write_bytes(DEMO_TOKENIZER.read_bytes())
    (directory / "generation_config.json").write_text('{"do_sample": false}')
    (directory / "encoding").mkdir()
    (directory / "encoding" / "encoding_dsv4.py").write_text("# the release's prompt encoder\n")
    return directory


def cache_release(cache: Path, repo_id: str, release: Path, ref: str = "main") -> str:
    """`release` as an online `ds4jax --model repo_id --revision ref` would have cached it:
    every file of the directory, and `NOT_FETCHED` listed by the repo but absent. Returns the
    commit."""
    files = {str(p.relative_to(release)): p for p in sorted(release.rglob("*")) if p.is_file()}
    assert len([f for f in files if f.endswith(".safetensors")]) > 1, "want several shards"
    return write_cached_repo(cache, repo_id, files, ref=ref, not_fetched=NOT_FETCHED)
