"""`serve --state-dtype`, `--state-memory`, `--paged` as the engine receives them: the state
dtype reaches the model config and the page store, the budget is the memory asked for,
and a paged pool starts small whatever the budget (it grows with the tokens held)."""

from __future__ import annotations

import argparse

from ds4jax import native
from ds4jax.engine.paging import PAGED_START
from ds4jax.model.pages import page_bytes
from serve.main import add_arguments, build_engine, default_state_dtype, default_state_memory


def _engine(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine, banner = build_engine(parser.parse_args(["--config", "tiny", "--ctx", "4096",
                                                     *flags]))  # fmt: skip
    return engine, banner


def test_fp8_paged_states_with_a_memory_budget() -> None:
    engine, banner = _engine("--paged", "--state-dtype", "fp8", "--state-memory", "0.25")
    assert engine.cfg.state_dtype == "fp8" and engine.pages.dtype == "fp8"
    assert engine.pool.budget == 2**28
    assert engine.pages.limit >= 2**28 // page_bytes(engine.cfg, "fp8")
    assert engine.pages.pool.num_pages == PAGED_START  # not the budget's pages up front
    assert "in pages" in banner and "states fp8" in banner
    # whether the native CPU kernels run (ds4jax.native; on, here) is in the banner
    assert f"native CPU kernels {'on' if native.active() else 'off'}" in banner
    # served end to end with these flags (and the CPU default fp8): the demo server of
    # tests/serve runs `--paged` (DEMO_SERVE_ARGS)


def test_the_default_budget_is_a_share_of_the_memory_after_the_weights() -> None:
    engine, _ = _engine()
    assert engine.cfg.state_dtype == default_state_dtype() == "fp8"  # measured on CPU
    assert engine.pages is None
    assert engine.pool.budget == default_state_memory(engine_weights(engine))
    assert 0 < default_state_memory(0) - default_state_memory(2**20) <= 2**20


def engine_weights(engine) -> int:
    from ds4jax.model.quantized import device_bytes

    return max(device_bytes(engine.params).values())
