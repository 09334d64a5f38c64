"""Per-token log-probabilities (`SamplingParams.logprobs`, OpenAI's `logprobs` /
`top_logprobs`): every output token's entry holds the log_softmax of the raw logits its row
chose from — checked against a cold forward over the prompt and the reply — greedy or
sampled, forced tokens too, on dense and paged rows, with a prompt riding in a decode step,
and beside speculation (a row that asks steps plain). A row that does not ask gets nothing
and decodes as it did. The tiny config in exact math."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from ds4jax.engine import Engine, EngineError, Result, SamplingParams, TokenLogprob
from ds4jax.model.forward import prefill
from ds4jax.model.state import init_state
from ds4jax.sampling import MAX_LOGPROBS
from tests.continuation.conftest import like
from tests.continuation.test_batching import fresh, prepared
from tests.continuation.test_speculative_engine import speculating

GREEDY5 = SamplingParams(temperature=0.0, logprobs=5)
TEXT = "Name three rivers."


@pytest.fixture(scope="module")
def dense(_engine: Engine) -> Engine:
    return like(_engine, sessions=4, max_batch=4)


def run(engine: Engine, *reqs: Any, **kw: Any) -> tuple[list[Result], list[list[Any]]]:
    """`reqs` decoded together from a fresh pool: (their results, each one's events)."""
    fresh(engine)
    events: list[list[Any]] = [[] for _ in reqs]
    tickets = [engine.submit(r, on_event=events[i].append, **kw) for i, r in enumerate(reqs)]
    while engine.busy:
        engine.tick()
    assert all(t.error is None for t in tickets), [t.error for t in tickets]
    return [t.result for t in tickets], events


def reply_tokens(engine: Engine, result: Result) -> list[int]:
    """The reply's tokens: what the row evaluated after its prompt, and a sampled EOS."""
    live = engine.pool.sessions[result.session].live
    out = list(live.tokens[result.prompt_tokens :])
    return out + [engine.tokenizer.eos_id] * (result.output_tokens - len(out))


def cold_logprobs(engine: Engine, prompt: list[int], reply: list[int]) -> np.ndarray:
    """log_softmax of the logits before each reply token, from one cold forward over the
    prompt and the reply (no batch, no step, no cache reuse)."""
    tokens = prompt + reply[:-1]
    _, logits = prefill(engine.params, init_state(engine.cfg, 64), tokens, engine.cfg,
                        chunk_sizes=(64,), all_logits=True)  # fmt: skip
    return np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1 :].astype(np.float32)))


def assert_exact(engine: Engine, prompt: list[int], result: Result, k: int) -> None:
    """Each entry: its token's log-probability and its top k are the cold forward's."""
    entries = result.logprobs
    reply = reply_tokens(engine, result)
    assert entries is not None and [e.token for e in entries] == reply
    want = cold_logprobs(engine, prompt, reply)
    for e, lp in zip(entries, want, strict=True):
        assert abs(e.logprob - lp[e.token]) <= 1e-4
        ids = [t for t, *_ in e.top]
        assert len(ids) == k
        np.testing.assert_allclose([x for *_, x in e.top], lp[ids], atol=1e-4)
        np.testing.assert_allclose([x for *_, x in e.top], np.sort(lp)[::-1][:k], atol=1e-4)


def test_greedy_entries_are_the_cold_forwards_log_softmax(dense) -> None:
    req = prepared(dense, TEXT, 6, sampling=GREEDY5)
    (res,), _ = run(dense, req)
    assert res.output_tokens == 6 and len(res.logprobs) == 6
    assert_exact(dense, list(req.view.tokens), res, 5)
    tok = dense.tokenizer
    for e in res.logprobs:  # greedy: the chosen token is the top-1
        assert e.top[0][0] == e.token and e.top[0][3] == e.logprob
        assert e.bytes == list(tok.token_bytes(e.token)) and e.text == tok.decode([e.token])
        for t, text, raw, _ in e.top:
            assert raw == list(tok.token_bytes(t)) and text == tok.decode([t])
    assert b"".join(bytes(e.bytes) for e in res.logprobs).decode() == res.raw_text
    (plain,), _ = run(dense, prepared(dense, TEXT, 6))  # asking changes no token
    assert plain.logprobs is None and plain.raw_text == res.raw_text


def test_sampled_entries_align_with_the_output_tokens(dense) -> None:
    hot = SamplingParams(temperature=1.0, seed=7, top_k=50)
    req = prepared(dense, TEXT, 8, sampling=SamplingParams(**{**hot.__dict__, "logprobs": 3}))
    (res,), _ = run(dense, req)
    (plain,), _ = run(dense, prepared(dense, TEXT, 8, sampling=hot))
    assert (res.raw_text, res.output_tokens) == (plain.raw_text, plain.output_tokens)
    assert len(res.logprobs) == res.output_tokens
    for e in res.logprobs:
        lps = [x for *_, x in e.top]
        assert len(lps) == 3 and lps == sorted(lps, reverse=True)
        assert e.logprob <= lps[0] + 1e-6
        if e.token in [t for t, *_ in e.top]:
            assert e.logprob == dict((t, x) for t, _, _, x in e.top)[e.token]
    assert_exact(dense, list(req.view.tokens), res, 3)


def test_forced_tokens_get_the_models_distribution_there(dense) -> None:
    """Teacher-forced tokens (as tool_choice and a thinking budget force them): an entry
    each, with the model's log-probability of the token it did not choose; k = 0 reports
    the chosen token alone."""
    req = prepared(dense, TEXT, 8, sampling=SamplingParams(logprobs=0))
    forced = dense.tokenizer.encode_text(" the Nile, the Amazon")
    (res,), _ = run(dense, req, forced_tokens=forced)
    assert [e.token for e in res.logprobs] == forced and all(e.top == () for e in res.logprobs)
    want = cold_logprobs(dense, list(req.view.tokens), forced)
    got = [e.logprob for e in res.logprobs]
    np.testing.assert_allclose(got, [lp[t] for lp, t in zip(want, forced, strict=True)],
                               atol=1e-4)  # fmt: skip
    assert min(got) < -5  # random weights: a forced token is not the model's choice


def test_a_row_that_does_not_ask_decodes_as_without_logprobs(dense) -> None:
    texts = ["Count to five.", "What is JAX?"]
    (a, b), _ = run(dense, *(prepared(dense, t, 6) for t in texts))
    req = prepared(dense, texts[0], 6, sampling=SamplingParams(logprobs=MAX_LOGPROBS))
    (la, lb), events = run(dense, req, prepared(dense, texts[1], 6))
    assert lb.logprobs is None and not any(isinstance(e, TokenLogprob) for e in events[1])
    assert (lb.raw_text, lb.output_tokens) == (b.raw_text, b.output_tokens)
    assert la.raw_text == a.raw_text and len(la.logprobs) == la.output_tokens
    assert all(len(e.top) == MAX_LOGPROBS for e in la.logprobs)
    assert_exact(dense, list(req.view.tokens), la, MAX_LOGPROBS)


def test_a_sampled_eos_is_counted_and_has_its_entry(dense) -> None:
    """A head whose EOS row is the greedy third token's, a little longer: the reply ends
    with a sampled EOS by its third token, never evaluated, counted in `output_tokens`, and
    its entry last."""
    (plain,), _ = run(dense, prepared(dense, TEXT, 3))
    third = reply_tokens(dense, plain)[2]
    head = dense.params["head"]
    head = head.at[dense.tokenizer.eos_id].set(head[third] * 1.5)
    e = Engine(dense.cfg, {**dense.params, "head": head}, dense.tokenizer,
               max_len=dense.max_len, chunk_sizes=dense.chunk_sizes)  # fmt: skip
    req = prepared(e, TEXT, 6, sampling=GREEDY5)
    (res,), (events,) = run(e, req)
    assert res.finish == "end_turn" and res.output_tokens <= 3
    assert len(res.logprobs) == res.output_tokens
    assert res.logprobs[-1].token == e.tokenizer.eos_id
    assert [x for x in events if isinstance(x, TokenLogprob)] == res.logprobs
    assert_exact(e, list(req.view.tokens), res, 5)


def test_entries_are_emitted_before_the_events_of_their_token(dense) -> None:
    (res,), (events,) = run(dense, prepared(dense, TEXT, 6, sampling=GREEDY5))
    emitted = [e for e in events if isinstance(e, TokenLogprob)]
    assert emitted == res.logprobs and len(emitted) == 6
    assert isinstance(events[0], TokenLogprob)  # the first token's, before any text


def test_more_than_twenty_is_refused(dense) -> None:
    with pytest.raises(EngineError) as err:
        prepared(dense, TEXT, 4, sampling=SamplingParams(logprobs=MAX_LOGPROBS + 1))
    assert err.value.status == 400


def test_paged_rows_report_the_dense_rows_entries(dense) -> None:
    paged = like(dense, sessions=4, max_batch=4, paged_pages=256)
    req = prepared(dense, TEXT, 6, sampling=GREEDY5)
    (want,), _ = run(dense, req)
    (got,), _ = run(paged, prepared(paged, TEXT, 6, sampling=GREEDY5))
    assert [e.token for e in got.logprobs] == [e.token for e in want.logprobs]
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert [t for t, *_ in g.top] == [t for t, *_ in w.top]
        assert abs(g.logprob - w.logprob) <= 1e-5
    assert_exact(paged, list(req.view.tokens), got, 5)


def test_a_prompt_riding_in_a_decode_step_reports_its_first_token(dense) -> None:
    """With `stall_bound` the prompt's chunks ride in the other row's steps (mixed steps):
    its first token, chosen from the prompt's last position, gets its entry too."""
    e = like(dense, sessions=4, max_batch=4, stall_bound=2.0)
    fresh(e)
    other = e.submit(prepared(e, "Tell a story.", 30))
    while other.decoder is None:
        e.tick()
    req = prepared(e, " ".join(f"Rule {i}: tidy." for i in range(6)), 4, sampling=GREEDY5)
    ticket = e.submit(req)
    while e.busy:
        e.tick()
    assert e.mixed_steps > 0 and ticket.error is None and other.error is None
    assert len(ticket.result.logprobs) == ticket.result.output_tokens == 4
    assert_exact(e, list(req.view.tokens), ticket.result, 5)


def test_a_row_that_asks_steps_plain_beside_speculation(dense) -> None:
    spec = speculating(dense, sessions=4, max_batch=4)
    req = prepared(dense, TEXT, 6, sampling=GREEDY5)
    (want,), _ = run(dense, req)
    before = spec.spec.counts.steps
    (got,), _ = run(spec, prepared(spec, TEXT, 6, sampling=GREEDY5))
    assert spec.spec.counts.steps == before  # no speculative step while it decoded
    assert got.raw_text == want.raw_text and got.logprobs == want.logprobs
    (alone,), _ = run(spec, prepared(spec, TEXT, 6))
    assert spec.spec.counts.steps > before and alone.raw_text == want.raw_text
