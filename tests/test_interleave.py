"""The prefill bound while rows decode (`ds4jax.interleave`), without a model: the chosen
chunk is one of the sizes, fits the bound when any does, is the largest that does, never
shrinks as steps grow dearer, and whole chunks run when nothing decodes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds4jax.interleave import (
    ALPHA,
    HEADROOM,
    PASS_BOUND,
    TickCosts,
    chunk_estimates,
    chunk_limit,
    next_prefill,
    overtakes,
)

SIZES = (4, 16, 64, 256, 512)

sizes_st = st.lists(st.sampled_from((1, 2, 4, 8, 16, 32, 64, 256, 512)), min_size=1,
                    unique=True).map(sorted)  # fmt: skip
seconds = st.floats(1e-4, 2.0)


@st.composite
def situations(draw):
    sizes = draw(sizes_st)
    measured = draw(st.dictionaries(st.sampled_from(sizes), seconds))
    step_size = draw(st.sampled_from((0, 1, 2, 4, 8)))
    costs = TickCosts(chunk_s=measured)
    if step_size and draw(st.booleans()):
        costs = costs.stepped(step_size, draw(seconds))
    return sizes, step_size, costs, draw(st.sampled_from((None, 1.0, 1.5, 2.0, 3.0)))


@given(situations())
def test_the_chunk_is_the_largest_size_within_the_bound(case) -> None:
    sizes, step_size, costs, stall = case
    limit = chunk_limit(sizes, step_size, costs, stall)
    assert limit in sizes
    step = costs.step_s.get(step_size)
    if not step_size or not stall:
        assert limit == max(sizes)  # nothing to protect: whole chunks
        return
    if step is None:
        assert limit == min(sizes)  # the step's cost not known yet: the smallest
        return
    budget = HEADROOM * (stall - 1) * step
    guess = chunk_estimates(costs, sizes)
    fits = [s for s in sizes if guess[s] is not None and guess[s] <= budget]
    assert limit == max(fits, default=min(sizes))
    if limit != min(sizes):
        assert guess[limit] <= budget


@given(situations(), st.floats(1.0, 10.0))
def test_a_dearer_step_never_shrinks_the_chunk(case, factor) -> None:
    sizes, step_size, costs, stall = case
    if not step_size or step_size not in costs.step_s:
        return
    dearer = TickCosts({step_size: costs.step_s[step_size] * factor}, costs.chunk_s)
    assert chunk_limit(sizes, step_size, dearer, stall) >= chunk_limit(sizes, step_size,
                                                                       costs, stall)  # fmt: skip


def test_an_unmeasured_size_is_guessed_at_twice_its_smaller_neighbour() -> None:
    costs = TickCosts(chunk_s={4: 0.010, 64: 0.050})
    guess = chunk_estimates(costs, (2, *SIZES))
    assert guess == {2: None, 4: 0.010, 16: 0.020, 64: 0.050, 256: 0.100, 512: 0.200}


def test_bench_192m_on_two_cores_fits_four_token_chunks() -> None:
    """The costs measured on this VM (bench-192m, a 400-token context, B=4): the plain step
    34.8 ms; a 4-token chunk adds 9.8 ms, a 16-token one 34.4."""
    costs = TickCosts().stepped(4, 0.0348)
    assert chunk_limit(SIZES, 4, costs, 2.0) == 4  # nothing measured: start small
    costs = costs.chunked(4, 0.0098)
    assert chunk_limit(SIZES, 4, costs, 2.0) == 16  # guessed at 19.6 ms ≤ 0.8 × 34.8: tried
    costs = costs.chunked(16, 0.0344)
    assert chunk_limit(SIZES, 4, costs, 2.0) == 4  # measured over the allowance
    assert chunk_limit(SIZES, 4, costs, 3.0) == 16  # 55.7 ms allowed; 64 guessed at 68.8
    assert chunk_limit(SIZES, 0, costs, 2.0) == 512  # no row decodes
    assert chunk_limit(SIZES, 4, costs, None) == 512  # the bound off


def test_costs_are_moving_averages() -> None:
    costs = TickCosts().stepped(2, 1.0).stepped(2, 2.0).chunked(16, 3.0)
    assert costs.step_s[2] == pytest.approx((1 - ALPHA) * 1.0 + ALPHA * 2.0)
    assert costs.chunk_s == {16: 3.0}
    assert TickCosts().step_s == {}  # a new record each time, the old one unchanged


def test_a_short_prompt_starts_beside_a_long_one_in_flight() -> None:
    sizes = (16, 64)
    assert overtakes(5_000, [], sizes)  # nothing in flight: anything starts
    assert overtakes(16, [15_000], sizes)  # a live tool turn beside a cold 16k prompt
    assert overtakes(64, [15_000, 65], sizes)
    assert not overtakes(65, [15_000], sizes)  # more than one whole chunk: it waits
    assert not overtakes(40, [40], sizes)  # not shorter than what the other has left
    assert not overtakes(40, [15_000, 30], sizes)
    # one that would replace another conversation's live session waits for the prompt
    assert not overtakes(16, [15_000], sizes, displaces=True)
    assert overtakes(16, [], sizes, displaces=True)  # with none in flight it starts


@given(st.lists(st.integers(1, 20_000), min_size=1, max_size=6), st.data())
def test_the_prompt_with_least_left_goes_first_unless_one_starves(remaining, data) -> None:
    passed = data.draw(st.lists(st.integers(0, PASS_BOUND - 1), min_size=len(remaining),
                                max_size=len(remaining)))  # fmt: skip
    i = next_prefill(remaining, passed)
    assert remaining[i] == min(remaining) and i == remaining.index(min(remaining))
    starved = data.draw(st.integers(0, len(remaining) - 1))
    passed[starved] = PASS_BOUND
    first = next(j for j, p in enumerate(passed) if p >= PASS_BOUND)
    assert next_prefill(remaining, passed) == first == starved
