"""States whose capacity follows their tokens (`model.state.spans`, issue 26): a state is made
with the smallest span that holds its tokens and grows — in prefill, in the decode batch —
as the conversation does. Growing or shrinking changes no value: every path gives the
states and the greedy text of an engine whose states all have the context's capacity."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ds4jax.engine import Engine
from ds4jax.model.forward import prefill
from ds4jax.model.state import holds, init_state, resize, span_for, spans
from tests.continuation.conftest import TOOLS, like
from tests.continuation.test_sessions import (
    SYSTEM,
    fresh,
    interleavings,
    play_both,
    prepared,
    same_outcomes,
)

BASE = 1024


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 500, n)]


def _max_diff(a, b) -> float:
    """The largest difference between two states' leaves (equal infinities differ by 0)."""

    def diff(x, y) -> float:
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        with np.errstate(invalid="ignore"):  # −∞ − −∞ (empty compressor slots)
            return float(np.where(x == y, 0.0, np.abs(x - y)).max(initial=0.0))

    return max(diff(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_the_spans_double_from_the_base_to_the_context(_engine) -> None:
    cfg = _engine.cfg  # sliding window 32
    assert spans(cfg, 2048, 128) == (128, 256, 512, 1024, 2048)
    assert spans(cfg, 2048, 8)[0] == cfg.sliding_window  # never shorter than the window
    assert spans(cfg, 1000, 4096) == (1000,)  # a short context: one span, the context
    assert spans(cfg, 3000, 1000) == (1000, 2000, 3000)
    s = spans(cfg, 2048, 128)
    assert [span_for(s, n) for n in (0, 127, 128, 1023, 1024, 2047)] == [
        128, 128, 256, 1024, 2048, 2048]  # fmt: skip
    with pytest.raises(ValueError, match="do not fit"):
        span_for(s, 2048)


def test_resizing_moves_no_value_and_growth_continues_as_a_cold_prefill(_engine) -> None:
    cfg, params = _engine.cfg, _engine.params
    toks = _tokens(230)
    # the capacities the other engines here compile for: 1024 (spans) and 2048 (the context)
    small, _ = prefill(params, init_state(cfg, 1024), toks[:100], cfg, chunk_sizes=(16, 64))
    grown = resize(small, cfg=cfg, span=2048)
    assert holds(cfg, grown, 2048) and not holds(cfg, grown, 1024)
    assert grown.nbytes > small.nbytes
    back = resize(grown, cfg=cfg, span=1024)
    assert _max_diff(back, small) == 0.0  # a shrink drops zero rows only
    grown, _ = prefill(params, grown, toks[100:], cfg, chunk_sizes=(16, 64))
    cold, _ = prefill(params, init_state(cfg, 2048), toks, cfg, chunk_sizes=(16, 64))
    assert _max_diff(grown, cold) <= 1e-5


@pytest.fixture(scope="module")
def pair(_engine: Engine) -> tuple[Engine, Engine]:
    """One engine whose states all have the context's capacity, one with spans from 1024."""

    kw = dict(sessions=6, fork_points=True, max_batch=4)
    return like(_engine, span_base=_engine.max_len, **kw), like(_engine, span_base=BASE, **kw)


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])  # fmt: skip
@given(plan=interleavings())
def test_spanned_states_serve_interleaved_conversations_as_full_ones(pair, plan) -> None:
    full, spanned = pair
    assert full.spans == (full.max_len,)
    want, got = play_both(full, spanned, plan)
    assert same_outcomes(got, want)
    frontiers = [s.live for s in spanned.pool.sessions if s.live is not None]
    frontiers += [f.frontier for f in spanned.pool.forks]
    for f in frontiers:  # each at the span of its own tokens
        assert holds(spanned.cfg, f.state, span_for(spanned.spans, f.pos))
    assert spanned.pool.state_bytes() < full.pool.state_bytes()


def test_the_batch_grows_when_a_row_reaches_its_span_and_shrinks_after(pair) -> None:
    """Two rows decode together; the longer one's prompt ends just before the 1024 span's
    end, so it crosses into the next span mid-reply and the batch grows under both; once
    both left, the batch is back at its smallest span. The replies are the full-capacity
    engine's."""
    full, engine = pair
    full, engine = fresh(full, 4), fresh(engine, 4)

    def long_body(pad: int) -> dict:
        ask = "List the files, please." + " x" * pad
        messages = [{"role": "user", "content": ask}]
        return {"system": SYSTEM * 24, "tools": TOOLS, "messages": messages}

    pad = 0  # words are added until the prompt ends 8 tokens before the span's end
    while len(prepared(engine, long_body(pad + 8), 1).view.tokens) <= 1024 - 8:
        pad += 8
    while len(prepared(engine, long_body(pad + 1), 1).view.tokens) <= 1024 - 8:
        pad += 1
    bodies = [long_body(pad), {"messages": [{"role": "user", "content": "Hi."}]}]
    n_long = len(prepared(engine, bodies[0], 1).view.tokens)
    assert 1024 - 16 < n_long <= 1024 - 8
    want = [full.run(prepared(full, b, 12)) for b in bodies]
    tickets = [engine.submit(prepared(engine, b, 12)) for b in bodies]
    spans_seen = set()
    while not all(t.finished.is_set() for t in tickets):
        engine.tick()
        spans_seen.add(engine._batch_span)
    got = [t.result for t in tickets]
    assert [r.raw_text for r in got] == [r.raw_text for r in want]
    assert got[0].prompt_tokens + got[0].output_tokens > 1024  # it did cross
    assert {1024, 2048} <= spans_seen and engine._batch_span == engine.spans[0]
    live = engine.pool.sessions[got[0].session].live
    assert holds(engine.cfg, live.state, 2048)
    cold = engine.logits_for(live.tokens)
    assert np.abs(cold - np.asarray(live.state.logits)).max() <= 1e-5
