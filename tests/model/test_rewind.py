"""A frontier steps back up to `REWIND` positions by resetting its length (issue 26 item 9,
the room draft verification needs): going past a position and coming back is invisible."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ds4jax.model.forward import decode_step, prefill
from ds4jax.model.params import init_params
from ds4jax.model.state import REWIND, init_state, rewind
from tests.model.conftest import small_config

DEPTH = 4  # the steps back draft verification needs (speculative-decoding.md), REWIND's bound
CONTINUE = 6  # tokens decoded after the step back: more than DEPTH, so every ring is rewritten


def _same(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("detour", ["decode", "chunk"])
def test_stepping_back_then_on_equals_never_having_gone_past(detour: str) -> None:
    """From each start position of one HCA window (8: every CSA and HCA phase, the window
    ring wrapping) and each depth 1…4, rejected tokens are decoded (one by one, or as
    one verification chunk), the state is rewound to the start with the start's logits,
    and the true tokens follow: every logit and every leaf of the final state equals the
    run that never went past the start, bit for bit. Without the room (a ring the size the
    model reads) the rejected tokens overwrite rows the start still needs."""
    assert REWIND >= DEPTH
    cfg = small_config(quant_sim=False)
    params = init_params(cfg, seed=5)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, cfg.vocab_size, 48)
    truth = rng.integers(0, cfg.vocab_size, CONTINUE)
    for n in range(40, 48):
        start, _ = prefill(params, init_state(cfg, 128), prompt[:n], cfg, chunk_sizes=(16,))
        straight, want = start, []
        for t in truth:
            straight = decode_step(params, straight, int(t), cfg)
            want.append(np.asarray(straight.logits))
        for depth in range(1, DEPTH + 1):
            rejected = rng.integers(0, cfg.vocab_size, depth)
            if detour == "decode":
                ahead = start
                for t in rejected:
                    ahead = decode_step(params, ahead, int(t), cfg)
            else:
                ahead, _ = prefill(params, start, rejected, cfg, chunk_sizes=(DEPTH,))
            assert int(ahead.pos) == n + depth
            state = rewind(ahead, n, start.logits)
            for t, logits in zip(truth, want, strict=True):
                state = decode_step(params, state, int(t), cfg)
                assert np.array_equal(np.asarray(state.logits), logits), (n, depth)
            assert _same(state, straight), (n, depth)
