"""The shipped demo model's quality bars (issues 9 and 18), greedy, on 50 held-out tasks of
each kind composed from templates training never saw: single calls ≥ 90% right (tool,
arguments, and an answer quoting the result), parallel calls ≥ 80% all right, follow-up
rounds ≥ 80% right, out-of-scope prompts ≥ 90% without a call. Every tool-result turn
continues the live state, with as many ids as calls.
"""

from __future__ import annotations

import pytest

from ds4jax.chat.tokenizer import load_tokenizer
from ds4jax.demo.evaluate import BARS, Outcome, main, score
from ds4jax.demo.train import DEMO_DIR
from ds4jax.engine import Engine
from ds4jax.weights.checkpoint import load_model

#: its held-out evaluation decodes long: compiled as served (`tests/conftest.py`)
pytestmark = pytest.mark.optimized

N = 50


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[Outcome]]:
    cfg, params, tokenizer, _ = load_model(DEMO_DIR, load_tokenizer=load_tokenizer)
    return score(Engine(cfg, params, tokenizer, max_len=1024), N)


def _right(outcomes: dict[str, list[Outcome]], kind: str) -> tuple[int, list]:
    got = outcomes[kind]
    assert len(got) == N
    bad = [([r.prompt for r in o.task.rounds], [(r.calls, r.answer) for r in o.rounds])
           for o in got if not o.ok]  # fmt: skip
    return N - len(bad), bad


def test_shipped_checkpoint_is_small_and_self_describing() -> None:
    size = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert size <= 20 * 2**20, f"demo checkpoint is {size / 2**20:.1f} MB"
    assert (DEMO_DIR / "demo.model").is_file() and (DEMO_DIR / "training.json").is_file()


@pytest.mark.parametrize("kind", list(BARS))
def test_held_out_bar(outcomes: dict[str, list[Outcome]], kind: str) -> None:
    right, bad = _right(outcomes, kind)
    assert right >= BARS[kind] * N, bad


def test_every_tool_result_turn_continues_live(outcomes: dict[str, list[Outcome]]) -> None:
    """Whatever the calls' arguments, their results continue the live state by their ids:
    one, two or three (the set-equality path of live continuation)."""
    rounds = [r for got in outcomes.values() for o in got for r in o.rounds if r.ids]
    assert rounds and all(r.continued_live for r in rounds)
    assert {r.ids for r in rounds} >= {1, 2, 3}
    assert {r.ids for r in rounds if r.calls_ok} >= {1, 2}


def test_evaluate_serves_from_states_of_the_dtype_asked(capsys: pytest.CaptureFixture) -> None:
    """`--state-dtype` reaches the engine's config (no task run: `-n 0`)."""
    assert main(["-n", "0", "--state-dtype", "fp8"]) == 0
    assert capsys.readouterr().out.startswith("state dtype fp8, thinking on")
