"""A process killed (SIGKILL) in the middle of a save leaves no checkpoint behind: only a
`.tmp-` directory, which the next start removes, and the earlier checkpoints load intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ds4jax.chat.segments import join
from ds4jax.kvstore.checkpoint import sha1_hex
from tests.kvstore.conftest import convo, fake_state, make_store, states_equal, tokens_for

ROOT = Path(__file__).resolve().parents[2]

# The child saves one checkpoint, then starts a second save and stops at `phase`, printing
# the marker for the parent to kill it there: "payload" while Orbax is writing the arrays
# (its async save launched, not awaited), "rename" when everything is written but the final
# rename has not happened.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    directory, phase = sys.argv[1], sys.argv[2]
    from ds4jax.config import load_config
    from ds4jax.kvstore import disk
    from tests.kvstore.conftest import convo, fake_state, make_store, tokens_for

    cfg = load_config("tiny").replace(vocab_size=1024)
    store = make_store(directory, cfg)
    store.save(tokens_for(100, 1), convo("system", "first"), fake_state(cfg, 100, 1), "evict", None)
    if phase == "payload":
        def stuck(path, arrays):
            import orbax.checkpoint as ocp
            ocp.StandardCheckpointer().save(path, dict(arrays))
            print("KILL ME", flush=True)
            time.sleep(120)
        disk._write_payload = stuck
    else:
        real_rename = os.rename
        def stuck(src, dst):
            if os.path.basename(src).startswith(".tmp-"):
                print("KILL ME", flush=True)
                time.sleep(120)
            real_rename(src, dst)
        disk.os.rename = stuck
    state = fake_state(cfg, 300, 2)
    store.save(tokens_for(300, 2), convo("system", "second"), state, "evict", None)
    print("NOT KILLED", flush=True)
    """
)


def start(directory: Path, phase: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), phase],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_a_save_killed_midway_leaves_no_checkpoint(tmp_path, cfg) -> None:
    phases = ("payload", "rename")
    procs = {p: start(tmp_path / p, p) for p in phases}  # both at once: two cores
    try:
        for phase, proc in procs.items():
            deadline = time.monotonic() + 120
            line = ""
            while time.monotonic() < deadline and line.strip() != "KILL ME":
                line = proc.stdout.readline()
                assert line, f"{phase}: the child exited before the save"
            time.sleep(0.2 if phase == "payload" else 0)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGKILL
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    first = sha1_hex(join(convo("system", "first")).encode())
    for phase in phases:
        directory = tmp_path / phase
        leftovers = sorted(p.name for p in directory.iterdir())
        assert first in leftovers and any(n.startswith(".tmp-") for n in leftovers), leftovers
        store = make_store(directory, cfg)
        assert sorted(p.name for p in directory.iterdir()) == [first]
        assert [c["key"] for c in store.checkpoints()] == [first]
        assert store.lookup(convo("system", "second")) is None
        hit = store.lookup(convo("system", "first", "more"))
        assert hit.tokens == tokens_for(100, 1)
        assert states_equal(hit.load(), fake_state(cfg, 100, 1))
