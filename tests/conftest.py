"""Suite-wide setup: CPU JAX, and one persistent XLA compilation cache shared by this process
and the subprocesses tests start (CLI, server, 8-device sharding), so each program compiles
once per run."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "xla"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each JIT-compiled
    kernel's code into the process, and one module's programs took 2,000–5,000 memory
    mappings (measured from /proc/self/maps); over the whole suite in one process that
    passed Linux's default `vm.max_map_count` of 65,530, and LLVM aborted the process
    ("Unable to allocate section memory") while compiling a late test. Programs a later
    module needs again come back from the persistent compilation cache."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
