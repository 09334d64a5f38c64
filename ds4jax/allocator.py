"""glibc malloc thresholds for a serving process (issue 27).

XLA:CPU allocates a program's outputs and temporaries on every call. glibc's malloc maps
an allocation above its mmap threshold afresh and unmaps it when freed, and trims the
heap's free top past its trim threshold, so each call of a decode step or a burst faults
its buffers' pages in again: a burst's logits for 8 rows are 16 MB, ~4,000 faults; the
non-greedy sampling of 8 rows ran 5–7 ms, 1.0–2.0 ms with the thresholds raised
(`perf stat`: 210–355k page faults in that run → 72–80k), and a bench-192m burst 9–15%
faster a token at B = 1, 4, 8 (one run each way, 10 rounds, minor faults 493k → 362k).

glibc reads its tunables only when a process starts, and `mallopt` caps the mmap
threshold at 32 MiB (a step's temporaries at B=8 are one larger block), so the process
runs itself again with `GLIBC_TUNABLES` set (`reexec`): allocations up to 64 MiB come
from the heap and stay mapped after their call, and up to 256 MiB of free heap top is
kept rather than trimmed — a state above 64 MiB is still mapped on its own and returned
to the system when freed. `DS4JAX_MALLOC=default` keeps glibc's defaults; a
`GLIBC_TUNABLES` already set is left as it is.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLES = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456"


def wanted(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether a process with `environ` should run again with `TUNABLES`."""
    return (sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
            and "GLIBC_TUNABLES" not in environ
            and environ.get("DS4JAX_MALLOC", "") != "default")  # fmt: skip


def reexec() -> None:
    """Replace this process (same pid, same command line) by one started with `TUNABLES`,
    where `wanted`; otherwise return. Call it first thing in a program's entry point —
    never from a library function, whose caller's process it would replace."""
    if not wanted(os.environ):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {**os.environ, "GLIBC_TUNABLES": TUNABLES})  # fmt: skip
