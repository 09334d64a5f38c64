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


#: memory mappings past which the compiled programs are dropped: Linux refuses new ones at
#: `vm.max_map_count` (65,530 by default), and one test module adds up to ~5,000
MAPPINGS_LIMIT = 40_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after a test module once the process holds many. XLA:CPU
    maps each JIT-compiled kernel's code into the process, and one module's programs took
    2,000–5,000 memory mappings (measured from /proc/self/maps); over the whole suite in one
    process that passed Linux's `vm.max_map_count`, and LLVM aborted the process ("Unable to
    allocate section memory") while compiling a late test. Dropping them after every module
    cost 170 s of the suite (1,203 s against 1,031), so only past `MAPPINGS_LIMIT`; programs
    a later module needs again come back from the persistent compilation cache."""
    yield
    if _mappings() > MAPPINGS_LIMIT:
        import jax

        jax.clear_caches()
        gc.collect()
