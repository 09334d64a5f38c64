"""`ds4jax serve`: load (or build) the model, warm it up, serve the Quart app with Hypercorn."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from ds4jax import native
from ds4jax.config import CONFIG_DIR
from ds4jax.continuation.reasoning_seal import ReasoningSeal
from ds4jax.engine import Engine
from ds4jax.interleave import DEFAULT_STALL_BOUND
from ds4jax.model.batch import BATCH_SIZES, BURST_STEPS
from ds4jax.weights.options import add_attention_impl, add_hub_options, add_mesh, add_weights
from serve import logs
from serve.app import ServerConfig, create_app
from serve.metrics import SOURCE_LABELS
from serve.worker import EngineWorker

log = logging.getLogger("ds4jax.serve")

#: `make serve` with no flags: the trained tiny demo model (configs/demo/).
DEFAULT_MODEL = "demo"
FALLBACK_CONFIG = "tiny"
DEFAULT_SEED = 0
DEFAULT_SESSIONS = 4
DEFAULT_MAX_BATCH = 8
#: the share of the memory left after the weights that retained states may take by default
STATE_MEMORY_SHARE = 0.5


def add_arguments(sp: argparse.ArgumentParser) -> None:
    src = sp.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        help="checkpoint directory (Orbax, transformers or official), named model or "
        f"Hugging Face Hub repo id org/name (default {DEFAULT_MODEL}, the trained demo)",
    )
    src.add_argument("--config", help="named config with random weights, e.g. tiny")
    sp.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights seed with --config")
    add_hub_options(sp)
    add_attention_impl(sp)
    add_weights(sp)
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--ctx", type=int, default=8192, help="context size in tokens")
    sp.add_argument("--chunk-sizes", default="4,16,64,256,512",
                    help="prefill chunk sizes, each compiled at start-up (a prompt is cut "
                    "into the largest, its rest padded to the smallest that holds it; "
                    "while others decode, into the largest --stall-bound allows)")  # fmt: skip
    sp.add_argument("--stall-bound", type=float, default=DEFAULT_STALL_BOUND, metavar="X",
                    help="while requests decode, prefill a new prompt in chunks that keep "
                    "their gap between tokens within X decode steps (measured as it runs; "
                    "0: whole chunks, the streams wait)")  # fmt: skip
    sp.add_argument("--burst", type=int, default=BURST_STEPS, metavar="N",
                    help="while the decoding requests only sample and no prompt waits, one "
                    f"program takes up to N tokens each (1…{BURST_STEPS}; 1: a program per "
                    "token; each request's tokens and state are the same either way)")  # fmt: skip
    sp.add_argument("--api-key", default=os.environ.get("DS4JAX_API_KEY"),
                    help="require this key (x-api-key or Bearer); env DS4JAX_API_KEY")  # fmt: skip
    sp.add_argument("--model-name", default="deepseek-v4-flash", help="the model id served")
    sp.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS,
                    help="resident sessions (live frontiers kept at once)")  # fmt: skip
    sp.add_argument("--state-budget-mb", type=int, default=None,
                    help="MB of retained states: sessions, fork points (see "
                    "--state-memory)")  # fmt: skip
    sp.add_argument("--state-memory", type=float, default=None, metavar="GB",
                    help="GB of retained states (sessions, fork points); default: "
                    f"{STATE_MEMORY_SHARE * 100:.0f}%% of the memory left after the weights; "
                    "overrides --state-budget-mb")  # fmt: skip
    sp.add_argument("--host-state-memory", type=float, default=0.0, metavar="GB",
                    help="GB of host RAM for the states of sessions the state budget "
                    "evicts, kept whole to continue later (0: off; one process only)")  # fmt: skip
    sp.add_argument("--paged", action="store_true",
                    help="keep sessions' and fork points' states in 256-token pages, "
                    "shared where they hold the same tokens; the budget counts pages")  # fmt: skip
    sp.add_argument("--state-dtype", choices=["f32", "bf16", "fp8"], default=None,
                    help="how the state holds its KV rows, rounded as they are made on "
                    "every path: fp8 is the release's 584-byte record (default: "
                    "default_state_dtype, by platform; see docs/paged-state.md)")  # fmt: skip
    sp.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                    help="requests decoded together in one step (1, 2, 4 or 8)")  # fmt: skip
    sp.add_argument("--speculative", choices=["mtp"], default=None,
                    help="speculative decoding: the model's MTP block drafts the token after "
                    "each row's next, verified in the same step (exact: greedy output "
                    "is unchanged, sampling keeps its distribution); one device (--mesh "
                    "none)")  # fmt: skip
    sp.add_argument("--speculative-max-batch", type=int, default=None, metavar="B",
                    help="speculate only in steps of at most B rows (default: where it "
                    "was measured to pay on this platform; 0 on CPU)")  # fmt: skip
    add_mesh(sp)
    sp.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="several processes (hosts): process 0's address for "
                    "jax.distributed; process 0 serves HTTP, the others follow")  # fmt: skip
    sp.add_argument("--num-processes", type=int, default=1, help="processes in the group")
    sp.add_argument("--process-id", type=int, default=0, help="this process (0: the server)")
    sp.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                    help="keep checkpoints of decode states in DIR, keyed by rendered "
                    "prompt prefix, so a restart or an evicted session resumes without a "
                    "cold prefill (default: no disk cache)")  # fmt: skip
    sp.add_argument("--kv-disk-space-mb", type=int, default=4096,
                    help="MiB --kv-disk-dir may hold; past it, the checkpoints of lowest "
                    "ds4 score go first (recent hits, decaying, times tokens per byte; "
                    "never the one just written)")  # fmt: skip
    sp.add_argument("--trace", default=None, help="append JSON lines per request to FILE")
    sp.add_argument("--cors", action="store_true", help="send permissive CORS headers")
    sp.add_argument("--queue", type=int, default=16, help="max queued requests (then 503)")
    sp.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, metavar="N",
                    help="largest request body read (then 413; default 32 MiB)")  # fmt: skip
    sp.add_argument("--log-level", default="INFO",
                    help="debug also shows the libraries' own lines (Orbax, JAX)")  # fmt: skip
    sp.add_argument("--stats-interval", type=float, default=10.0,
                    help="seconds between stats lines while there is work (0: none)")  # fmt: skip


def check_listen(host: str, port: int) -> None:
    """Fails now, before the model loads, where the server could not listen (a port in use,
    out of range, an unknown host): else the bind failed only after warm-up, behind a
    "ready on" line."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"ds4jax serve: --port {port}: a port is 0-65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn binds
            probe.bind(address)
    except (OSError, OverflowError) as err:
        raise SystemExit(f"ds4jax serve: cannot listen on {host}:{port}: {err}") from None


#: flags each process of a group may set for itself: where it listens and what it logs
#: (the leader's alone serve HTTP), and the model's path and download directory (hosts may
#: keep the same weights at different paths: the engine's settings are compared once they
#: load)
PROCESS_FLAGS = frozenset({
    "host", "port", "process_id", "api_key", "model_name", "trace", "cors", "queue",
    "max_body_bytes", "log_level", "stats_interval", "kv_disk_space_mb", "model",
    "download_dir", "command", "coordinator",
})  # fmt: skip


def group_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags every process of a group must share, as `--flag value`; --kv-disk-dir by
    whether it is set (each host has its own directory; a follower without one would not
    replay the leader's disk restores)."""
    out = {f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items())
           if k not in PROCESS_FLAGS and not callable(v)}  # fmt: skip
    out["--kv-disk-dir"] = "set" if args.kv_disk_dir else "unset"
    # spelled alike whatever the spacing and order ("4, 16" is "4,16"; the mesh's axes)
    if isinstance(args.chunk_sizes, str):
        out["--chunk-sizes"] = ",".join(p.strip() for p in args.chunk_sizes.split(","))
    if isinstance(args.mesh, str):
        out["--mesh"] = ",".join(sorted(p.replace(" ", "") for p in args.mesh.split(",") if p))
    return out


def check_flags(args: argparse.Namespace) -> None:
    """The sizes no server can run with, refused before it reports ready."""
    if args.sessions < 1:
        raise SystemExit("ds4jax serve: --sessions must be at least 1")
    if args.max_batch not in BATCH_SIZES:
        raise SystemExit(f"ds4jax serve: --max-batch {args.max_batch}: one of "
                         f"{', '.join(map(str, BATCH_SIZES))}")  # fmt: skip
    if args.ctx < 2:  # a prompt and its answer: else every request is refused as too long
        raise SystemExit(f"ds4jax serve: --ctx {args.ctx}: the context holds at least 2 tokens")
    if not args.stats_interval >= 0:  # -1 ran as 0 (no line) unsaid; NaN too
        raise SystemExit(f"ds4jax serve: --stats-interval {args.stats_interval}: seconds ≥ 0 "
                         "(0: no stats line)")  # fmt: skip
    if args.kv_disk_space_mb < 1:  # -1 evicted every checkpoint at start-up; 0 meant 4096
        raise SystemExit(f"ds4jax serve: --kv-disk-space-mb {args.kv_disk_space_mb}: at "
                         "least 1 MiB")  # fmt: skip
    if args.max_body_bytes < 1:
        raise SystemExit(f"ds4jax serve: --max-body-bytes {args.max_body_bytes}: at least 1")
    if args.queue < 1:  # else an idle server answers every request 503 "busy"
        raise SystemExit(f"ds4jax serve: --queue {args.queue}: at least 1 request may wait")
    if args.api_key == "":  # an unset variable expanded empty: never serve open by mistake
        raise SystemExit("ds4jax serve: --api-key (or DS4JAX_API_KEY) is empty; give a key, "
                         "or unset it to serve without one")  # fmt: skip


def build_engine(args: argparse.Namespace) -> tuple[Engine, str]:
    from ds4jax.chat.tokenizer import load_tokenizer
    from ds4jax.model.state import capacity_bytes
    from ds4jax.weights.checkpoint import load_model

    model, config = args.model, args.config
    if model is None and config is None:
        if (CONFIG_DIR / DEFAULT_MODEL).is_dir():
            model = DEFAULT_MODEL
        else:  # a checkout without the trained demo: still serve, with the plumbing model
            config = FALLBACK_CONFIG
    from ds4jax.model.quantized import device_bytes
    from ds4jax.model.sharding import MeshError, Placement

    placement = Placement(args.mesh)
    try:
        cfg, params, tokenizer, banner = load_model(
            model, config, args.seed, load_tokenizer=load_tokenizer,
            attention_impl=args.attention_impl, shardings=placement, weights=args.weights,
            revision=args.revision, download_dir=args.download_dir,
            mtp=args.speculative == "mtp",
        )  # fmt: skip
    except MeshError as err:
        raise SystemExit(f"ds4jax serve: {err}") from err
    cfg = cfg.replace(state_dtype=args.state_dtype or default_state_dtype())
    if model == DEFAULT_MODEL:
        banner += " (the trained demo: it calls add(a, b) and get_weather(city))"
    store = None
    if args.kv_disk_dir:
        from ds4jax.kvstore.disk import DiskStore
        from ds4jax.kvstore.fingerprint import model_fingerprint

        # on every process: over params split across processes it is a collective
        fingerprint = model_fingerprint(cfg, params, tokenizer)
        if args.process_id == 0:  # the only process that touches the disk
            store = DiskStore(args.kv_disk_dir, fingerprint, cfg=cfg, max_len=args.ctx,
                              tokenizer=tokenizer, budget_mb=args.kv_disk_space_mb)  # fmt: skip
    per_device = max(device_bytes(params).values())
    banner += (f"; weights {args.weights}: {per_device / 2**20:.1f} MB per device; states "
               f"{cfg.state_dtype}")  # fmt: skip
    if native.on_cpu():  # built here, at start-up, the first time (seconds, once per machine)
        banner += f"; native CPU kernels {'on' if native.active() else 'off'}"
    mesh = placement.mesh
    if args.num_processes > 1:
        import jax

        if mesh is None or mesh.size != jax.device_count():
            raise SystemExit(
                f"ds4jax serve: {args.num_processes} processes need a --mesh over all "
                f"{jax.device_count()} devices (got {'none' if mesh is None else mesh.size})"
            )
        banner += f"; process {args.process_id} of {args.num_processes}"
    if mesh is not None:
        banner += f"; mesh {dict(mesh.shape)}"
    per_state = capacity_bytes(cfg, args.ctx)
    if args.state_memory is not None:
        budget = int(args.state_memory * 2**30)
    elif args.state_budget_mb is not None:
        budget = args.state_budget_mb * 2**20
    else:
        budget = default_state_memory(per_device)
    try:
        chunks = sorted({int(c) for c in args.chunk_sizes.split(",") if c.strip()})
    except ValueError:
        chunks = []
    if not chunks or chunks[0] < 1:
        raise SystemExit(
            f"ds4jax serve: --chunk-sizes {args.chunk_sizes!r}: give sizes like 64,512"
        )
    if args.stall_bound and args.stall_bound < 1:
        raise SystemExit(f"ds4jax serve: --stall-bound {args.stall_bound}: 0 (off) or ≥ 1")
    paged = {}
    if args.paged:
        paged = {"paged_pages": paged_pool_size(cfg, args.ctx, budget, args.max_batch)}
    try:
        engine = Engine(
            cfg, params, tokenizer, max_len=args.ctx, store=store, sessions=args.sessions,
            fork_points=True, state_budget_bytes=budget, max_batch=args.max_batch, mesh=mesh,
            chunk_sizes=chunks, host_budget_bytes=int(args.host_state_memory * 2**30) or None,
            stall_bound=args.stall_bound or None, speculative=args.speculative,
            speculative_max_batch=args.speculative_max_batch, burst=args.burst, **paged,
        )  # fmt: skip
    except ValueError as err:  # a state budget that holds no state, a batch the mesh cannot split
        raise SystemExit(f"ds4jax serve: {err}") from err
    banner += f"; {args.sessions} sessions, batches of up to {engine.max_batch}, "
    if engine.spec is not None:
        banner += f"speculative (MTP) in steps of up to {engine.spec_max_batch} rows, "
    if engine.pages is None:
        banner += (f"state budget {budget / 2**20:.0f} MB ({per_state / 2**20:.1f} MB per "
                   "session or fork point)")  # fmt: skip
    else:
        p = engine.pages
        banner += (f"state budget {budget / 2**20:.0f} MB in pages ({p.pool.num_pages - 1} "
                   f"pages of {p.page_nbytes / 2**20:.2f} MB + {p.small_nbytes / 2**20:.2f} "
                   "MB per frontier)")  # fmt: skip
        if engine.shards > 1:  # issue 28: each data shard's devices hold their block only
            banner += (f", split over data={engine.shards}: {p.pool.block - 1} pages "
                       f"({(p.pool.block - 1) * p.page_nbytes / 2**20:.0f} MB) on each "
                       "shard's devices, taken up front")  # fmt: skip
    if store is not None:
        # exact DSML replay survives a restart: tool ids → sampled bytes, before any request
        for tid, block in store.tool_entries().items():
            engine.tool_memory.remember([tid], block)
        banner += f"; disk checkpoints in {args.kv_disk_dir}"
    return engine, banner


#: `--state-dtype` by platform, where measured (docs/paged-state.md): on CPU the
#: release's fp8 record costs no speed (bench context: decode 67.5 vs 61.4 tok/s, prefill
#: equal) and the demo's held-out evaluation is within one task of f32 (identical with
#: thinking on); GPU and TPU are not measured yet, so they keep f32
STATE_DTYPE_BY_PLATFORM = {"cpu": "fp8"}


def default_state_dtype() -> str:
    import jax

    return STATE_DTYPE_BY_PLATFORM.get(jax.default_backend(), "f32")


def default_state_memory(weights_per_device: int) -> int:
    """`STATE_MEMORY_SHARE` of what a device has left after the weights: its memory limit
    where the platform reports one (GPU, TPU), else this host's RAM (CPU). A bound, not an
    allocation: states cost what their tokens hold (`model.state.spans`, paged pools
    that grow)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    total = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, int(STATE_MEMORY_SHARE * (total - weights_per_device)))


def paged_pool_size(cfg: Any, ctx: int, budget: int, max_batch: int) -> int:
    """Pages for `--paged`: the budget's worth, and room for what the requests in flight
    keep before the budget's evictions run (each row: its prompt end, the state before
    `<think>`, its reply's frontier, each up to the context)."""
    from ds4jax.kvstore.pages import pages_for
    from ds4jax.model.pages import page_bytes

    return -(-budget // page_bytes(cfg, cfg.state_dtype)) + 3 * max_batch * pages_for(ctx) + 1


def trace_hook(path: str, tokenizer: Any):
    """`--trace`: one JSON line per finished request, its path named as the log line and
    `/metrics` name it (`cold`, `fork_point`, `live_tool_ids`…: `SOURCE_LABELS`). `prompt`
    and `prompt_tokens` are what the engine evaluated — on a live continuation the state's
    own sampled ids, its reasoning included, whatever the client sent back; where the
    client's history renders otherwise, `client_prompt` / `client_prompt_tokens` hold that
    (a study of the fallbacks needs both)."""

    def write(job: Any, result: Any) -> None:
        client = "".join(s.text for s in job.prepared.view.segments)
        rec = {"time": time.time(), "prompt": client,
               "prompt_tokens": job.prepared.prompt_tokens}  # fmt: skip
        if isinstance(result, Exception):
            rec["error"] = repr(result)
        else:
            ids = result.evaluated[: result.prompt_tokens]
            if ids and ids != job.prepared.view.tokens:  # (decoded only then: this runs on
                rec["prompt"], rec["prompt_tokens"] = tokenizer.decode(list(ids)), len(ids)
                rec["client_prompt"] = client  # the engine's thread)
                rec["client_prompt_tokens"] = job.prepared.prompt_tokens
            rec |= {
                "source": SOURCE_LABELS[result.source],
                "session": result.session,
                "forked_from": result.forked_from,
                "restored": result.restored,
                "cached": result.cached,
                "prefilled": result.prefilled,
                "output_tokens": result.output_tokens,
                "finish": result.finish,
                "prefill_seconds": round(result.prefill_seconds, 4),
                "text": result.raw_text,
            }
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")

    return write


#: seconds a failed group's server keeps answering /health with 503 before it exits
FAILED_EXIT_DELAY_S = 2.0


def group_failed(dead: list[int], config: ServerConfig, worker: EngineWorker) -> None:
    """A process of the group is gone: no step can run without it (and one running may
    never return), so fail health, answer every open request (a stream its error event),
    say which, and exit non-zero without waiting."""
    who = ", ".join(map(str, dead)) if dead != [-1] else "the coordination service"
    config.state = f"failed: process {who} stopped"
    worker.fail(f"process {who} of the serving group stopped")
    log.error("process %s of the group stopped: no engine step can run without it; "
              "exiting", who)  # fmt: skip
    time.sleep(FAILED_EXIT_DELAY_S)
    sys.stderr.flush()
    os._exit(3)


def served_info(args: argparse.Namespace, engine: Engine) -> dict[str, str]:
    """`ds4jax:model_config_info`'s labels: what an operator asks of a running server."""
    mesh = getattr(engine, "mesh", None)
    return {
        "model": str(args.model or (DEFAULT_MODEL if args.config is None else "")),
        "config": str(args.config or ""),
        "weights": str(args.weights),
        "attention_impl": str(engine.cfg.attention_impl),
        "mesh": ",".join(f"{k}={v}" for k, v in mesh.shape.items()) if mesh else "none",
        "context": str(engine.max_len),
        "sessions": str(args.sessions),
        "max_batch": str(engine.max_batch),
        "processes": str(args.num_processes),
    }


async def warmed_up(engine: Any, stop: asyncio.Event) -> bool:
    """`engine.warm_up` off the event loop; False if `stop` came first (a SIGTERM while
    compiling must not wait minutes for the compiles, then report ready)."""
    warm = asyncio.ensure_future(asyncio.to_thread(engine.warm_up))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({warm, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not warm.done():
        return False
    stopped.cancel()
    await warm  # its error, if it failed
    return True


def serve(args: argparse.Namespace) -> int:
    logs.configure(args.log_level)
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HyperConfig

    t0 = time.perf_counter()
    group = args.num_processes > 1
    check_flags(args)
    if not group or args.process_id == 0:  # the process that listens
        check_listen(args.host, args.port)
    if group:
        if not args.coordinator or not 0 <= args.process_id < args.num_processes:
            raise SystemExit(
                "ds4jax serve: several processes need --coordinator HOST:PORT and a "
                "--process-id between 0 and --num-processes - 1"
            )
        from ds4jax import distributed

        print(f"ds4jax: joining the group at {args.coordinator} as process "
              f"{args.process_id} of {args.num_processes} (waiting up to "
              f"{distributed.JOIN_TIMEOUT_S} s for every process: DS4JAX_JOIN_TIMEOUT_S)",
              file=sys.stderr, flush=True)  # fmt: skip
        # the runtime's own timeout aborts the process from C++ with a stack dump: this
        # timer says it first, in one line, and exits 2
        late = threading.Timer(distributed.JOIN_TIMEOUT_S, lambda: (print(
            f"ds4jax serve: not every process of the group joined {args.coordinator} within "
            f"{distributed.JOIN_TIMEOUT_S} s ({args.num_processes} expected); exiting",
            file=sys.stderr, flush=True), os._exit(2)))  # fmt: skip
        late.daemon = True
        late.start()
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        late.cancel()
        print(f"ds4jax: the group's {args.num_processes} processes joined", file=sys.stderr,
              flush=True)  # fmt: skip
        distributed.agree("flags", group_flags(args))  # before the weights load
    engine, banner = build_engine(args)
    print(f"ds4jax: {banner}", file=sys.stderr, flush=True)
    if group:
        distributed.agree("engine settings", distributed.engine_settings(engine),
                          timeout_s=distributed.LOAD_TIMEOUT_S)  # fmt: skip
        channel = distributed.Channel()
        if args.process_id:
            if args.kv_disk_dir:
                engine.store = distributed.FollowerStore(channel, engine.cfg, engine.max_len)
            print("ds4jax: following process 0", file=sys.stderr, flush=True)
            return distributed.follow(engine, channel)
        if args.kv_disk_dir:
            engine.store = distributed.LeaderStore(engine.store, channel)
        engine = distributed.Leader(engine, channel)
        if args.kv_disk_dir:  # the followers' tool memory, as the leader read it from disk
            engine.remember(engine.store.tool_entries())
    worker = EngineWorker(engine, max_queue=args.queue)
    worker.hooks.append(lambda job, result: log.info("%s", logs.request_line(job, result)))
    if args.trace:
        worker.hooks.append(trace_hook(args.trace, engine.tokenizer))
    config = ServerConfig(model_name=args.model_name, api_key=args.api_key, cors=args.cors,
                          max_body_bytes=args.max_body_bytes,
                          info=served_info(args, engine))  # fmt: skip
    if args.kv_disk_dir:  # Responses reasoning seals stay valid across restarts
        config.seal = ReasoningSeal.in_dir(args.kv_disk_dir)
    app = create_app(worker, config)

    hc = HyperConfig()
    hc.bind = [f"{args.host}:{args.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")  # our handler and format, once
    hc.graceful_timeout = 5

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        worker.start()
        if group:
            engine.watch(lambda dead: group_failed(dead, config, worker))

        async def shutdown() -> None:
            """What a signal starts, before Hypercorn closes anything: the running requests
            are cancelled and the queued refused (`EngineWorker.stop`), so every open
            connection gets its 503 or its stream's error event while it is still open."""
            await stop.wait()
            await loop.run_in_executor(None, worker.stop)

        server = asyncio.ensure_future(hypercorn_serve(app, hc, shutdown_trigger=shutdown))
        print("ds4jax: compiling and warming up …", file=sys.stderr, flush=True)
        if not await warmed_up(engine, stop):  # a signal during warm-up: nothing to keep
            print("ds4jax: stopped during warm-up", file=sys.stderr, flush=True)
            os._exit(0)  # the compiling thread cannot be interrupted; no session exists yet
        if server.done() or stop.is_set():  # it could not listen after all, or was stopped
            await server  # its error, or its clean stop: never "ready on"
            if stop.is_set():
                print("ds4jax: stopped", file=sys.stderr, flush=True)
                return
        config.state = "ready"
        stats = None
        if args.stats_interval > 0:
            stats = logs.StatsLine(app.metrics, args.stats_interval).start()
        print(
            f"ds4jax: ready on http://{args.host}:{args.port} ({time.perf_counter() - t0:.1f}s)",
            file=sys.stderr,
            flush=True,
        )
        await server
        if stats is not None:
            stats.stop()
        # (done at the signal already, while the connections were open: here for a server
        # that ended otherwise) cancel the running requests at their next step, refuse the
        # queued ones, then let the store keep the live frontiers (the shutdown save)
        await loop.run_in_executor(None, worker.stop)
        try:
            await loop.run_in_executor(None, engine.shutdown)
        except Exception as err:  # a group whose step never returned
            if not group or not isinstance(err, distributed.GroupStuck):
                raise
            print(f"ds4jax: {err}; exiting without the shutdown save", file=sys.stderr,
                  flush=True)  # fmt: skip
            os._exit(1)  # the stuck step's thread cannot be joined
        print("ds4jax: stopped", file=sys.stderr, flush=True)

    asyncio.run(main())
    return 0
