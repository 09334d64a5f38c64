"""Disk checkpoints survive a restart, end to end over HTTP (issue 6 §6).

A ≥ 2k-token conversation with a tool call is served by one server with a disk store; the
server stops (shutdown save); a new server — new engine, new store object, same directory —
gets the next request: a disk hit, only the suffix prefilled, and the same greedy output as a
server that never restarted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic

from ds4jax.chat.tokenizer import V4Tokenizer
from ds4jax.config import load_config
from ds4jax.engine import Engine
from ds4jax.kvstore.disk import DiskStore
from ds4jax.model.params import init_params
from serve.worker import EngineWorker
from tests.serve.conftest import MODEL, TOOLS, ThreadServer, dsml_call, force, make_app

CTX = 4096


def _server(cfg, params, tok, directory: Path | None):
    store = None
    if directory is not None:
        store = DiskStore.for_model(directory, cfg, params, tok, max_len=CTX)
    engine = Engine(cfg, params, tok, max_len=CTX, chunk_sizes=(16, 64, 256), store=store)
    if store is not None:  # as `ds4jax serve` does at startup
        for tid, block in store.tool_entries().items():
            engine.tool_memory.remember([tid], block)
    worker = EngineWorker(engine)
    worker.start()
    return engine, worker


def _conversation(client: anthropic.Anthropic, system: str) -> tuple[dict[str, Any], Any]:
    first = client.messages.create(
        model=MODEL, max_tokens=200, system=system, tools=TOOLS,
        messages=[{"role": "user", "content": "list the files"}],
        extra_body=force("I will look." + "</think>" + dsml_call("ls -la")),
    )  # fmt: skip
    tool = next(b for b in first.content if b.type == "tool_use")
    follow = {
        "model": MODEL,
        "max_tokens": 4,
        "extra_body": {"temperature": 0.0},  # greedy
        "system": system,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "list the files"},
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "a.txt"}],
            },
        ],
    }
    return follow, first


def test_a_restarted_server_resumes_from_its_disk_checkpoint(tmp_path: Path) -> None:
    cfg = load_config("tiny").replace(quant_sim=False)
    params, tok = init_params(cfg, 0), V4Tokenizer()
    system = " ".join(f"rule {i}: keep the sampled state as the truth." for i in range(240))
    assert len(tok.encode_text(system)) >= 2048

    # without a restart: the reference output
    engine, worker = _server(cfg, params, tok, None)
    with ThreadServer(make_app(worker)) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)
        follow, _ = _conversation(client, system)
        reference = client.messages.create(**follow)
    worker.stop()

    # with a restart in between
    engine, worker = _server(cfg, params, tok, tmp_path / "kv")
    with ThreadServer(make_app(worker)) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)
        follow, first = _conversation(client, system)
    worker.stop()
    engine.shutdown()  # the clean-exit save
    saved = (
        first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    )

    engine, worker = _server(cfg, params, tok, tmp_path / "kv")
    with ThreadServer(make_app(worker)) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0)
        resumed = client.messages.create(**follow)
    worker.stop()

    assert resumed.usage.cache_read_input_tokens == saved  # a disk hit at the saved frontier
    assert resumed.usage.input_tokens < 32  # only EOS + the tool-result turn was prefilled
    assert resumed.usage.cache_read_input_tokens + resumed.usage.input_tokens == (
        reference.usage.cache_read_input_tokens + reference.usage.input_tokens
    )
    assert [b.model_dump() for b in resumed.content] == [b.model_dump() for b in reference.content]
