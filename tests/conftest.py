"""Suite-wide setup: CPU JAX, and one persistent XLA compilation cache shared by this process
and the subprocesses tests start (CLI, server, 8-device sharding), so each program compiles
once per run."""

from __future__ import annotations

import os
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "xla"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
