"""Suite-wide setup: CPU JAX, and one persistent XLA compilation cache shared by this process
and the subprocesses tests start (CLI, server, 8-device sharding), so each program compiles
once per run."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "xla"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
#: XLA's backend optimizations off (LLVM's passes over each compiled kernel), for this process and
#: every subprocess tests start: most of the suite's time is compiling programs that then run
#: a few times (−35% compile CPU for the tiny model's programs, which run ~3× slower). The HLO
#: passes still run; the modules marked `optimized` compile as served (`_xla_optimizations`).
#: `JAX_DISABLE_MOST_OPTIMIZATIONS=0 make test` compiles the whole suite as served.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
import jax  # noqa: E402 (after the environment it reads)

UNOPTIMIZED: bool = jax.config.read("jax_disable_most_optimizations")

#: XLA:CPU's older kernel emitters, for unoptimized programs only: one tiny engine's warm-up
#: compiled unoptimized in 4.2 s of XLA time instead of 5.4 s (−22%, its programs no slower),
#: where optimized ones took 10.9 s instead of 8.2 s — so the programs of `optimized` modules
#: and of the demo server keep the emitters they are served with (`_emitters_follow`).
EMITTERS = "xla_cpu_use_fusion_emitters"
OLDER_EMITTERS_FLAG = f"--{EMITTERS}=false"
#: `XLA_FLAGS` as the suite found it, for the processes tests start to compile as served
SERVED_XLA_FLAGS = os.environ.get("XLA_FLAGS", "").replace(OLDER_EMITTERS_FLAG, "").strip()


def forced_devices_env(count: int = 8) -> dict[str, str]:
    """The environment of a script that needs `count` CPU devices in one process: this one's,
    with the forced device count added to (not in place of) its XLA_FLAGS."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")


def _emitters_follow() -> bool:
    """Every program this process compiles takes the older emitters when unoptimized and the
    served ones when not, through XLA's per-compile options (the same options
    `jit(...).lower(...).compile(compiler_options=...)` passes; the persistent cache keys
    them). The processes tests start (servers, CLI runs, 8-device scripts) compile
    unoptimized throughout, so for them it is their `XLA_FLAGS`. False, and nothing changed,
    where this jaxlib has no such option (a later XLA may drop it) or JAX no such hook."""
    import jax.numpy as jnp
    from jax._src import compiler

    original = getattr(compiler, "get_compile_options", None)
    if original is None or getattr(original, "emitters_follow", False):
        return original is not None
    # this process's default (its XLA_FLAGS, read as the probe starts the backend): a program
    # compiled with it has the same cache key as in the processes tests start
    older = OLDER_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "")
    try:
        jax.jit(jnp.negative).lower(jnp.zeros(1)).compile(compiler_options={EMITTERS: False})
    except Exception:  # an unknown option: XLA would abort on it in XLA_FLAGS
        return False

    def get_compile_options(*args: Any, **kwargs: Any) -> Any:
        options = original(*args, **kwargs)
        served = not jax.config.read("jax_disable_most_optimizations")
        if served == older:  # the default is not the one wanted
            options.env_option_overrides = [*options.env_option_overrides, (EMITTERS, served)]
        return options

    get_compile_options.emitters_follow = True  # type: ignore[attr-defined]
    get_compile_options.older_by_default = older  # type: ignore[attr-defined]
    compiler.get_compile_options = get_compile_options
    return True


if UNOPTIMIZED and _emitters_follow():
    os.environ["XLA_FLAGS"] = f"{SERVED_XLA_FLAGS} {OLDER_EMITTERS_FLAG}".strip()


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


@pytest.fixture(autouse=True, scope="module")
def _xla_optimizations(request: pytest.FixtureRequest) -> Any:
    """XLA's optimizations on for a module marked `optimized` (its tolerances were set on the
    programs as served, or its programs run long enough to repay the compile). Compiled
    programs stay in memory keyed by their inputs alone, so on a switch they are dropped: a
    module gets its own kind of program (the persistent cache keys the two apart)."""
    import jax

    want = UNOPTIMIZED and request.node.get_closest_marker("optimized") is None
    if jax.config.read("jax_disable_most_optimizations") != want:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", want)
    yield


#: test files that take the longest (seconds of a 2-worker run, 2026-12-05), run first: the
#: workers take whole files in collection order (`make test`: `--dist loadfile
#: --no-loadscope-reorder`), so the long ones start early and the short ones fill the gaps
#: at the end, instead of one long file running alone while the other worker idles. The
#: first, test_multihost.py, brings the files sharing the demo server with it (~420 s).
LONGEST_FIRST = (
    "tests/serve/test_multihost.py",
    "tests/model/test_data_shards.py",
    "tests/continuation/test_batching.py",
    "tests/model/test_sharding.py",
    "tests/continuation/test_paged_rows.py",
    "tests/continuation/test_speculative_engine.py",
    "tests/serve/test_socket.py",
    "tests/test_notebook.py",
    "tests/demo/test_demo_model.py",
    "tests/pallas_kernels/test_kernels.py",
    "tests/continuation/test_spans.py",
    "tests/continuation/test_paged_frontiers.py",
    "tests/continuation/test_logprobs.py",
    "tests/demo/test_demo_mtp.py",
    "tests/model/test_paged_batch.py",
    "tests/model/test_batch.py",
    "tests/model/test_quantized.py",
)


#: the files that use a session-scoped server of `tests/serve/conftest.py` (the demo's, the
#: speculating demo's): one worker takes them all, so each server starts once per run
#: rather than once on each worker (the demo server's start took 40-100 s of CPU on 2
#: cores); collection fails if another file uses one
SHARED_SERVERS = ("demo_served", "spec_served")
SHARING_FILES = (
    "tests/serve/test_multihost.py",
    "tests/serve/test_demo_served.py",
    "tests/serve/test_logs.py",
    "tests/serve/test_metrics.py",
    "tests/serve/test_speculative_served.py",
)


def _path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        shared = set(SHARED_SERVERS) & set(getattr(item, "fixturenames", ()))
        if shared and _path(item.nodeid) not in SHARING_FILES:
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(shared)}: add its file to tests/conftest.py "
                "SHARING_FILES, so the server is started once"
            )
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_path(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)  # (a run without xdist: `-p no:xdist`)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with `SHARING_FILES` as one work unit. (xdist's own `loadgroup`
    cannot do it under pytest 9: it renames the test ids, which pytest 9 no longer lets a
    plugin do.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesSharingServers(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = _path(nodeid)
            return SHARING_FILES[0] if path in SHARING_FILES else path

    return FilesSharingServers(config, log)
