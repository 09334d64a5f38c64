"""The suite's own setup (`tests/conftest.py`): a module not marked `optimized` compiles
unoptimized, whichever modules ran before it on this worker, with XLA:CPU's older kernel
emitters; the programs of marked modules compile with the emitters they are served with."""

from __future__ import annotations

import os

import jax
import pytest
from jax._src import compiler

from tests.conftest import EMITTERS, OLDER_EMITTERS_FLAG, UNOPTIMIZED


def test_an_unmarked_module_compiles_unoptimized() -> None:
    assert jax.config.read("jax_disable_most_optimizations") is UNOPTIMIZED


def older_emitters() -> bool:
    """Whether a program this process compiles now takes the older emitters: an override in
    its compile options, else the XLA_FLAGS this process started its backend with."""
    overrides = dict(compiler.get_compile_options(1, 1).env_option_overrides)
    if EMITTERS in overrides:
        return str(overrides[EMITTERS]).lower() == "false"
    return compiler.get_compile_options.older_by_default


@pytest.mark.skipif(not UNOPTIMIZED, reason="JAX_DISABLE_MOST_OPTIMIZATIONS=0: all as served")
def test_only_unoptimized_programs_take_the_older_emitters() -> None:
    assert getattr(compiler.get_compile_options, "emitters_follow", False)
    assert older_emitters()
    assert OLDER_EMITTERS_FLAG in os.environ["XLA_FLAGS"]  # what started processes take
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        assert not older_emitters()
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
