"""Bursts (`model.batch.burst`): while the active rows only sample, one program takes up to
`BURST_STEPS` tokens per row. A row takes them while its decoder would have sampled them
and steps back past the rest, so a request's tokens, its key stream and its final frontier
are those of a program per token.

The engine is the tiny config in exact math (`conftest.exact_tiny_engine`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.engine import Engine, SamplingParams
from ds4jax.model import batch as batch_ops
from ds4jax.model.forward import prefill
from ds4jax.model.state import init_state
from tests.continuation.conftest import like
from tests.continuation.test_batching import fresh, prepared


def test_a_burst_is_its_steps_one_by_one(_engine: Engine) -> None:
    """Rows allowed 4 and 2 tokens, one greedy and one sampled: the burst's tokens, keys,
    per-step logits and final rows equal four `step`s, the second row taking EOS (written
    nowhere) past its two."""
    cfg, params = _engine.cfg, _engine.params
    states = [prefill(params, init_state(cfg, 64), np.arange(3 + r, 9 + r), cfg)[0]
              for r in range(2)]  # fmt: skip
    batch = jax.tree.map(lambda *x: jnp.stack(x), *states)
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(s))) for s in (1, 2)])
    sampling = (np.array([0.0, 1.0], np.float32), np.zeros(2, np.int32),
                np.ones(2, np.float32), np.zeros(2, np.float32))  # fmt: skip
    eos = np.int32(_engine.tokenizer.eos_id)
    copy = jax.tree.map(jnp.copy, batch)
    got, tokens, got_keys, logits = batch_ops.burst(
        params, copy, np.array([4, 2], np.int32), keys, *sampling, eos, cfg=cfg, size=2, steps=4
    )
    want, k = batch, keys
    for i in range(4):
        override = np.array([-1, -1 if i < 2 else eos], np.int32)
        want, tok, k = batch_ops.step(params, want, override, k, *sampling, eos, cfg=cfg, size=2)
        np.testing.assert_array_equal(np.asarray(tokens[i]), np.asarray(tok))
        np.testing.assert_array_equal(np.asarray(got_keys[i]), np.asarray(k))
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(want.logits), atol=1e-5)
    assert (np.asarray(tokens[2:, 1]) == eos).all()
    np.testing.assert_array_equal(np.asarray(got.pos), [6 + 4, 6 + 2])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.fixture(scope="module")
def engines(_engine: Engine) -> tuple[Engine, Engine]:
    return (like(_engine, sessions=4, max_batch=4),
            like(_engine, sessions=4, max_batch=4, burst=1))  # fmt: skip


def test_requests_in_bursts_equal_a_program_per_token(engines) -> None:
    """Greedy and seeded sampled requests, one ending on a stop sequence inside a burst, one
    on `max_tokens` off a burst's length, decoded together: text, token count, finish and
    final frontier equal the engine's with `burst=1`, and bursts ran."""
    bursting, plain = engines
    fresh(plain)
    probe = plain.run(prepared(plain, "Count to five.", 12)).raw_text
    stop = probe[len(probe) // 2 : len(probe) // 2 + 2]
    hot = SamplingParams(temperature=1.0, seed=7)
    asks = [("Count to five.", 12, [stop], SamplingParams()), ("Name a river.", 10, None, hot),
            ("What is JAX?", 9, None, SamplingParams())]  # fmt: skip
    results = {}
    for engine in (bursting, plain):
        fresh(engine)
        tickets = [engine.submit(prepared(engine, t, n, stops, s)) for t, n, stops, s in asks]
        while engine.busy:
            engine.tick()
        results[engine] = [t.result for t in tickets]
        assert all(t.error is None for t in tickets)
    assert bursting.bursts > 0 and plain.bursts == 0
    assert results[bursting][0].finish.value == "stop_sequence"
    for a, b in zip(results[bursting], results[plain], strict=True):
        assert (a.raw_text, a.output_tokens, a.finish) == (b.raw_text, b.output_tokens, b.finish)
        live_a = bursting.pool.sessions[a.session].live
        live_b = plain.pool.sessions[b.session].live
        assert live_a.tokens == live_b.tokens
        assert int(live_a.state.pos) == len(live_a.tokens)
        np.testing.assert_allclose(np.asarray(live_a.state.logits),
                                   np.asarray(live_b.state.logits), atol=1e-5)  # fmt: skip
        cold = bursting.logits_for(live_a.tokens)
        assert np.abs(cold - np.asarray(live_a.state.logits)).max() <= 1e-5


def test_burst_takes_one_to_its_rewind_room(_engine: Engine) -> None:
    with pytest.raises(ValueError, match="burst takes"):
        like(_engine, burst=batch_ops.BURST_STEPS + 1)


def test_a_row_with_room_for_one_token_steps_plain(engines) -> None:
    """A burst evaluates all its steps: rows with room for one token only (`max_tokens` 1)
    take a plain step instead."""
    bursting, _ = engines
    fresh(bursting)
    before = bursting.bursts
    result = bursting.run(prepared(bursting, "Count to five.", 1))
    assert result.output_tokens == 1 and bursting.bursts == before
