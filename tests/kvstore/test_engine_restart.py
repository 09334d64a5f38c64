"""The disk store under the real engine (tiny config, real V4 tokenizer, random weights): a
clean exit persists the live state, a new process resumes from it with only the suffix
prefilled and the same greedy output, a miss keeps the state it replaces, and a checkpoint
that cannot load means a cold prefill, never a crash."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from ds4jax.chat.tokenizer import V4Tokenizer
from ds4jax.config import load_config
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.continuation.types import CacheSource
from ds4jax.engine import Engine, SamplingParams
from ds4jax.kvstore.disk import DiskStore
from ds4jax.kvstore.fingerprint import model_fingerprint
from ds4jax.model.params import init_params
from tests.continuation.conftest import TOOLS, forced, prepare, tool_call_text

MAX_LEN = 3072
CHUNKS = (16, 64)
GREEDY = SamplingParams(temperature=0)
#: ~2.1k tokens of system prompt: the conversation is past 2k tokens before its first turn
LONG_SYSTEM = " ".join(
    f"Rule {i}: keep the repository tidy, explain each change, run the tests." for i in range(160)
)


@pytest.fixture(scope="module")
def model():
    cfg = load_config("tiny")
    params = init_params(cfg, 0)
    tok = V4Tokenizer()
    return cfg, params, tok, model_fingerprint(cfg, params, tok)


def new_engine(model, directory: Path, pool: dict | None = None, **store_options) -> Engine:
    """A fresh process, as far as the engine and the store go: nothing in RAM. `pool`: the
    engine's session-pool options."""
    cfg, params, tok, fingerprint = model
    store_options.setdefault("cold", False)  # see test_a_cold_prefill_saves_the_shared_prefix
    store = DiskStore(directory, fingerprint, cfg=cfg, max_len=MAX_LEN, tokenizer=tok,
                      **store_options)  # fmt: skip
    return Engine(cfg, params, tok, max_len=MAX_LEN, store=store, tool_memory=ToolMemory(),
                  chunk_sizes=CHUNKS, **(pool or {}))  # fmt: skip


def tool_turn(engine: Engine, system: str, command: str = "ls -la"):
    body = {"system": system, "tools": TOOLS, "messages": [{"role": "user", "content": "list"}]}
    res = engine.run(
        prepare(engine, body, 200), forced_tokens=forced(engine, tool_call_text(command))
    )
    assert res.finish == "tool_use" and len(res.tool_ids) == 1
    return body, res


def with_tool_result(body, res, command: str = "ls -la"):
    tid = res.tool_ids[0]
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I should run it.", "signature": "s"},
            {"type": "tool_use", "id": tid, "name": "bash", "input": {"command": command}},
        ],
    }
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": tid, "content": "a.txt\nb.txt"}],
    }
    return dict(body, messages=[*body["messages"], assistant, result])


def greedy(engine: Engine, body, max_tokens: int = 4):
    req = prepare(engine, body, max_tokens)
    req.sampling = GREEDY
    return req, engine.run(req)


def test_a_restart_resumes_from_the_shutdown_checkpoint(model, tmp_path, caplog) -> None:
    first = new_engine(model, tmp_path)
    body, res = tool_turn(first, LONG_SYSTEM)
    saved_tokens = first.live.tokens
    assert len(saved_tokens) > 2048
    with caplog.at_level(logging.INFO, logger="ds4jax.kvstore"):
        first.shutdown()
    assert f"kv cache stored tokens={len(saved_tokens)} reason=shutdown" in caplog.text
    # the run without a restart: the live tool-output path
    follow = with_tool_result(body, res)
    req_live, live = greedy(first, follow)
    assert live.source == CacheSource.LIVE_TOOL

    second = new_engine(model, tmp_path)
    # server startup: the exact DSML of the replayed tool call comes back from disk
    for tid, block in second.store.tool_entries().items():
        second.tool_memory.remember([tid], block)
    req_disk, resumed = greedy(second, follow)
    assert req_disk.view.tokens == req_live.view.tokens  # rendered with the sampled bytes
    assert resumed.source == CacheSource.DISK
    assert resumed.cached == len(saved_tokens)
    assert resumed.prefilled == live.prefilled < 32  # EOS + the tool result turn only
    assert resumed.output_tokens == live.output_tokens > 0
    assert resumed.raw_text == live.raw_text
    assert second.live.tokens == first.live.tokens
    assert np.array_equal(np.asarray(second.live.state.logits), np.asarray(first.live.state.logits))
    assert second.store.checkpoints()[0]["hits"] == 1


def test_a_miss_keeps_the_state_it_replaces(model, tmp_path) -> None:
    engine = new_engine(model, tmp_path, min_tokens=64)
    body, res = tool_turn(engine, "You are a careful coding agent.")
    kept = engine.live.tokens
    other = {"messages": [{"role": "user", "content": "something else"}]}
    assert engine.run(prepare(engine, other), forced_tokens=[]).source == CacheSource.COLD
    assert [(c["tokens"], c["reason"]) for c in engine.store.checkpoints()] == [
        (len(kept), "evict")
    ]
    req, back = greedy(engine, with_tool_result(body, res))
    assert back.source == CacheSource.DISK and back.cached == len(kept)
    assert back.cached + back.prefilled == len(req.view.tokens)
    cold = engine.logits_for(engine.live.tokens)
    assert np.abs(cold - np.asarray(engine.live.state.logits)).max() <= 1e-5


def test_the_state_budget_saves_what_it_evicts(model, tmp_path) -> None:
    """Two sessions and fork points under a budget of two states: the second conversation
    pushes the first one's fork point out of RAM, onto disk; its retry is a disk hit."""
    probe = new_engine(model, tmp_path / "probe")
    pool = {"sessions": 2, "fork_points": True, "state_budget_bytes": 2 * probe.state_nbytes}
    engine = new_engine(model, tmp_path / "kv", pool=pool, min_tokens=64)
    body, first = tool_turn(engine, "You are a careful coding agent.")
    assert engine.stats()["fork_points"] == 1
    tool_turn(engine, "You are a different agent.")
    st = engine.stats()
    assert st["sessions_in_use"] == 2 and st["state_bytes"] <= 2 * probe.state_nbytes
    assert (first.prompt_tokens, "evict") in [
        (c["tokens"], c["reason"]) for c in engine.store.checkpoints()
    ]
    retry = engine.run(
        prepare(engine, body, 200), forced_tokens=forced(engine, tool_call_text("ls"))
    )
    assert retry.source == CacheSource.DISK and retry.cached == first.prompt_tokens
    assert retry.prefilled == 0


def test_a_checkpoint_that_cannot_load_means_a_cold_prefill(model, tmp_path, caplog) -> None:
    engine = new_engine(model, tmp_path, min_tokens=64)
    body, res = tool_turn(engine, "You are a careful coding agent.")
    engine.shutdown()
    (key,) = [c["key"] for c in engine.store.checkpoints()]
    data = max((tmp_path / key / "state").rglob("*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-100])  # truncated

    restarted = new_engine(model, tmp_path, min_tokens=64)
    for tid, block in restarted.store.tool_entries().items():
        restarted.tool_memory.remember([tid], block)
    with caplog.at_level(logging.WARNING):
        req, res2 = greedy(restarted, with_tool_result(body, res))
    assert res2.source == CacheSource.COLD and res2.prefilled == len(req.view.tokens)
    assert f"kv store: load of {key} failed" in caplog.text
    assert restarted.store.checkpoints() == []  # proven corrupt: deleted


def test_a_cold_prefill_saves_the_shared_prefix(model, tmp_path) -> None:
    engine = new_engine(model, tmp_path, cold=True)
    tool_turn(engine, LONG_SYSTEM)
    (ckpt,) = engine.store.checkpoints()
    assert ckpt["reason"] == "cold"
    # the checkpoint stops right before the first <｜User｜>: system prompt and tools only
    user_id = engine.tokenizer.special_id("<｜User｜>")
    assert engine.live.tokens[ckpt["tokens"]] == user_id
    # another conversation with the same system prompt and tools starts from it
    other = {"system": LONG_SYSTEM, "tools": TOOLS,
             "messages": [{"role": "user", "content": "what is here?"}]}  # fmt: skip
    engine.reset()
    _, res = greedy(engine, other, 1)
    assert res.source == CacheSource.DISK and res.cached == ckpt["tokens"]


def test_a_checkpoint_that_cannot_load_falls_back_to_the_next_longest(model, tmp_path,
                                                                      caplog) -> None:  # fmt: skip
    """Two checkpoints of one conversation (its shared prefix, saved cold, and its live
    state at exit): the longer one truncated, the request resumes from the shorter one and
    prefills the rest — before, any failed load meant a cold prefill of everything."""
    engine = new_engine(model, tmp_path, cold=True)
    body, res = tool_turn(engine, LONG_SYSTEM)
    engine.shutdown()
    ckpts = sorted(engine.store.checkpoints(), key=lambda c: c["tokens"])
    assert [c["reason"] for c in ckpts] == ["cold", "shutdown"], ckpts
    short, long = ckpts
    data = max((tmp_path / long["key"] / "state").rglob("*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-100])  # truncated

    restarted = new_engine(model, tmp_path, cold=True)
    with caplog.at_level(logging.WARNING):
        req, res2 = greedy(restarted, with_tool_result(body, res))
    assert f"kv store: load of {long['key']} failed" in caplog.text
    assert "the next longest checkpoint" in caplog.text
    assert res2.source == CacheSource.DISK and res2.cached == short["tokens"]
    assert res2.cached + res2.prefilled == len(req.view.tokens)
    fresh = new_engine(model, tmp_path / "none")
    _, cold = greedy(fresh, with_tool_result(body, res))
    assert res2.raw_text == cold.raw_text
