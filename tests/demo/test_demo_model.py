"""The shipped demo model's quality bar (issue 9): greedy, on 50 held-out prompts, at least
90% make one parseable call of the right tool with the right arguments and, after the
tool result, answer with text containing the result. Each loop's second request must
continue the live state, reusing exactly the first request's prompt + output."""

from __future__ import annotations

import pytest

from ds4jax.demo.corpus import held_out_tasks
from ds4jax.demo.evaluate import HELD_OUT_SEED, run_loop, training_prompts
from ds4jax.demo.train import DEMO_DIR
from ds4jax.engine import Engine
from ds4jax.model.checkpoint import load_model


@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg, params, tokenizer, _ = load_model(DEMO_DIR)
    return Engine(cfg, params, tokenizer, max_len=1024)


def test_shipped_checkpoint_is_small_and_self_describing() -> None:
    size = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert size <= 20 * 2**20, f"demo checkpoint is {size / 2**20:.1f} MB"
    assert (DEMO_DIR / "demo.model").is_file() and (DEMO_DIR / "training.json").is_file()


@pytest.mark.parametrize(("thinking", "n"), [(True, 50), (False, 20)])
def test_held_out_tool_loops(engine: Engine, thinking: bool, n: int) -> None:
    tasks = held_out_tasks(n, HELD_OUT_SEED, training_prompts(DEMO_DIR))
    outcomes = [run_loop(engine, t, thinking=thinking) for t in tasks]
    bad = [(o.task.prompt, o.call, o.answer) for o in outcomes if not o.ok]
    assert sum(o.ok for o in outcomes) >= 0.9 * n, bad
    for o in outcomes:
        if o.call is not None:
            assert o.continued_live and o.cache_read == o.first_total
