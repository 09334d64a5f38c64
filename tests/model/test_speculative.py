"""Greedy speculative decoding with the MTP block (`model.speculative`, issue 29): the token
stream is plain greedy decoding's whatever the drafts — the block's own (random weights:
nearly all rejected), all right, or wrong exactly at compression boundaries (position
mod 4 = 3 and mod 8 = 7 on this config's CSA/HCA ratios) and across the window ring's
wrap — and a draft is kept exactly when it was the model's choice."""

from __future__ import annotations

import numpy as np
import pytest

from ds4jax.model.forward import decode_step, prefill
from ds4jax.model.params import init_params
from ds4jax.model.speculative import generate_greedy
from ds4jax.model.state import init_state
from tests.model.conftest import small_config

CHUNKS = (4, 16)
N = 36  # past several windows of 8 and every boundary of ratio 4 and 8


@pytest.fixture(scope="module")
def model():
    cfg = small_config(num_layers=3, compress_ratios=(0, 4, 8), hash_layers=(True, False, False),
                       quant_sim=False)  # fmt: skip
    params = init_params(cfg, 4, mtp_layers=1)
    prompt = list(np.random.default_rng(8).integers(3, cfg.vocab_size, 11))
    state, logits = prefill(params, init_state(cfg, 128), prompt, cfg, chunk_sizes=CHUNKS)
    plain = [int(np.argmax(logits))]
    while len(plain) < N:
        state = decode_step(params, state, plain[-1], cfg)
        plain.append(int(np.argmax(state.logits)))
    return cfg, params, prompt, plain


@pytest.mark.parametrize("drafts", ["mtp", "right", "wrong_at_boundaries"])
def test_speculative_greedy_equals_plain_greedy(model, drafts: str) -> None:
    cfg, params, prompt, plain = model
    P = len(prompt)

    def boundary(pos: int) -> bool:
        return pos % 4 == 3 or pos % 8 == 7

    def propose(pos: int, mtp_draft: int) -> int:
        if drafts == "mtp":
            return mtp_draft
        right = plain[pos - P]  # the token plain decoding put at that position
        # wrong just before a boundary too: the rejection there moves the next draft onto it
        if drafts == "wrong_at_boundaries" and (boundary(pos) or boundary(pos + 1)):
            return (right + 1) % cfg.vocab_size
        return right

    seen: list[tuple[int, bool]] = []

    def watch(pos: int, mtp_draft: int) -> int:
        d = propose(pos, mtp_draft)
        seen.append((pos, d == plain[pos - P] if pos - P < N else True))
        return d

    run = generate_greedy(params, cfg, prompt, N, 128, chunk_sizes=CHUNKS, propose=watch)
    assert run.tokens == plain
    # a draft is kept exactly when it was right
    assert run.accepted == sum(right for _, right in seen)
    if drafts == "right":
        assert run.steps == run.accepted == len(seen) and run.steps < N
    if drafts == "wrong_at_boundaries":
        wrong = [pos for pos, right in seen if not right]
        assert all(boundary(p) or boundary(p + 1) for p in wrong)
        assert {p % 8 for p in wrong if boundary(p)} >= {3, 7}  # rejected on both kinds
        assert 0 < run.accepted < run.steps


def test_an_empty_prompt_is_a_clear_error(model) -> None:
    cfg, params, _, _ = model
    with pytest.raises(ValueError, match="at least one token"):
        generate_greedy(params, cfg, [], 4, 128, chunk_sizes=CHUNKS)
