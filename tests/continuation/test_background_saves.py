"""Saves off the request path (`kvstore.background`): a request does not wait for its
checkpoint, readers of the store wait for every save asked for before them, shutdown
flushes, and saves land in order."""

from __future__ import annotations

import threading

from ds4jax.kvstore.background import BackgroundSaves
from ds4jax.kvstore.store import NoStore
from tests.continuation.conftest import prepare


class GatedStore(NoStore):
    """Saves every cold prompt whole, but each save blocks until the test opens the gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.saved: list[tuple[int, str]] = []
        self.lookups = 0

    def cold_cut(self, tokens, segments):
        return len(tokens)

    def save(self, tokens, segments, state, reason, tool_memory) -> None:
        assert self.gate.wait(600), "the test never opened the gate"
        assert int(state.pos) == len(tokens)  # the immutable state of exactly these tokens
        self.saved.append((len(tokens), reason))

    def lookup(self, segments):
        self.lookups += 1
        return None


def test_a_request_does_not_wait_for_its_save_and_readers_do(engine, monkeypatch) -> None:
    inner = GatedStore()
    monkeypatch.setattr(engine, "store", BackgroundSaves(inner))
    body = {"messages": [{"role": "user", "content": "hello"}], "thinking": {"type": "disabled"}}
    res = engine.run(prepare(engine, body, 2))  # the cold save is still blocked here
    assert res.output_tokens == 2 and inner.saved == [] and engine.store.pending == 1

    before = inner.lookups  # the request's own routing looked the disk up, before its save
    found = threading.Event()
    reader = threading.Thread(target=lambda: (engine.store.lookup(()), found.set()))
    reader.start()
    assert not found.wait(0.3)  # a lookup waits for the pending save
    inner.gate.set()
    assert found.wait(30)
    reader.join()
    assert inner.saved == [(res.prompt_tokens, "cold")] and inner.lookups == before + 1

    engine.shutdown()  # the live frontier's save, flushed before shutdown returns
    assert inner.saved[-1] == (engine.live.pos, "shutdown") and engine.store.pending == 0
