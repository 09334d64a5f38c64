"""The suite's own setup (`tests/conftest.py`): a module not marked `optimized` compiles
unoptimized, whichever modules ran before it on this worker."""

from __future__ import annotations

import jax

from tests.conftest import UNOPTIMIZED


def test_an_unmarked_module_compiles_unoptimized() -> None:
    assert jax.config.read("jax_disable_most_optimizations") is UNOPTIMIZED
