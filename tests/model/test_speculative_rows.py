"""Speculative steps of a batch of rows (`ds4jax.speculation`, `model.speculative.verify_rows`
/ `draft_rows`, issue 29), driven through the decoder protocol the engine uses.

Greedy: each row's tokens equal plain greedy decoding's and the state it ends with equals
plain decoding's (its length, its logits) — whatever the drafts: the block's own, all right,
or wrong exactly at compression boundaries and as the window wraps; with forced tokens in
the middle, an EOS drafted and kept, and rows of different lengths side by side. Sampling:
whatever is drawn, a row's state holds exactly the tokens its decoder holds (a cold prefill
of them gives its logits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4jax.model import batch as batch_ops
from ds4jax.model.forward import decode_step, prefill
from ds4jax.model.params import init_params
from ds4jax.model.speculative import verify_rows
from ds4jax.model.state import init_state
from ds4jax.speculation import SAMPLE, Speculator
from tests.model.conftest import small_config

CHUNKS = (4, 16)
MAX_LEN = 128
N = 30


class Row:
    """A decoder as the engine's speaks to a step: greedy or sampled per the step's
    arrays, `n` tokens, `force` {index in the reply: token}, stops at `eos`."""

    def __init__(self, prompt: list[int], n: int, eos: int, force: dict[int, int] | None = None):
        self.tokens = list(prompt)
        self.generated: list[int] = []
        self.n, self.eos, self.force = n, eos, force or {}
        self.finished = False

    @property
    def done(self) -> bool:
        return self.finished

    def plan(self) -> int | None:
        if len(self.generated) >= self.n:
            self.finished = True
            return None
        return self.force.get(len(self.generated), SAMPLE)

    def accept(self, t: int) -> None:
        assert not self.finished
        if t == self.eos:
            self.finished = True
            return
        self.generated.append(t)
        self.tokens.append(t)


@pytest.fixture(scope="module")
def model():
    cfg = small_config(num_layers=3, compress_ratios=(0, 4, 8), hash_layers=(True, False, False),
                       quant_sim=False)  # fmt: skip
    params = init_params(cfg, 4, mtp_layers=1)
    rng = np.random.default_rng(8)
    prompts = [list(map(int, rng.integers(3, cfg.vocab_size, k))) for k in (11, 5, 17)]
    states = [prefill(params, init_state(cfg, MAX_LEN), p, cfg, chunk_sizes=CHUNKS)[0]
              for p in prompts]  # fmt: skip
    return cfg, params, prompts, states


def plain_greedy(cfg, params, state, n: int, eos: int, force: dict[int, int]):
    out: list[int] = []
    while len(out) < n:
        t = force.get(len(out), int(np.argmax(state.logits)))
        if t == eos:
            break
        state = decode_step(params, state, t, cfg)
        out.append(t)
    return out, state


def run(cfg, params, states, rows: list[Row], temperature: float = 0.0, drafts=None):
    """Speculative steps until every row is done; `drafts(row, at)` replaces the block's
    draft for the token at `at + 1` (None: keep it). Returns (final states, speculator)."""
    B = len(rows)
    batch = batch_ops.empty_batch(cfg, MAX_LEN, B)
    spec = Speculator(cfg, B, lambda x: x)
    for r, s in enumerate(states):
        batch = batch_ops.insert(batch, np.int32(r), s)
        spec.admit(r)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), B)))
    sampling = (np.full(B, temperature, np.float32), np.zeros(B, np.int32),
                np.ones(B, np.float32), np.zeros(B, np.float32))  # fmt: skip
    active = set(range(B))
    finals: dict[int, object] = {}
    while active:
        plans = {}
        for r in sorted(active):
            plan = spec.plan_row(r, rows[r], rows[r].eos)
            if plan is None:
                finals[r] = batch_ops.extract(batch, np.int32(r))
                active.discard(r)
            else:
                plans[r] = plan
        if not plans:
            break
        if drafts is not None:
            d = np.asarray(spec.drafts).copy()
            for r, plan in plans.items():
                if plan.draft:
                    d[r] = drafts(r, plan.at, int(d[r]))
            spec.drafts = jnp.asarray(d)

        def verify(*args):
            nonlocal batch
            batch, out = verify_rows(params, batch, *args, cfg=cfg, size=B)
            return out

        keys, done = spec.step(params, verify, plans, {r: rows[r] for r in plans}, sampling,
                               keys, rows[0].eos, B)  # fmt: skip
        for r in done:
            finals[r] = batch_ops.extract(batch, np.int32(r))
            active.discard(r)
    return finals, spec


def boundary(pos: int) -> bool:
    return pos % 4 == 3 or pos % 8 == 7


@pytest.mark.parametrize("drafts", ["mtp", "right", "wrong_at_boundaries"])
def test_speculative_rows_equal_plain_greedy(model, drafts: str) -> None:
    cfg, params, prompts, states = model
    force = [{}, {3: 7, 4: 9, 12: 11}, {20: 5}]
    # an EOS the model picks: row 0 ends there (drafted and kept when drafts are right)
    eos = plain_greedy(cfg, params, states[0], 9, -1, {})[0][8]
    plain = [plain_greedy(cfg, params, s, N, eos, f) for s, f in zip(states, force, strict=True)]
    assert len(plain[0][0]) == 8

    def propose(r: int, at: int, mtp_draft: int) -> int:
        if drafts == "mtp":
            return mtp_draft
        i = at + 1 - len(prompts[r])  # the reply's index of the drafted token
        toks = plain[r][0]
        right = toks[i] if i < len(toks) else eos
        if drafts == "wrong_at_boundaries" and (boundary(at + 1) or boundary(at + 2)):
            return (right + 1) % cfg.vocab_size
        return right

    rows = [Row(p, N, eos, f) for p, f in zip(prompts, force, strict=True)]
    finals, spec = run(cfg, params, states, rows, drafts=propose)
    for r, (want, state) in enumerate(plain):
        assert rows[r].generated == want, r
        got = finals[r]
        assert int(got.pos) == int(state.pos) == len(rows[r].tokens)
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(state.logits),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
    c = spec.counts
    if drafts == "right":
        assert c.accepted == c.proposed > 0 and c.steps < N
    if drafts == "wrong_at_boundaries":
        assert 0 < c.accepted < c.proposed


def test_sampled_rows_hold_exactly_their_tokens(model) -> None:
    cfg, params, prompts, states = model
    rows = [Row(p, N, 2, f) for p, f in zip(prompts, [{}, {6: 4}, {}], strict=True)]
    finals, spec = run(cfg, params, states, rows, temperature=1.0)
    assert spec.counts.proposed > 0
    for r, row in enumerate(rows):
        assert len(row.generated) == N or row.done
        _, logits = prefill(params, init_state(cfg, MAX_LEN), row.tokens, cfg,
                               chunk_sizes=CHUNKS)  # fmt: skip
        assert int(finals[r].pos) == len(row.tokens)
        np.testing.assert_allclose(np.asarray(finals[r].logits), np.asarray(logits),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_any_drafts_forces_and_eos_leave_plain_greedy(model, data) -> None:
    """Property: whichever drafts are right (drawn per position, with extra weight on the
    positions just before a compression boundary and as the window wraps), wherever tokens
    are forced (tool-call tokens: forced, possibly right after a draft) and wherever the
    EOS falls (a drafted EOS kept, or none), every row's tokens and final state are plain
    greedy decoding's."""
    cfg, params, prompts, states = model
    n = data.draw(st.integers(4, N), label="n")
    tokens = st.integers(3, cfg.vocab_size - 1)
    force = [data.draw(st.dictionaries(st.integers(0, n - 1), tokens, max_size=4),
                       label=f"force{r}") for r in range(3)]  # fmt: skip
    stop_at = data.draw(st.one_of(st.none(), st.integers(0, n - 1)), label="eos at")
    eos = -1
    if stop_at is not None:
        eos = plain_greedy(cfg, params, states[0], n, -1, force[0])[0][stop_at]
    if eos in {t for f in force for t in f.values()}:
        eos = -1  # a forced EOS is a different test (the decoder's, not the step's)
    plain = [plain_greedy(cfg, params, s, n, eos, f) for s, f in zip(states, force, strict=True)]
    p_right = data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]), label="p right")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))

    def propose(r: int, at: int, mtp_draft: int) -> int:
        i = at + 1 - len(prompts[r])
        toks = plain[r][0]
        right = toks[i] if i < len(toks) else (eos if eos >= 0 else mtp_draft)
        wrong = (right + 1 + int(rng.integers(cfg.vocab_size - 1))) % cfg.vocab_size
        near = boundary(at + 1) or boundary(at + 2)
        return right if rng.random() < (p_right / 2 if near else p_right) else wrong

    rows = [Row(p, n, eos, f) for p, f in zip(prompts, force, strict=True)]
    finals, _ = run(cfg, params, states, rows, drafts=propose)
    for r, (want, state) in enumerate(plain):
        assert rows[r].generated == want, r
        assert int(finals[r].pos) == int(state.pos) == len(rows[r].tokens)
        np.testing.assert_allclose(np.asarray(finals[r].logits), np.asarray(state.logits),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
