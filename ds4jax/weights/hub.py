"""`--model org/name`: a checkpoint from the Hugging Face Hub, read through its local cache.

vLLM and SGLang take a Hub repo id wherever they take a checkpoint directory, and resolve it
with `huggingface_hub.snapshot_download(repo, revision, cache_dir, allow_patterns,
local_files_only=HF_HUB_OFFLINE)`. Doing the same means a release one of them (or
`hf download`) already fetched is served from the same cache without a second copy of its
hundreds of GB, and `HF_HOME`, `HF_HUB_CACHE` and `HF_HUB_OFFLINE` mean here what they mean
there. The cache is huggingface_hub's: `--download-dir` is its `cache_dir`, and its progress
bars are left on, since a first fetch of a release takes a long while.

A release repo holds more than the loaders read (`inference/*`, the encoder's tests), and a
repo may keep files its index no longer names; so the small files every loader may read come
first (`META_PATTERNS`), then only the weight files the index's `weight_map` names
(`weight_patterns`): a shard the index does not name is never downloaded.

Offline (`HF_HUB_OFFLINE=1`, read once, when huggingface_hub is imported) nothing asks the
network: `snapshot_download` returns the cached snapshot as it is (it checks the patterns only
against a tree listing cached by an earlier online fetch), and a repo that is not cached, like
any other failure to fetch it, is a `HubError`: one line naming the repo and the cache that was
searched, which the CLI prints and exits 2 on. A traceback would bury that line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

INDEX = "model.safetensors.index.json"
#: Orbax writes it at the root of a params checkpoint (`checkpoint.save_params`)
ORBAX_MARKER = "_CHECKPOINT_METADATA"
#: What the loaders read besides the weights: configs (`config.load_config`), tokenizers
#: (`chat.tokenizer.load_tokenizer`: tokenizer.json or a SentencePiece `*.model`), the
#: release's prompt encoder, the index and the Orbax marker that say which weights to fetch.
META_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "*.model",
    "encoding/*",
    INDEX,
    ORBAX_MARKER,
)


class HubError(ValueError):
    """A repo id that could not be fetched or found in the cache; the message is one line."""


def is_repo_id(value: str) -> bool:
    """`org/name` as the Hub spells repo ids: one slash, its character rules. A `--model` that
    is neither a directory nor a named model is looked up on the Hub only when it has this
    shape, so a mistyped path (`./ckpt`, `/data/x/y`) still reads as a missing directory."""
    if value.count("/") != 1:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def weight_patterns(weight_map: Mapping[str, str] | None, orbax: bool = False) -> list[str]:
    """The weight files to fetch: the shards the index names; with no index, an Orbax params
    checkpoint's two items, else the single `model.safetensors`."""
    if weight_map is not None:
        return sorted(set(weight_map.values()))
    if orbax:
        return ["meta/*", "params/*"]
    return ["model.safetensors"]


def cache_dir(download_dir: str | Path | None = None) -> Path:
    """The cache a fetch reads and fills: `download_dir`, else huggingface_hub's
    (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`)."""
    return Path(download_dir or constants.HF_HUB_CACHE).expanduser().absolute()


def snapshot(
    repo_id: str, revision: str | None = None, download_dir: str | Path | None = None
) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default: main), holding what the
    loaders read and no weight file the checkpoint does not name."""
    from ds4jax.weights.official import read_weight_map

    fetch = _fetcher(snapshot_download, repo_id, revision, download_dir)
    folder = fetch(allow_patterns=list(META_PATTERNS))
    orbax = (folder / ORBAX_MARKER).is_file()
    return fetch(allow_patterns=weight_patterns(read_weight_map(folder), orbax))


def config_file(
    repo_id: str, revision: str | None = None, download_dir: str | Path | None = None
) -> Path:
    """`config.json` of `repo_id` alone (`ds4jax plan` needs no weights)."""
    return _fetcher(hf_hub_download, repo_id, revision, download_dir)(filename="config.json")


def _fetcher(
    download: Callable[..., str],
    repo_id: str,
    revision: str | None,
    download_dir: str | Path | None,
) -> Callable[..., Path]:
    """`download(repo_id, ...)` with the revision, cache and offline switch applied, each
    failure a `HubError`. The switch is the library's constant, read at each call, so that
    patching `constants.HF_HUB_OFFLINE` switches it too."""

    def fetch(**kw: object) -> Path:
        offline = constants.HF_HUB_OFFLINE
        try:
            return Path(
                download(repo_id, revision=revision, cache_dir=download_dir,
                         local_files_only=offline, **kw)
            )  # fmt: skip
        except (OSError, EntryNotFoundError, ValueError) as err:
            raise HubError(_message(repo_id, revision, download_dir, offline, err)) from None

    return fetch


def _message(
    repo_id: str,
    revision: str | None,
    download_dir: str | Path | None,
    offline: bool,
    err: Exception,
) -> str:
    what = repo_id if revision is None else f"{repo_id} (revision {revision})"
    cache = cache_dir(download_dir)
    if offline and type(err) is LocalEntryNotFoundError:  # not cached (not merely incomplete)
        return (
            f"{what} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: fetch "
            "it once online, or point HF_HUB_CACHE or --download-dir at a cache that holds it"
        )
    detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return f"{what}: could not fetch it from the Hugging Face Hub into {cache}: {detail}"
