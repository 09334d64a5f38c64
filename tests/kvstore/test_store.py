"""The disk store on real Orbax files, with states built directly (no model): what it keeps,
what it finds, and that nothing partial, corrupt, foreign or oversized is ever served."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path

import jax
import numpy as np
import pytest

from ds4jax.chat import specials
from ds4jax.chat.segments import Segment, join, normalize
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.kvstore import disk
from ds4jax.kvstore.checkpoint import KVStoreError, sha1_hex
from ds4jax.kvstore.disk import DiskStore
from ds4jax.kvstore.fingerprint import model_fingerprint
from ds4jax.kvstore.tool_entries import tool_entries_in
from ds4jax.model.state import init_state
from tests.kvstore.conftest import (
    ASSISTANT_ID,
    MAX_LEN,
    USER_ID,
    convo,
    fake_state,
    make_store,
    states_equal,
    tokens_for,
)

SYSTEM = "You are a careful coding agent. " * 20


def save(store: DiskStore, segments, n: int, seed: int = 0, reason: str = "evict", memory=None):
    state = fake_state(store.cfg, n, seed)
    store.save(tokens_for(n, seed), segments, state, reason, memory)
    return state


def payload_files(directory: Path) -> list[Path]:
    files = [p for p in directory.rglob("*") if p.is_file() and "/state/" in str(p)]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def test_a_saved_state_loads_back_bit_identical_after_a_restart(tmp_path, cfg) -> None:
    store = make_store(tmp_path / "kv", cfg)
    state = save(store, convo(SYSTEM, "hello"), 100)
    hit = make_store(tmp_path / "kv", cfg).lookup(convo(SYSTEM, "hello", "hi!", "more"))
    assert hit is not None and hit.tokens == tokens_for(100)
    assert hit.segments == convo(SYSTEM, "hello")
    loaded = hit.load()
    assert states_equal(loaded, state)
    # live rows only on disk, yet the full capacity of init_state(cfg, max_len) on load
    assert jax.tree.map(lambda x: x.shape, loaded) == jax.tree.map(
        lambda x: x.shape, init_state(cfg, MAX_LEN)
    )
    # a larger context loads the same checkpoint, with its own capacity
    bigger = make_store(tmp_path / "kv", cfg, max_len=2 * MAX_LEN).lookup(convo(SYSTEM, "hello"))
    wide = bigger.load()
    assert wide.layers[2].comp.shape[0] == init_state(cfg, 2 * MAX_LEN).layers[2].comp.shape[0]
    assert np.array_equal(
        np.asarray(wide.layers[2].comp[:25]), np.asarray(state.layers[2].comp[:25])
    )


def test_layout_is_one_directory_per_checkpoint_named_by_the_text_sha1(tmp_path, cfg) -> None:
    root = tmp_path / "deep" / "kv"
    store = make_store(root, cfg)
    segments = convo(SYSTEM, "hello")
    save(store, segments, 100, reason="shutdown")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(root.parent.stat().st_mode) == 0o700
    key = sha1_hex(join(segments).encode())
    assert sorted(p.name for p in root.iterdir()) == [key]
    assert sorted(p.name for p in (root / key).iterdir()) == ["meta.json", "state", "usage.json"]
    meta = json.loads((root / key / "meta.json").read_text())
    assert meta["reason"] == "shutdown" and meta["key"] == "token-text"
    assert meta["n_tokens"] == 100 and meta["fingerprint"] == "model-a"
    assert normalize(Segment(t, s) for t, s in meta["segments"]) == segments
    # live rows only: 100 tokens of a ratio-4 layer are 25 compressed rows
    assert meta["arrays"]["l2_comp"]["shape"] == [25, cfg.head_dim]
    assert store.checkpoints()[0]["reason"] == "shutdown"


def test_lookup_takes_the_longest_text_prefix(tmp_path, cfg) -> None:
    store = make_store(tmp_path, cfg)
    short, long_ = convo(SYSTEM), convo(SYSTEM, "hello")
    save(store, short, 40, seed=1)
    save(store, long_, 60, seed=2)
    assert store.lookup(convo(SYSTEM, "hello", "x")).tokens == tokens_for(60, 2)
    assert store.lookup(long_).tokens == tokens_for(60, 2)  # an exact match is a hit
    assert store.lookup(convo(SYSTEM, "hellO")).tokens == tokens_for(40, 1)  # last byte differs
    assert store.lookup(convo("Another system prompt")) is None


def test_a_typed_special_string_is_not_the_special_token(tmp_path, cfg) -> None:
    store = make_store(tmp_path, cfg)
    save(store, convo(SYSTEM, "hello"), 50)
    typed = normalize([Segment(specials.BOS, True), Segment(SYSTEM + specials.USER + "hello")])
    assert join(typed) == join(convo(SYSTEM, "hello"))  # same bytes, same sha1
    assert store.lookup(typed) is None


def test_a_checkpoint_must_fit_the_context_and_the_minimum(tmp_path, cfg) -> None:
    save(make_store(tmp_path, cfg), convo(SYSTEM, "hello"), 200)
    assert make_store(tmp_path, cfg, max_len=200).lookup(convo(SYSTEM, "hello")) is None
    assert make_store(tmp_path, cfg, max_len=256).lookup(convo(SYSTEM, "hello")) is not None
    assert make_store(tmp_path, cfg, min_tokens=201).lookup(convo(SYSTEM, "hello")) is None


def test_saves_that_would_roll_back_or_are_too_short_are_skipped(tmp_path, cfg, caplog) -> None:
    store = make_store(tmp_path, cfg, min_tokens=64)
    with caplog.at_level(logging.INFO, logger="ds4jax.kvstore"):
        save(store, convo(SYSTEM), 32)
        store.save(tokens_for(80), convo(SYSTEM), fake_state(cfg, 90), "evict", None)
    assert store.checkpoints() == []
    assert "because live checkpoint is at 90" in caplog.text
    off = make_store(tmp_path, cfg, evict=False, shutdown=False, continued_every=0, cold=False)
    for reason in ("evict", "shutdown", "continued", "cold"):
        save(off, convo(SYSTEM, reason), 100, reason=reason)
    assert off.checkpoints() == [] and off.continued_every == 0
    assert off.cold_cut(tokens_for(100), convo(SYSTEM)) is None


def test_cold_cut_stops_before_the_user_turn_or_at_an_aligned_length(tmp_path, cfg) -> None:
    store = make_store(tmp_path, cfg, min_tokens=8, cold_max_tokens=400, boundary_align=64)
    prompt = [0, *range(10, 30), USER_ID, 5, 6, ASSISTANT_ID, 7]
    assert store.cold_cut(tuple(prompt), ()) == 21  # right before <｜User｜>
    multi = [*prompt, USER_ID, *range(100, 400)]
    assert store.cold_cut(tuple(multi), ()) == 21  # later user turns do not move it
    no_turns = tuple(range(10, 210))
    assert store.cold_cut(no_turns, ()) == 128  # (200 - 32) aligned down to 64
    assert store.cold_cut(tuple(range(10, 60)), ()) == 50  # too short to align: all of it
    assert store.cold_cut(tuple(range(10, 500)), ()) is None  # above cold_max_tokens
    assert store.cold_cut(tuple(range(4)), ()) is None  # below min_tokens


def test_the_same_text_is_kept_once_and_its_tool_entries_merged(tmp_path, cfg) -> None:
    store = make_store(tmp_path, cfg)
    block = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">x</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>"
    )
    segments = convo(SYSTEM, "hello", "ok" + block)
    save(store, segments, 100)
    first = store.checkpoints()
    save(store, segments, 100, memory={"toolu_1": block})
    assert [c["key"] for c in store.checkpoints()] == [first[0]["key"]]
    assert store.lookup(segments).tool_entries == {"toolu_1": block}
    # another state for the same text (other tokens): replaced
    save(store, segments, 120, seed=5)
    assert store.lookup(segments).tokens == tokens_for(120, 5)


def test_tool_entries_are_those_whose_dsml_is_in_the_text(tmp_path, cfg) -> None:
    def block(cmd: str) -> str:
        return (
            f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="c" '
            f'string="true">{cmd}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
        )

    memory = ToolMemory()
    memory.remember(["toolu_a", "toolu_b"], block("ls"))  # one turn, two calls
    memory.remember(["toolu_c"], block("pwd"))
    text = "reasoning</think>" + block("ls") + specials.EOS + "more"
    assert tool_entries_in(text, memory) == {"toolu_a": block("ls"), "toolu_b": block("ls")}
    assert tool_entries_in("no tools here", memory) == {}

    store = make_store(tmp_path, cfg)
    seg_ls = convo(SYSTEM, "run ls", "ok" + block("ls"))
    seg_pwd = convo(SYSTEM, "run pwd", "ok" + block("pwd"))
    save(store, seg_ls, 100, seed=1, memory=memory)
    save(store, seg_pwd, 100, seed=2, memory=memory)
    hit = store.lookup(seg_ls)
    assert hit.tool_entries == {"toolu_a": block("ls"), "toolu_b": block("ls")}
    # after a restart, every entry of the directory, for the server to remember at startup
    restored = ToolMemory()
    for tid, b in make_store(tmp_path, cfg).tool_entries().items():
        restored.remember([tid], b)
    assert restored.block_for(["toolu_a", "toolu_b"]) == block("ls")
    assert restored.block_for(["toolu_c"]) == block("pwd")
    assert make_store(tmp_path, cfg, fingerprint="model-b").tool_entries() == {}


def test_another_models_checkpoint_is_never_served(tmp_path, cfg) -> None:
    save(make_store(tmp_path, cfg, fingerprint="model-a"), convo(SYSTEM, "hello"), 100)
    other = make_store(tmp_path, cfg, fingerprint="model-b")
    assert other.lookup(convo(SYSTEM, "hello")) is None
    assert len(other.checkpoints()) == 1  # kept, not deleted
    assert make_store(tmp_path, cfg, fingerprint="model-a").lookup(convo(SYSTEM, "hello"))


def test_model_fingerprint_changes_with_config_params_and_tokenizer(cfg, tmp_path) -> None:
    params = {"a": np.arange(600, dtype=np.float32).reshape(2, 300), "b": np.ones(3, np.int32)}

    class Tok:
        vocab_size = 1024
        path = None

    base = model_fingerprint(cfg, params, Tok())
    assert base == model_fingerprint(cfg, dict(params), Tok())
    assert base != model_fingerprint(cfg.replace(quant_sim=False), params, Tok())
    assert base != model_fingerprint(cfg, {**params, "a": params["a"] + 1}, Tok())
    assert base != model_fingerprint(cfg, {**params, "b": np.ones(4, np.int32)}, Tok())
    tok_file = tmp_path / "tokenizer.json"
    tok_file.write_text("{}")
    other = Tok()
    other.path = tok_file
    assert base != model_fingerprint(cfg, params, other)


def test_broken_metadata_and_foreign_entries_are_ignored_not_served(tmp_path, cfg, caplog) -> None:
    store = make_store(tmp_path, cfg)
    names = []
    for i, turn in enumerate(("a", "b", "c")):
        save(store, convo(SYSTEM, turn), 100, seed=i)
        names.append(sha1_hex(join(convo(SYSTEM, turn)).encode()))
    meta_a = tmp_path / names[0] / "meta.json"
    meta_a.write_bytes(meta_a.read_bytes()[:200])  # truncated
    meta_b = tmp_path / names[1] / "meta.json"
    raw = bytearray(meta_b.read_bytes())
    i = raw.index(b'"n_tokens": 100') + len(b'"n_tokens": ')
    raw[i] = ord("9")  # still valid JSON, wrong content
    meta_b.write_bytes(bytes(raw))
    (tmp_path / ("f" * 40)).mkdir()  # a directory that is no checkpoint
    (tmp_path / ("e" * 40)).write_text("a file with a checkpoint's name")
    (tmp_path / "notes.txt").write_text("anything else")
    with caplog.at_level(logging.WARNING, logger="ds4jax.kvstore"):
        fresh = make_store(tmp_path, cfg)
        assert fresh.lookup(convo(SYSTEM, "a")) is None
        assert fresh.lookup(convo(SYSTEM, "b")) is None
        assert fresh.lookup(convo(SYSTEM, "c")).tokens == tokens_for(100, 2)
    assert "unreadable meta.json" in caplog.text
    assert "metadata checksum mismatch" in caplog.text
    assert f"{'f' * 40}: " in caplog.text
    assert [c["key"] for c in fresh.checkpoints()] == [names[2]]  # the rest is not counted
    assert (tmp_path / "notes.txt").exists() and (tmp_path / names[0]).exists()


def test_a_damaged_checkpoint_is_replaced_by_the_next_save_of_its_text(tmp_path, cfg) -> None:
    """A checkpoint whose metadata no longer reads is ignored at startup; the next save of
    the same text replaces it (before: the save's rename failed on it every time, so that
    conversation could never be saved again)."""
    save(make_store(tmp_path, cfg), convo(SYSTEM, "hello"), 100, seed=1)
    key = sha1_hex(join(convo(SYSTEM, "hello")).encode())
    (tmp_path / key / "meta.json").write_text("{junk")
    (tmp_path / ("f" * 40)).mkdir()  # no checkpoint of any text saved here: left alone
    fresh = make_store(tmp_path, cfg)
    assert fresh.lookup(convo(SYSTEM, "hello")) is None
    save(fresh, convo(SYSTEM, "hello"), 100, seed=2)
    assert fresh.lookup(convo(SYSTEM, "hello")).tokens == tokens_for(100, 2)
    assert make_store(tmp_path, cfg).lookup(convo(SYSTEM, "hello")).tokens == tokens_for(100, 2)
    assert (tmp_path / ("f" * 40)).is_dir()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_payload_raises_from_load_and_is_not_offered_again(
    tmp_path, cfg, caplog, damage
) -> None:
    store = make_store(tmp_path, cfg)
    save(store, convo(SYSTEM), 40, seed=1)
    save(store, convo(SYSTEM, "hello"), 100, seed=2)
    key = sha1_hex(join(convo(SYSTEM, "hello")).encode())
    target = payload_files(tmp_path / key)[0]  # the largest data file
    data = bytearray(target.read_bytes())
    if damage == "flip":
        for i in range(len(data) // 3, len(data) // 3 + 64):
            data[i] ^= 0x5A
        target.write_bytes(bytes(data))
    else:
        target.write_bytes(bytes(data[: len(data) // 2]))
    fresh = make_store(tmp_path, cfg)
    hit = fresh.lookup(convo(SYSTEM, "hello"))
    assert hit is not None and hit.key == key  # metadata is fine: only the load can tell
    with caplog.at_level(logging.WARNING, logger="ds4jax.kvstore"), pytest.raises(KVStoreError):
        hit.load()
    assert "kv cache load failed tokens=100" in caplog.text
    # never served again: the shorter checkpoint is what remains
    assert fresh.lookup(convo(SYSTEM, "hello")).tokens == tokens_for(40, 1)


def test_a_tiny_budget_evicts_by_score_but_never_the_new_checkpoint(tmp_path, cfg, caplog) -> None:
    clock = [1_000_000.0]
    opts = {"clock": lambda: clock[0]}
    probe = make_store(tmp_path / "probe", cfg, **opts)
    save(probe, convo(SYSTEM, "probe"), 100)
    size = probe.total_bytes()
    store = make_store(tmp_path / "kv", cfg, budget_mb=2.5 * size / 2**20, **opts)
    save(store, convo(SYSTEM, "a"), 100, seed=1)
    clock[0] += 10
    save(store, convo(SYSTEM, "b"), 100, seed=2)
    clock[0] += 10
    store.lookup(convo(SYSTEM, "a")).load()  # a hit makes "a" worth more than "b"
    clock[0] += 10
    with caplog.at_level(logging.INFO, logger="ds4jax.kvstore"):
        save(store, convo(SYSTEM, "c"), 100, seed=3)
    assert "kv cache evicted reason=disk-cache-full tokens=100 hits=0" in caplog.text
    left = {c["key"] for c in store.checkpoints()}
    assert left == {sha1_hex(join(convo(SYSTEM, t)).encode()) for t in ("a", "c")}
    assert store.total_bytes() <= store.budget_bytes
    # the new checkpoint survives even when it is the least valuable one
    save(store, convo(SYSTEM, "d"), 20, seed=4)  # fewer tokens per byte than any other
    assert sha1_hex(join(convo(SYSTEM, "d")).encode()) in {c["key"] for c in store.checkpoints()}


def test_a_save_larger_than_the_budget_is_skipped(tmp_path, cfg, caplog) -> None:
    store = make_store(tmp_path, cfg, budget_mb=0.01)
    with caplog.at_level(logging.WARNING, logger="ds4jax.kvstore"):
        save(store, convo(SYSTEM, "hello"), 100)
    assert store.checkpoints() == [] and list(tmp_path.iterdir()) == []
    assert "exceeds budget" in caplog.text


@pytest.mark.parametrize("stage", ["payload", "metadata"])
def test_a_full_disk_skips_the_save_with_a_warning(tmp_path, cfg, caplog, monkeypatch, stage):
    def no_space(path, *_args):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    store = make_store(tmp_path, cfg)
    with monkeypatch.context() as m:
        m.setattr(disk, "_write_payload" if stage == "payload" else "_write_json", no_space)
        with caplog.at_level(logging.WARNING, logger="ds4jax.kvstore"):
            save(store, convo(SYSTEM, "hello"), 100)  # no exception
    assert "kv cache store failed (evict) tokens=100" in caplog.text
    assert "No space left on device" in caplog.text
    assert list(tmp_path.iterdir()) == [] and store.checkpoints() == []
    assert (store.failed, store.saved) == (1, 0)  # /metrics' save failures counter
    save(store, convo(SYSTEM, "hello"), 100)  # space again: the next save works
    assert len(store.checkpoints()) == 1 and (store.failed, store.saved) == (1, 1)


def test_a_second_process_cannot_serve_a_directory_one_already_serves(tmp_path, cfg) -> None:
    """Two servers on one --kv-disk-dir saved the same text into each other's temporary
    directories, and one's start-up cleanup cut the other's save in progress: the
    directory is held (flock on it: no file added) by the process that opened it."""
    import subprocess
    import sys

    make_store(tmp_path, cfg)
    script = (
        "import sys; from ds4jax.kvstore.disk import _hold_directory; from pathlib import Path\n"
        "try:\n    _hold_directory(Path(sys.argv[1]))\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.stdout.startswith("KVStoreError"), (out.stdout, out.stderr)
    assert "in use by another ds4jax serve" in out.stdout
    make_store(tmp_path, cfg)  # this process may open it again (a restart in the tests)


def test_startup_removes_leftovers_of_interrupted_saves(tmp_path, cfg) -> None:
    store = make_store(tmp_path, cfg)
    save(store, convo(SYSTEM, "hello"), 100)
    (tmp_path / f".tmp-{'a' * 40}-123-dead").mkdir()
    (tmp_path / f".tmp-{'a' * 40}-123-dead" / "meta.json").write_text("{}")
    make_store(tmp_path, cfg)
    assert [p.name for p in tmp_path.iterdir()] == [sha1_hex(join(convo(SYSTEM, "hello")).encode())]
    assert os.listdir(tmp_path)  # the complete checkpoint stays
