"""`ds4jax.allocator`: a program's entry runs itself again once with glibc's malloc
thresholds raised, keeping its pid and command line; a caller's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ds4jax import allocator

SHOW = ("import os, sys; from ds4jax import allocator; print('start', flush=True); "
        "allocator.reexec(); "
        "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")  # fmt: skip


def _run(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "DS4JAX_MALLOC")}
    proc = subprocess.Popen([sys.executable, "-c", SHOW, "a", "b"], env={**base, **env},
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    lines = out.splitlines()
    assert lines[-1].startswith(f"{proc.pid} ")  # exec: the same process
    return lines


@pytest.mark.skipif(not allocator.wanted({}), reason="glibc on Linux only")
def test_the_entry_runs_again_with_the_tunables() -> None:
    lines = _run()
    assert lines[:2] == ["start", "start"]  # the code ran twice: before and after the exec
    assert lines[-1].endswith(f"{allocator.TUNABLES} ['a', 'b']")


def test_a_callers_setting_is_kept() -> None:
    lines = _run(DS4JAX_MALLOC="default")
    assert lines[0] == "start" and lines[-1].endswith("None ['a', 'b']") and len(lines) == 2
    lines = _run(GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert len(lines) == 2 and lines[-1].endswith("glibc.malloc.arena_max=2 ['a', 'b']")
    assert not allocator.wanted({"GLIBC_TUNABLES": ""})
    assert not allocator.wanted({"DS4JAX_MALLOC": "default"})
