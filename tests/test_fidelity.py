"""`ds4jax.fidelity`: the measures, the client model, and one live tool loop on the tiny model
whose replays are checked against the live ids (identity replay ≈ 0, splices = renders);
state-dtype drift along a demo tool loop on the trained demo model."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from ds4jax import fidelity
from ds4jax.chat import specials
from ds4jax.chat.segments import template
from ds4jax.continuation.types import CacheSource
from ds4jax.demo.corpus import held_out_tasks
from ds4jax.demo.evaluate import HELD_OUT_SEED
from ds4jax.engine import Engine


def test_kl_and_top1_of_identical_distributions() -> None:
    logits = np.random.default_rng(0).normal(size=(5, 1000)).astype(np.float32)
    assert np.all(fidelity.kl_divergence(logits, logits) == 0.0)
    assert np.all(fidelity.kl_divergence(logits, logits + 3.0) <= 1e-12)  # shift-invariant
    assert fidelity.top1_agreement(logits, logits).all()


def test_kl_matches_the_closed_form_and_top1_sees_a_flip() -> None:
    p = np.log(np.array([[0.5, 0.5], [0.8, 0.2]]))
    q = np.log(np.array([[0.9, 0.1], [0.2, 0.8]]))
    expected = [
        0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1),
        0.8 * math.log(0.8 / 0.2) + 0.2 * math.log(0.2 / 0.8),
    ]
    np.testing.assert_allclose(fidelity.kl_divergence(p, q), expected, rtol=1e-12)
    assert fidelity.top1_agreement(p, q).tolist() == [True, False]  # ties go to the first
    np.testing.assert_allclose(fidelity.entropy(np.zeros(4)), math.log(4))


def test_common_prefix() -> None:
    assert fidelity.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert fidelity.common_prefix([1, 2], [1, 2, 3]) == 2
    assert fidelity.common_prefix([], [1]) == 0


def test_client_roundtrips() -> None:
    value = {"b": 30.0, "a": {"y": [1.5, 2.0], "x": True}, "s": "café"}
    py = fidelity.client_roundtrip(value, "python")
    assert py == value and list(py) == ["b", "a", "s"] and isinstance(py["b"], float)
    ts = fidelity.client_roundtrip(value, "typescript")
    assert ts == {"b": 30, "a": {"y": [1.5, 2], "x": True}, "s": "café"}
    assert list(ts) == ["b", "a", "s"] and isinstance(ts["b"], int) and ts["a"]["x"] is True
    go = fidelity.client_roundtrip(value, "go")
    assert list(go) == ["a", "b", "s"] and list(go["a"]) == ["x", "y"]
    with pytest.raises(ValueError):
        fidelity.client_roundtrip(value, "perl")


def test_sampled_ids_spell_the_text(engine: Engine) -> None:
    tok = engine.tokenizer
    rng = np.random.default_rng(3)
    block, _ = fidelity.sampled_dsml(rng)
    text = specials.THINK_END + block
    canonical = tok.encode_segments(template(text))
    split = fidelity.sampled_ids(tok, text, rng, split_prob=1.0)
    assert split != canonical and tok.decode(split) == tok.decode(canonical) == text
    assert fidelity.sampled_ids(tok, text, rng, split_prob=0.0) == canonical


def test_emittable_rejects_markers_fragments_and_added_tokens(engine: Engine) -> None:
    tok = engine.tokenizer
    assert not fidelity.emittable(tok, tok.special_id(specials.THINK_END), "")
    assert not fidelity.emittable(tok, tok.special_id(specials.EOS), "")
    (hello,) = tok.encode_text("hello")
    assert fidelity.emittable(tok, hello, "so ")
    (gt,) = tok.encode_text(">")
    assert not fidelity.emittable(tok, gt, "x </think")  # would spell </think> as text
    fragment = next(t for t in tok.encode_text("😀") if tok.token_bytes(t) != "😀".encode())
    assert not fidelity.emittable(tok, fragment, "")


# ---------------------------------------------------------------------------- on the model

SETTINGS = fidelity.Settings(
    conversations=1, positions=4, reasoning_tokens=12, seed=1, split_prob=0.3
)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return fidelity.load_model("tiny", max_len=2048)


@pytest.fixture(scope="module")
def measured(engine: Engine) -> fidelity.ConversationResult:
    return fidelity.measure_conversation(engine, 0, SETTINGS)


def test_the_live_trajectory_went_through_the_live_tool_path(
    engine: Engine, measured: fidelity.ConversationResult
) -> None:
    t = measured.trajectory
    assert t.source == CacheSource.LIVE_TOOL
    p, r, c = len(t.prompt_ids), len(t.reasoning_ids), len(t.call_ids)
    assert t.live_ids[:p] == t.prompt_ids and t.live_ids[p : p + r] == t.reasoning_ids
    assert t.live_ids[p + r : p + r + c] == t.call_ids
    assert t.live_ids[p + r + c] == engine.tokenizer.eos_id  # the EOS fix: evaluated
    assert SETTINGS.reasoning_tokens // 2 <= r and len(t.continuation) == SETTINGS.positions
    tail = engine.tokenizer.decode(t.live_ids[p + r + c :])
    assert tail.startswith(specials.EOS + specials.USER + "<tool_result>")
    assert tail.endswith(specials.ASSISTANT + specials.THINK_START)


def test_the_exact_replay_matches_the_live_state(measured: fidelity.ConversationResult) -> None:
    exact = measured.kinds["exact"]
    assert exact.ids == measured.trajectory.live_ids
    assert exact.kl.shape == (SETTINGS.positions + 1,)
    assert exact.kl.max() <= 1e-5  # quant_sim off: float rounding only
    assert exact.top1.all() and exact.shared_prefix == len(exact.ids)


def test_replays_differ_where_their_factor_says(
    engine: Engine, measured: fidelity.ConversationResult
) -> None:
    tok, t, k = engine.tokenizer, measured.trajectory, measured.kinds
    live = t.live_ids
    # a: reasoning gone, so ids differ from the first reasoning token on
    assert len(k["a"].ids) == len(live) - len(t.reasoning_ids)
    assert k["a"].shared_prefix == len(t.prompt_ids)
    assert k["a"].kl[0] > 1e-4 and np.isfinite(k["a"].kl).all()
    # c: the live text, tokenized canonically (this seed samples non-canonical ids)
    assert measured.reasoning_noncanonical or measured.dsml_noncanonical
    assert tok.decode(k["c"].ids) == tok.decode(live) and k["c"].ids != live
    assert k["c"].kl.max() > 0.0
    # the splices agree with the renderer where nothing is left to retokenize
    canonical = fidelity.canonical_call_ids(tok, t)
    assert fidelity.splice_ids(t, reasoning=False, call=canonical) == k["a+b+c"].ids
    exact_bytes = tuple(tok.encode_segments(template(t.raw_dsml)))
    assert fidelity.splice_ids(t, reasoning=False, call=exact_bytes) == k["a+c"].ids
    assert k["b"].ids == fidelity.splice_ids(t, call=canonical)
    assert measured.dsml_changed == (tok.decode(k["b"].ids) != tok.decode(live))
    for kind in fidelity.KINDS:
        r = k[kind]
        assert r.ids[: len(t.prompt_ids)] == t.prompt_ids
        assert 0.0 <= r.top1.mean() <= 1.0 and (r.kl >= 0).all()


def test_summary_and_table(measured: fidelity.ConversationResult) -> None:
    report = fidelity.Report(SETTINGS, [measured, measured], np.array([0.5]), np.array([False]))
    rows = fidelity.summarize(report)
    assert [r.kind for r in rows] == [*fidelity.KINDS, fidelity.OTHER]
    exact = rows[0]
    assert exact.top1_first == 1.0 and exact.identical == 2 and exact.shared_fraction_mean == 1
    table = fidelity.format_table(rows)
    assert all(kind in table for kind in fidelity.KINDS)
    counts = fidelity.factor_counts(report)
    assert counts["conversations"] == 2
    assert sum(counts[f"client {c}"] for c in fidelity.CLIENTS) == 2
    # the conclusion is written from the run's figures, not typed in beside them
    text = fidelity.conclusions(report, rows)
    by = {r.kind: r for r in rows}
    assert text.startswith("From this run (2 conversations")
    assert "**The live path is exact.**" in text
    for kind in ("a", "b", "c", "b+c", "a+b+c"):
        assert f"{by[kind].kl_first_mean:.3g}" in text
    assert f"{by['a+b+c'].shared_fraction_mean:.1%}" in text
    broken = [replace(r, kl_all_mean=0.1) if r.kind == "exact" else r for r in rows]
    assert "NOT exact" in fidelity.conclusions(report, broken)


# ------------------------------------------------- state-dtype drift, on the trained demo model


def test_state_dtype_drift_along_a_demo_tool_loop() -> None:
    """f32 against itself is exactly the same; an fp8 state moves the distributions (the
    measure can fail), and on the trained model the loop is the model's own."""
    engine = fidelity.load_model("demo", max_len=1024)
    (task,) = held_out_tasks(1, HELD_OUT_SEED, "single")
    ids, mask = loop = fidelity.demo_loop(engine.tokenizer, task, thinking=False)
    assert mask.any() and ids[-1] == engine.tokenizer.eos_id  # the answer's EOS, forced
    drift = fidelity.state_dtype_drift(engine, [loop], ("f32", "fp8"))
    same, fp8 = drift["f32"], drift["fp8"]
    assert same.kl.shape == same.top1.shape == (len(ids) - 1,)
    assert (same.kl == 0).all() and same.top1.all()
    s, everywhere = fp8.summary(), fp8.summary(assistant=False)
    assert s["positions"] == mask[1:].sum() and everywhere["positions"] == len(ids) - 1
    assert s["kl_mean"] > 0 and everywhere["kl_max"] > 0 and 0 < everywhere["top1"] <= 1
    assert s["forced_top1"] > 0.9
    table = fidelity.format_drift(drift)
    assert "\nfp8    assistant" in table and "1 loops" in table
