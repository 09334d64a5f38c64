"""The engine: the single owner of the params and of every retained state.

A request: validate (`prepare`, on the client's thread) → `submit` → the scheduler
(`tick`, one thread at a time under a lock; the server gives it one worker thread) routes
it (`continuation.pool.route`: a session and a decision) → prefills the suffix one chunk
per step (while other rows decode, a bounded chunk inside their step: `interleave`) →
retains the prompt-end state as a fork point → decodes it in a row of the batched step
(`model.batch`) beside every other active request, with sampling, forcing and stop
conditions per row (`decoding.RowDecoder`) and events through the streaming DSML
parser → updates that session's frontier and bindings → drops what the state budget no
longer holds (`pool.evictions`, saved to disk first when a store is configured). A live
frontier is replaced, never mutated, and only after the step that produced it finished; a
cancelled or failed request leaves a consistent frontier (the last evaluated token). Fork
points hold prompt ends only, never a state that would paper over a tool-id mismatch.

With a page pool (`paged_pages`, `serve --paged`) retained frontiers are page tables and
small parts (`kvstore.page_store`), and so are the decode rows: a row holds its own
references to the prompt end's pages and grows its table by a token before each step
(`PagePool.advance`, which copies a partial page another frontier wrote past), the step
reads and writes pages through the tables (`model.batch.paged_step`), and the row leaves
as a frontier of its pages, no row copied. A row the full pool cannot grow, even after
fork points and idle sessions gave up what they alone held, ends with a 529.

`Engine(...)` alone is the single-session engine of the original rules (one session, no
fork points, one request at a time); `ds4jax serve` runs it with `--sessions` (default 4),
fork points on and `--max-batch` (default 8).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from ds4jax.chat import specials
from ds4jax.chat.anthropic import MessagesRequest
from ds4jax.chat.conversation import Conversation
from ds4jax.chat.dsml_parse import (
    Event,
)
from ds4jax.chat.render import render
from ds4jax.chat.segments import Segment, normalize
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.config import Config
from ds4jax.continuation.evidence import attach_tool_memory, tool_tail, validate_tool_results
from ds4jax.continuation.pool import (
    Pool,
    Route,
    Session,
    evictions,
    held_bytes,
    host_victims,
    route,
)
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.continuation.types import (
    Bindings,
    CacheSource,
    Decision,
    LiveFrontier,
    Rejection,
    RequestView,
    source_label,
)
from ds4jax.decoding import Result, RowDecoder, TokenLogprob, ToolCallStarted, token_logprob
from ds4jax.interleave import TickCosts, chunk_limit
from ds4jax.kvstore.background import BackgroundSaves
from ds4jax.kvstore.host import HostState, to_host
from ds4jax.kvstore.page_store import PageStore
from ds4jax.kvstore.pages import OutOfPages, PageTable, pages_for, shard_for
from ds4jax.kvstore.store import KVStore, NoStore
from ds4jax.model import batch as batch_ops
from ds4jax.model.forward import CHUNK_SIZES, plan_chunks, prefill
from ds4jax.model.page_io import PagedFrontier, small_part
from ds4jax.model.params import Params
from ds4jax.model.sharding import DATA_AXIS, batch_sharding, fetch, replicated
from ds4jax.model.speculative import paged_verify_rows, verify_rows
from ds4jax.model.state import (
    SPAN_BASE,
    capacity_bytes,
    holds,
    init_state,
    resize,
    span_for,
    spans,
)
from ds4jax.sampling import MAX_LOGPROBS
from ds4jax.speculation import Speculator, default_max_batch

log = logging.getLogger("ds4jax.engine")

THINK_START_SEGMENT = Segment(specials.THINK_START, True)


def _on_host(tree: Any) -> Any:
    """Leaves this process holds whole as numpy, to be placed afresh; an array spread over
    processes stays as it is (it is resharded where it stands)."""
    return jax.tree.map(
        lambda x: np.asarray(x) if getattr(x, "is_fully_addressable", True) else x, tree
    )


#: pages a paged pool starts with; it doubles as frontiers need more, up to its budget
PAGED_START = 64


class EngineError(RuntimeError):
    """A request the engine refuses; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


@dataclass(frozen=True)
class SamplingParams:
    """How a row picks its tokens (`sampling.sample_rows`), and what it reports of them.

    `logprobs`: None (off) or k in 0..`sampling.MAX_LOGPROBS`: every output token comes
    with its log-probability and the k most likely tokens at its position (a
    `decoding.TokenLogprob`, emitted and kept in `Result.logprobs`), forced tokens too.
    They are the model's raw distribution — log_softmax of the logits before temperature,
    top-k, top-p and min-p (vLLM's default) — so a greedy row's token is its top-1 and a
    sampled row's may be any of them. A step computes them only when one of its rows asks
    (`model.batch.step`'s `logprobs`), and steps such a row plain, never speculatively."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None


@dataclass
class Prepared:
    """A validated, rendered and tokenized request, ready to queue."""

    conversation: Conversation
    view: RequestView
    thinking: bool
    has_tools: bool
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_sequences: tuple[str, ...] = ()
    thinking_budget: int | None = None
    #: `tool_choice` any / tool: the text forced once the reasoning is closed (or at once
    #: without thinking): the DSML block opening, and the tool name for `tool`.
    force_after_think: str | None = None
    #: `disable_parallel_tool_use`: close the block after its first invoke.
    single_tool_call: bool = False
    #: a client's session hint (`metadata.user_id`, `x-session-id`, `prompt_cache_key`):
    #: breaks routing ties
    hint: str | None = None
    #: the protocol (`continuation.types.APIS`): its error wording, tool-id prefix, log
    #: lines, and whether tool turns leave a visible-transcript binding
    api: str = "anthropic"
    #: a per-request secret: its tool ids (`tool_memory.id_stream`) and, unseeded, its
    #: sampling key derive from it, so every process handed the request agrees on both
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(16))

    @property
    def prompt_tokens(self) -> int:
        return len(self.view.tokens)


@dataclass(eq=False)
class Ticket:
    """One request in the scheduler: what it was given, then its progress."""

    prepared: Prepared
    emit: Callable[[Event | ToolCallStarted | TokenLogprob], None]
    progress: Callable[[int, int], None] | None
    cancel: threading.Event | None
    on_decision: Callable[[Decision, int], None] | None
    forced: list[int] | None
    on_done: Callable[[Ticket], None] | None = None
    #: after each token the row evaluated (or its sampled EOS): the server's metrics
    on_token: Callable[[], None] | None = None
    result: Result | None = None
    error: Exception | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    # set when it starts: the route, the prompt, the prefill cursor, then its row
    routed: Route | None = None
    decision: Decision | None = None
    session: Session | None = None
    tokens: list[int] = field(default_factory=list)
    suffix_n: int = 0
    base_segments: tuple[Segment, ...] = ()
    state: Any = None
    done_tokens: int = 0
    cuts: dict[int, str] = field(default_factory=dict)
    before_think: int | None = None
    before_think_state: Any = None
    t0: float = 0.0
    prefill_seconds: float = 0.0
    decoder: RowDecoder | None = None
    #: with paged frontiers: the one the prompt continued, then the prompt end's
    base_paged: Any = None
    #: where its base state came back from before continuing: "host" (`kvstore.host`)
    restored: str | None = None

    def succeed(self, result: Result) -> None:
        self.result = result
        self._end()

    def fail(self, err: Exception) -> None:
        self.error = err
        self._end()

    def _end(self) -> None:
        self.finished.set()
        if self.on_done is not None:
            self.on_done(self)


class Engine:
    def __init__(
        self,
        cfg: Config,
        params: Params,
        tokenizer: Tokenizer,
        *,
        max_len: int = 4096,
        store: KVStore | None = None,
        tool_memory: ToolMemory | None = None,
        chunk_sizes: Sequence[int] = CHUNK_SIZES,
        sessions: int = 1,
        fork_points: bool = False,
        state_budget_bytes: int | None = None,
        max_batch: int = 1,
        mesh: Any = None,
        background_saves: bool = True,
        paged_pages: int | None = None,
        span_base: int = SPAN_BASE,
        host_budget_bytes: int | None = None,
        stall_bound: float | None = None,
        speculative: str | None = None,
        speculative_max_batch: int | None = None,
    ) -> None:
        """`sessions`, `fork_points`, `state_budget_bytes`: the session pool
        (`continuation.pool`); the budget bounds the retained states (None: unbounded).
        `max_batch`: requests decoded together in one step (`model.batch`). `mesh`: a
        `jax.sharding.Mesh` the params are already sharded over (`model.sharding`); every
        state the engine makes or loads is placed on it, replicated. `background_saves`: a
        `store` writes on its own thread (`kvstore.background`), off the request path.
        `paged_pages`: retained frontiers are kept in a pool of that many pages of
        `cfg.state_dtype` (`kvstore.page_store`), the budget counting their distinct pages;
        on a mesh with a data axis the pool is split along it (issue 28): each data shard's
        devices hold its own pages and decode its own block of batch rows, and a session's
        frontiers stay on one shard.
        `span_base`: the capacity every state starts with; states, the decode batch included,
        grow and shrink through `model.state.spans` with the tokens they hold.
        `host_budget_bytes`: a host-RAM tier (`kvstore.host`) of that size takes the states
        of the sessions the state budget evicts, before the disk. `stall_bound`: while rows
        decode, a tick prefills a chunk that keeps their gap within that many decode steps
        (`interleave.chunk_limit`; None: whole chunks). `speculative="mtp"`: steps of at
        most `speculative_max_batch` rows (default: the platform's measured crossover,
        `speculation.default_max_batch`) draft with the params' MTP block and verify
        (`ds4jax.speculation`); on one device only in this version."""
        self.cfg = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.max_len = max_len
        if store is not None and background_saves:
            store = BackgroundSaves(store)
        self.store = store or NoStore()
        self.tool_memory = tool_memory or ToolMemory()
        self.chunk_sizes = tuple(sorted(chunk_sizes))
        self.stall_bound = stall_bound
        #: measured step and chunk costs the prefill bound follows
        self.tick_costs = TickCosts()
        #: decode steps a prompt chunk rode in, and the prompt tokens they evaluated
        self.mixed_steps = self.mixed_prompt_tokens = 0
        self.mesh = mesh
        self.spans = spans(cfg, max_len, span_base)
        self._empty = self._place(init_state(cfg, self.spans[0]))
        #: bytes of the smallest state (a conversation shorter than the first span)
        self.state_nbytes = capacity_bytes(cfg, self.spans[0])
        self.pages: PageStore | None = None
        paging: dict[str, int] = {}
        #: data shards the page pool and the batch rows are split into (1: none)
        self.shards = 1
        #: prompts kept on another shard than their base's (its pages written again there)
        self.shard_moves = 0
        if paged_pages is not None:
            if mesh is not None and DATA_AXIS in mesh.shape:
                self.shards = int(mesh.shape[DATA_AXIS])
            held = sessions * (2 if fork_points else 1) + max_batch  # frontiers at most
            self.pages = PageStore(cfg, self.spans, paged_pages, cfg.state_dtype,
                                   place=self._place_pages, start_pages=PAGED_START,
                                   shards=self.shards, frontiers=held)  # fmt: skip
            paging = dict(page_nbytes=self.pages.page_nbytes,
                          small_nbytes=self.pages.small_nbytes)  # fmt: skip
        elif state_budget_bytes is not None and state_budget_bytes < self.state_nbytes:
            raise ValueError(
                f"the state budget ({state_budget_bytes} bytes) holds no state: one takes "
                f"{self.state_nbytes} bytes at a context of {self.spans[0]}"
            )
        self._pool_args = dict(budget=state_budget_bytes, state_nbytes=self.state_nbytes,
                               keep_forks=fork_points, **paging)  # fmt: skip
        self.pool = Pool.create(sessions, **self._pool_args)
        if host_budget_bytes and jax.process_count() > 1:
            raise ValueError("the host-RAM tier holds one process's states: not with "
                             f"{jax.process_count()} processes")  # fmt: skip
        self.host_budget = host_budget_bytes or None
        self.max_batch = batch_ops.bucket(max_batch)
        self._batch_span = self.spans[0]
        self._batch = self._new_batch()
        self._keys = np.zeros((self.max_batch, 2), np.uint32)
        self._rows: list[Ticket | None] = [None] * self.max_batch
        #: with pages, each row's page table (its own references): the batch holds the
        #: rows' small parts only (`model.batch.paged_step`)
        self._tables: list[PageTable | None] = [None] * self.max_batch
        self.waiting: deque[Ticket] = deque()
        self._prefilling: Ticket | None = None
        self._lock = threading.Lock()  # one scheduler step at a time
        self._state_lock = threading.Lock()  # guards live + bindings for readers
        self._special_ids = {tokenizer.special_id(s) for s in specials.TEMPLATE_SPECIALS}
        self.spec: Speculator | None = None
        self.spec_max_batch = 0
        if speculative is not None:
            self._speculate(speculative, speculative_max_batch)
        self._think_start = tokenizer.special_id(specials.THINK_START)

    # ------------------------------------------------------------------ client side

    @property
    def session(self) -> Session:
        """The session of the latest request."""
        return self.pool.sessions[self.pool.current]

    @property
    def live(self) -> LiveFrontier | None:
        """The latest request's live frontier (the only one of a single-session engine)."""
        return self.session.live

    @live.setter
    def live(self, frontier: LiveFrontier | None) -> None:
        self.session.live = frontier

    @property
    def bindings(self) -> Bindings:
        return self.session.bindings

    def live_tool_ids(self) -> frozenset[str]:
        """The tool ids of every session's live tool call."""
        with self._state_lock:
            return self.pool.live_tool_ids()

    def stats(self) -> dict[str, Any]:
        with self._state_lock:
            return self.pool.stats()

    @property
    def rows_active(self) -> int:
        """Rows of the decode batch serving a request now."""
        return sum(t is not None for t in self._rows)

    def prepare(
        self,
        conversation: Conversation,
        *,
        max_tokens: int,
        has_tools: bool,
        sampling: SamplingParams | None = None,
        stop_sequences: Sequence[str] = (),
        thinking_budget: int | None = None,
        tool_choice: dict[str, Any] | None = None,
        hint: str | None = None,
        api: str = "anthropic",
    ) -> Prepared:
        """Validation and rendering, before queueing. Raises EngineError(400) for a
        tool_result that is neither live nor backed by a replayed tool_use, a prompt that
        does not fit the context, or more log-probabilities than a step computes."""
        k = sampling.logprobs if sampling is not None else None
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise EngineError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {k}")
        try:
            requires_live = validate_tool_results(conversation, self.live_tool_ids(), api)
        except ValueError as err:
            raise EngineError(400, str(err)) from err
        attach_tool_memory(conversation, self.tool_memory.block_for)
        segments = normalize(render(conversation))
        tokens = tuple(self.tokenizer.encode_segments(segments))
        if len(tokens) >= self.max_len:
            raise EngineError(
                400,
                f"prompt is too long: {len(tokens)} tokens, the context is {self.max_len}",
            )
        tail_ids, tail = tool_tail(conversation)
        view = RequestView(segments, tokens, tail_ids, tail, requires_live, api)
        force = None
        choice = (tool_choice or {}).get("type")
        if has_tools and choice in ("any", "tool"):
            force = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="'
            if choice == "tool":
                force += f'{tool_choice["name"]}">\n'
        return Prepared(
            conversation=conversation,
            view=view,
            thinking=conversation.thinking,
            has_tools=has_tools,
            max_tokens=max_tokens,
            sampling=sampling or SamplingParams(),
            stop_sequences=tuple(s for s in stop_sequences if s),
            thinking_budget=thinking_budget,
            force_after_think=force,
            single_tool_call=bool((tool_choice or {}).get("disable_parallel_tool_use")),
            hint=hint,
            api=api,
        )

    def prepare_request(
        self,
        req: MessagesRequest,
        *,
        max_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        hint: str | None = None,
        api: str = "anthropic",
    ) -> Prepared:
        """`prepare` for a parsed Messages request (or an OpenAI one converted to it, `api`):
        its stop sequences, thinking budget and tool_choice; tools count when the rendered
        conversation declares some (tool_choice "none" has removed them). `max_tokens`
        overrides the request's; `hint` (a client's session header) takes precedence over its
        `metadata.user_id`."""
        conv = req.conversation
        return self.prepare(
            conv,
            max_tokens=req.max_tokens if max_tokens is None else max_tokens,
            has_tools=bool(conv.messages and conv.messages[0].tools),
            sampling=sampling,
            stop_sequences=req.stop_sequences,
            thinking_budget=req.thinking_budget,
            tool_choice=req.tool_choice,
            hint=hint or req.user_id,
            api=api,
        )

    # ------------------------------------------------------------------ worker side

    def segments_of(self, tokens: Sequence[int]) -> list[Segment]:
        """The text of `tokens` as segments. Runs of ordinary tokens are decoded together:
        a character split over byte-level tokens must come out whole, not as U+FFFD."""
        out: list[Segment] = []
        run = bytearray()
        for t in tokens:
            if t in self._special_ids:
                if run:
                    out.append(Segment(run.decode("utf-8", errors="replace")))
                    run.clear()
                out.append(Segment(self.tokenizer.token_bytes(t).decode("utf-8"), True))
            else:
                run += self.tokenizer.token_bytes(t)
        if run:
            out.append(Segment(run.decode("utf-8", errors="replace")))
        return out

    def route(self, prepared: Prepared) -> Route | Rejection | None:
        with self._state_lock:
            return route(prepared.view, self.pool, self.store, prepared.hint,
                         busy=self._busy_slots())  # fmt: skip

    def decide(self, prepared: Prepared) -> Decision | Rejection | None:
        r = self.route(prepared)
        return r.decision if isinstance(r, Route) else r

    def submit(
        self,
        prepared: Prepared,
        *,
        on_event: Callable[[Event | ToolCallStarted | TokenLogprob], None] | None = None,
        progress: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
        on_decision: Callable[[Decision, int], None] | None = None,
        forced_tokens: Sequence[int] | None = None,
        on_done: Callable[[Ticket], None] | None = None,
        on_token: Callable[[], None] | None = None,
    ) -> Ticket:
        """Queue a request; `tick` (or `run`) serves it. `on_done(ticket)` fires once it has
        a result or an error; `on_token()` after each token of its reply."""
        ticket = Ticket(prepared, on_event or (lambda _e: None), progress, cancel,
                        on_decision, list(forced_tokens) if forced_tokens is not None else None,
                        on_done, on_token)  # fmt: skip
        with self._state_lock:
            self.waiting.append(ticket)
        return ticket

    def run(self, prepared: Prepared, **hooks: Any) -> Result:
        """Serve one request to the end, stepping the scheduler (and so every other active
        request) meanwhile; `hooks` are `submit`'s keywords. `on_decision(decision,
        prefill_tokens)` fires once the path is chosen, before prefill. `forced_tokens`
        replaces sampling by these tokens (teacher forcing, for tests only: the model still
        evaluates every one of them)."""
        ticket = self.submit(prepared, **hooks)
        while not ticket.finished.is_set():
            self.tick()
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    @property
    def busy(self) -> bool:
        """Requests waiting, prefilling or decoding."""
        return bool(self.waiting or self._prefilling is not None or any(self._rows))

    def tick(self, limit: int | None = None) -> None:
        """One scheduler step: admit the oldest waiting request if a row is free, evaluate
        the next chunk of the prompt being prefilled, and step every active row. Requests
        join and leave at step boundaries.

        With `stall_bound`, while rows decode the chunk rides inside their step (a mixed
        step, `model.batch.step`'s `chunk`) and is at most `limit` tokens — by default
        `chunk_limit()`, from the costs measured here — so a long prompt does not stall the
        decoding streams; a batch size whose plain step was not measured yet steps plain
        first. Otherwise the chunk is a program of its own before the step, in whole chunks
        (`limit`: the largest size). A group's followers are handed the leader's `limit`."""
        with self._lock:
            if self._prefilling is None:
                self._admit()
            size = self._step_size()
            if limit is None:
                limit = self.chunk_limit()
            ticket = self._prefilling
            if ticket is not None and not (size and self.stall_bound):
                self._prefill_chunk(ticket, limit)
                ticket = None
            elif ticket is not None and size not in self.tick_costs.step_s:
                ticket = None  # this tick measures the plain step
            if not any(self._rows):
                return
            t0 = time.perf_counter()
            stepped, chunk = self._decode_step(ticket, limit)
            took = time.perf_counter() - t0
            if not stepped:
                if ticket is not None:  # every row ended before stepping
                    self._prefill_chunk(ticket, limit)
            elif chunk:
                self.tick_costs = self.tick_costs.chunked(
                    chunk, took - self.tick_costs.step_s[stepped])  # fmt: skip
                self.mixed_steps += 1
            else:
                self.tick_costs = self.tick_costs.stepped(stepped, took)

    def chunk_limit(self) -> int:
        """The most prompt tokens the next tick evaluates (`interleave.chunk_limit`)."""
        return chunk_limit(self.chunk_sizes, self._step_size(), self.tick_costs,
                           self.stall_bound)  # fmt: skip

    def _step_size(self) -> int:
        """The batch size the next decode step runs at (0: no row decodes); with data
        shards always the whole batch, whose blocks of rows are the shards'."""
        active = [i for i, t in enumerate(self._rows) if t is not None]
        if active and self.shards > 1:
            return self.max_batch
        return batch_ops.bucket(active[-1] + 1) if active else 0

    def _place_pages(self, tree: Any) -> Any:
        """The page arrays: placed as a state is, or split into the data shards' blocks."""
        return self._place(tree) if self.shards == 1 else self._split(tree)

    def _split(self, tree: Any) -> Any:
        """Split along the mesh's data axis (first dimension: rows, or pages)."""
        if jax.process_count() > 1:
            tree = _on_host(tree)
        return jax.device_put(tree, batch_sharding(self.mesh))

    def _shard_rows(self, shard: int) -> range:
        block = self.max_batch // self.shards
        return range(shard * block, (shard + 1) * block)

    def _row_for(self, base: Any) -> tuple[int, int, Any]:
        """(a free batch row for a prompt, its data shard, the paged base to grow its
        frontier from): with data shards, a row of its base's shard while that has one,
        else of the shard with a free row and the most free pages — the base's pages are
        then written again there (`shard_moves`), since a shard's rows read only its own
        pages."""
        if self.shards == 1:
            row = self._free_row()
            assert row is not None  # reserved at admission
            return row, 0, base
        pool = self.pages.pool
        home = pool.table_shard(base.table) if isinstance(base, PagedFrontier) else None
        rows = [sum(self._rows[r] is None for r in self._shard_rows(s)) for s in range(self.shards)]
        shard = shard_for(home, rows, [pool.free_in(s) for s in range(self.shards)])
        if home is not None and shard != home:
            self.shard_moves += 1
            base = None
        return self._free_row(shard), shard, base

    def _place(self, tree: Any) -> Any:
        """On the mesh, replicated (states are small next to the params); without one,
        committed to the first device. Either way every state the engine holds has one
        placement: states extracted from the batch are committed, and jit compiles a
        committed argument apart from an uncommitted one, so an uncommitted empty state
        would leave warm-up compiling programs the first live continuation of each chunk
        size then compiled again (seconds of TTFT, once per size)."""
        if self.mesh is None:
            return jax.device_put(tree, jax.local_devices()[0])
        if jax.process_count() > 1:  # a new state is host data, the same on every process
            tree = _on_host(tree)
        return jax.device_put(tree, replicated(self.mesh))

    def _new_batch(self) -> Any:
        return self._place_batch(batch_ops.empty_batch(
            self.cfg, self._batch_span, self.max_batch, small=self.pages is not None))  # fmt: skip

    def _place_batch(self, batch: Any) -> Any:
        """The decode batch: placed as a state is, or its rows split over the mesh's data
        axis when it has one."""
        if self.mesh is None or DATA_AXIS not in self.mesh.shape:
            return self._place(batch)
        data = self.mesh.shape[DATA_AXIS]
        if self.max_batch % data:
            raise ValueError(f"a batch of {self.max_batch} rows does not split over data={data}")
        return self._split(batch)

    def abort(self, err: Exception) -> None:
        """Fail every request in the scheduler (after a step raised): their rows and the
        batch are dropped; sessions keep their last completed frontiers."""
        with self._lock:
            tickets = [*self.waiting, *(t for t in self._rows if t is not None)]
            if self._prefilling is not None:
                tickets.append(self._prefilling)
            self.waiting.clear()
            self._prefilling = None
            self._rows = [None] * self.max_batch
            self._release_tables()
            self._batch_span = self.spans[0]
            self._batch = self._new_batch()
        for t in tickets:
            t.fail(err)

    def _free_row(self, shard: int | None = None) -> int | None:
        """A free batch row (of `shard`'s block with data shards)."""
        rows = range(self.max_batch) if shard is None else self._shard_rows(shard)
        for i in rows:
            if self._rows[i] is None:
                return i
        return None

    def _busy_slots(self) -> frozenset[int]:
        slots = {t.session.slot for t in self._rows if t is not None}
        if self._prefilling is not None:
            slots.add(self._prefilling.session.slot)
        return frozenset(slots)

    def _admit(self) -> None:
        while self.waiting and self._free_row() is not None:
            ticket = self.waiting[0]
            with self._state_lock:
                routed = route(ticket.prepared.view, self.pool, self.store, ticket.prepared.hint,
                               busy=self._busy_slots())  # fmt: skip
            if routed is None:
                return  # every slot serves an active request: wait for one to finish
            self.waiting.popleft()
            try:
                self._begin(ticket, routed)
            except Exception as err:
                ticket.fail(err)
                continue
            self._prefilling = ticket
            return

    def _begin(self, ticket: Ticket, routed: Route | Rejection) -> None:
        """Apply the routing decision: the base state, the suffix, the log line, the evict
        save of a displaced frontier; prefill starts at the next chunk."""
        prepared = ticket.prepared
        if isinstance(routed, Rejection):
            raise EngineError(routed.status, routed.message, routed.error_type)
        decision, session = routed.decision, self.pool.sessions[routed.slot]
        if decision.source == CacheSource.DISK:
            try:
                disk_state = decision.disk.load()
            except Exception as err:  # a checkpoint that cannot load is never served
                log.warning(
                    "kv store: load of %s failed (%s); cold prefill", decision.disk.key, err
                )
                decision = Decision(CacheSource.COLD, (), suffix_tokens=prepared.view.tokens)
        if decision.source == CacheSource.COLD:
            base_state, base_segments = self._empty, ()
        elif decision.source == CacheSource.DISK:
            base_state, base_segments = self._place(disk_state), decision.disk.segments
            for tid, block in decision.disk.tool_entries.items():
                self.tool_memory.remember([tid], block)
        elif decision.source == CacheSource.FORK:
            base_state, base_segments = routed.fork.frontier.state, routed.fork.frontier.segments
        else:
            assert session.live is not None
            base_state, base_segments = session.live.state, session.live.segments
        if isinstance(base_state, PagedFrontier):  # its pages lend themselves to what grows
            ticket.base_paged = base_state
            base_state = self.pages.dense(base_state)
        elif isinstance(base_state, HostState):  # back from the host tier, to continue
            ticket.restored = "host"
            base_state = self._place(base_state.state)
        if decision.suffix_tokens is not None:
            suffix = list(decision.suffix_tokens)
        else:
            suffix = self.tokenizer.encode_segments(decision.suffix_segments or ())
        tokens = list(decision.base) + suffix
        if len(tokens) >= self.max_len:
            raise EngineError(
                400, f"prompt is too long: {len(tokens)} tokens, the context is {self.max_len}"
            )
        self._check_room(len(tokens), session.slot)
        base_state = self._fit(base_state, len(tokens))
        api = prepared.api
        live_match = {CacheSource.LIVE_TOOL: "tool-output-ids"}
        if api != "anthropic":
            live_match[CacheSource.THINKING_VISIBLE] = "visible-prefix"
        if decision.source in live_match:
            log.info(
                "%s live continuation match=%s ids=%d cached=%d prompt=%d session=%d",
                api,
                live_match[decision.source],
                len(prepared.view.tail_ids),
                decision.cached,
                len(tokens),
                session.slot,
            )
        else:
            if routed.fork is not None:
                log.info("fork from=%d at=%d session=%d", routed.fork.owner, decision.cached,
                         session.slot)  # fmt: skip
            log.info(
                "cache source=%s cached=%d prompt=%d session=%d",
                decision.source.value,
                decision.cached,
                len(tokens),
                session.slot,
            )
        if ticket.on_decision is not None:
            ticket.on_decision(decision, len(suffix))

        # A request that takes a used slot replaces its live frontier: keep it on disk
        # first, so a client that comes back to that conversation finds it (ds4's "evict")
        displaced = routed.displaced
        if displaced is not None and displaced.pos:
            self._save(displaced.tokens, displaced.state, "evict")

        ticket.routed, ticket.decision, ticket.session = routed, decision, session
        ticket.tokens, ticket.suffix_n, ticket.base_segments = tokens, len(suffix), base_segments
        ticket.state, ticket.done_tokens = base_state, len(decision.base)
        ticket.cuts = self._save_points(decision, tokens)
        ticket.before_think = self._before_think_cut(prepared, decision, tokens)
        ticket.t0 = time.perf_counter()

    def _next_chunk(self, ticket: Ticket, limit: int) -> tuple[int, int] | None:
        """(end, padded size) of the prompt's next chunk: at most `limit` tokens, stopping at
        the store's save points and the fork point before `<think>`; None when the prompt
        is done."""
        stops = sorted({*ticket.cuts, ticket.before_think, len(ticket.tokens)} - {None})
        end = next((c for c in stops if c > ticket.done_tokens), None)
        if end is None:
            return None
        end = min(end, ticket.done_tokens + limit)
        ((size, _),) = plan_chunks(end - ticket.done_tokens,
                                   [s for s in self.chunk_sizes if s <= limit])  # fmt: skip
        return end, size

    def _prefill_chunk(self, ticket: Ticket, limit: int) -> None:
        """Evaluate the prompt's next chunk (`_next_chunk`) as a program of its own."""
        nxt = self._next_chunk(ticket, limit)
        if nxt is not None:
            end, size = nxt
            state = self._prefill(ticket.state, ticket.tokens[ticket.done_tokens : end], (size,))
            self._chunk_done(ticket, state, end)
        else:
            self._chunk_done(ticket, ticket.state, ticket.done_tokens)

    def _chunk_done(self, ticket: Ticket, state: Any, end: int) -> None:
        """The prompt's state after its tokens [.., end): saves at the store's points, the
        fork point before `<think>`, progress; at the prompt's end the request takes a
        row."""
        tokens, advanced = ticket.tokens, end > ticket.done_tokens
        ticket.state, ticket.done_tokens = state, end
        if advanced:
            if end in ticket.cuts:
                self._save(tuple(tokens[:end]), state, ticket.cuts[end])
            if end == ticket.before_think:
                ticket.before_think_state = state
            if ticket.progress is not None:
                ticket.progress(end - len(ticket.decision.base), ticket.suffix_n)
        if end < len(tokens):
            return
        self._prefilling = None
        try:
            self._prompt_done(ticket)
        except Exception as err:
            ticket.fail(err)

    def _prompt_done(self, ticket: Ticket) -> None:
        state, tokens, decision = ticket.state, ticket.tokens, ticket.decision
        session = ticket.session
        state.logits.block_until_ready()
        ticket.prefill_seconds = time.perf_counter() - ticket.t0
        log.info("prompt done %.3fs", ticket.prefill_seconds)
        prepared = ticket.prepared
        if decision.suffix_tokens is not None:  # all request tokens (cold, token prefixes)
            live_segments = prepared.view.segments
        else:
            live_segments = normalize([*ticket.base_segments, *(decision.suffix_segments or ())])
        row, shard, base = self._row_for(ticket.base_paged)
        bt = ticket.before_think_state
        if bt is not None and live_segments[-1:] == (THINK_START_SEGMENT,):
            # kept first, and the prompt end grown from it: one token further, so it appends
            # in place and the two share every page
            bt = self._keep(bt, tokens[:-1], base, shard)
            base = bt if isinstance(bt, PagedFrontier) else base
        else:
            bt = None
        kept = self._keep(state, tokens, base, shard)
        if self.pages is not None and not isinstance(kept, PagedFrontier):
            raise EngineError(529, f"overloaded: no pages left for a {len(tokens)}-token "
                              "prompt's row; retry shortly", "overloaded_error")  # fmt: skip
        prompt_end = LiveFrontier(kept, tuple(tokens), live_segments)
        with self._state_lock:
            pool = self.pool
            if decision.source in (CacheSource.FORK, CacheSource.DISK, CacheSource.COLD):
                session.clear()  # a new conversation in this slot
            session.live = prompt_end
            session.used = pool.tick()
            session.hint = prepared.hint or session.hint
            pool.current = session.slot
            pool.hits[source_label(decision.source, prepared.api)] += 1
            if decision.source != CacheSource.LIVE_TOOL:
                session.bindings.tool = None
            if decision.source != CacheSource.THINKING_VISIBLE:
                session.bindings.thinking = None
            pool.retain(prompt_end, session.slot)
            if bt is not None:
                pool.retain(LiveFrontier(bt, tuple(tokens[:-1]), live_segments[:-1]), session.slot)
        ticket.decoder = RowDecoder(self, prepared, session, list(tokens), live_segments,
                                    ticket.emit, ticket.cancel, ticket.forced)  # fmt: skip
        seed = prepared.sampling.seed
        if seed is None:
            seed = int.from_bytes(hashlib.blake2b(prepared.nonce, digest_size=4).digest()) >> 1
        key = jax.random.key(seed % (1 << 63))  # a client's seed of any size
        self._keys[row] = np.asarray(jax.random.key_data(key))
        if self.pages is not None:  # the row holds the prompt end's pages and its small part
            self._tables[row] = self.pages.pool.hold(kept.table)
            self._batch = batch_ops.insert(self._batch, np.int32(row), kept.small)
            self._rows[row] = ticket
            return
        if not holds(self.cfg, state, self._batch_span):  # the batch takes the longer span
            self._resize_batch(max(self._batch_span, self._span(len(tokens))))
            state = self._fit(state, self._batch_span - 1)
        self._batch = batch_ops.insert(self._batch, np.int32(row), state)
        self._rows[row] = ticket
        if self.spec is not None:
            self.spec.admit(row)

    def _speculate(self, kind: str, max_batch: int | None) -> None:
        if kind != "mtp":
            raise ValueError(f"unknown speculative method {kind!r} (one: mtp)")
        if "mtp" not in self.params:
            raise ValueError("--speculative mtp needs the model's MTP block, and these "
                             "weights have none (`mtp.*` in the release)")  # fmt: skip
        if self.mesh is not None:
            raise ValueError("--speculative mtp runs on one device in this version: not "
                             "with a mesh (--mesh none)")  # fmt: skip
        self.spec = Speculator(self.cfg, self.max_batch, self._place)
        self.spec_max_batch = default_max_batch() if max_batch is None else max_batch

    def _decode_step(self, filling: Ticket | None = None, limit: int = 0) -> tuple[int, int]:
        """One batched step for every active row; finished rows leave the batch. `filling`:
        its prompt's next chunk (at most `limit` tokens) rides in the step. With
        speculation on, a step of few enough rows and no chunk is speculative
        (`_speculative_step`). Returns (the step's batch size, the chunk's padded size), 0
        for what did not run."""
        size = self._step_size()
        spec = self.spec
        if (spec is not None and filling is None and 0 < self.rows_active <= self.spec_max_batch
                and not self._logprob_rows()):  # fmt: skip
            return self._speculative_step(size)
        override = np.full(size, -1, np.int32)
        sampling = self._sampling_arrays(size)
        stepping, pending = [], set()
        for row, ticket in enumerate(self._rows[:size]):
            if ticket is None:
                continue
            if spec is not None and spec.pending[row] >= 0:  # decided by a speculative step
                override[row] = spec.pending[row]
                pending.add(row)
            else:
                planned = ticket.decoder.plan()
                if planned is None:
                    self._finish_row(row)
                    continue
                override[row] = planned
            self._sampling_row(sampling, row, ticket)
            stepping.append(row)
        if not stepping:
            return 0, 0
        self._grow_batch(stepping, 1)
        grid = None
        if self.pages is not None:
            grid = self._grid(size, stepping)
            stepping = [r for r in stepping if self._rows[r] is not None]
            if not stepping:
                return 0, 0
        chunk, nxt = None, None if filling is None else self._next_chunk(filling, limit)
        if nxt is not None:
            done = filling.done_tokens
            padded = np.zeros(nxt[1], np.int32)
            padded[: nxt[0] - done] = filling.tokens[done : nxt[0]]
            chunk = (filling.state, padded, np.int32(nxt[0] - done))
            self.mixed_prompt_tokens += nxt[0] - done
        scored = self._logprob_rows(stepping)
        self._batch, tokens, keys, prompt, scores = self._step(
            self._batch, grid, override, self._keys[:size], *sampling, chunk=chunk,
            logprobs=bool(scored),
        )  # fmt: skip
        tokens, keys = fetch(tokens), fetch(keys)
        if scores is not None:
            scores = tuple(fetch(x) for x in scores)
        for row in stepping:
            self._keys[row] = keys[row]
            ticket = self._rows[row]
            if spec is not None:
                spec.stepped_plain(row)
            if row not in pending:  # a pending token is its decoder's already
                t = int(tokens[row])
                entry = None
                if row in scored:
                    chosen, top, ids = (x[row] for x in scores)
                    k = scored[row]
                    entry = token_logprob(self.tokenizer, t, chosen, ids[:k], top[:k])
                ticket.decoder.accept(t, entry)
            if ticket.on_token is not None:
                ticket.on_token()
            if ticket.decoder.done:
                self._finish_row(row)
        if filling is not None:  # after the rows: a completed prompt takes a row
            if nxt is None:
                self._chunk_done(filling, filling.state, filling.done_tokens)
            else:
                self._chunk_done(filling, prompt, nxt[0])
        return size, 0 if nxt is None else nxt[1]

    def _speculative_step(self, size: int) -> tuple[int, int]:
        """`_decode_step` as a speculative step (`speculation.Speculator.step`)."""
        spec, eos = self.spec, self.tokenizer.eos_id
        sampling = self._sampling_arrays(size)
        plans, decoders = {}, {}
        for row, ticket in enumerate(self._rows[:size]):
            if ticket is None:
                continue
            plan = spec.plan_row(row, ticket.decoder, eos)
            if plan is None:
                self._finish_row(row)
                continue
            self._sampling_row(sampling, row, ticket)
            plans[row], decoders[row] = plan, ticket.decoder
        if not plans:
            return 0, 0
        self._grow_batch(list(plans), 2)
        grid = None
        if self.pages is not None:
            grid = self._grid(size, list(plans), 2)
            plans = {r: p for r, p in plans.items() if self._rows[r] is not None}
            if not plans:
                return 0, 0

        def verify(*args: Any) -> Any:
            if grid is None:
                self._batch, out = verify_rows(self.params, self._batch, *args, cfg=self.cfg,
                                               size=size)  # fmt: skip
                return out
            self._batch, self.pages.arrays, out = paged_verify_rows(
                self.params, self._batch, self.pages.arrays, grid, *args, cfg=self.cfg,
                size=size, span=self._batch_span,
            )  # fmt: skip
            return out

        keys, finished = spec.step(self.params, verify, plans, decoders, sampling,
                                   self._keys[:size], eos, size)  # fmt: skip
        for row in plans:
            self._keys[row] = keys[row]
            ticket = self._rows[row]
            if grid is not None:  # the table back to what the row evaluated
                held = spec.position(row, ticket.decoder)
                if held < self._tables[row].tokens:
                    self._tables[row] = self.pages.pool.trim(self._tables[row], held)
            if ticket.on_token is not None:
                ticket.on_token()
        for row in finished:
            self._finish_row(row)
        return size, 0

    def _logprob_rows(self, rows: Sequence[int] | None = None) -> dict[int, int]:
        """The active rows (of `rows`) that report log-probabilities → their k."""
        out = {}
        for row in range(self.max_batch) if rows is None else rows:
            ticket = self._rows[row]
            if ticket is not None and ticket.prepared.sampling.logprobs is not None:
                out[row] = ticket.prepared.sampling.logprobs
        return out

    def _sampling_arrays(self, size: int) -> tuple[np.ndarray, ...]:
        """A step's per-row (temperature, top_k, top_p, min_p), each off."""
        return (np.zeros(size, np.float32), np.zeros(size, np.int32), np.ones(size, np.float32),
                np.zeros(size, np.float32))  # fmt: skip

    def _sampling_row(self, arrays: tuple[np.ndarray, ...], row: int, ticket: Ticket) -> None:
        sp = ticket.prepared.sampling
        temperature, top_k, top_p, min_p = arrays
        temperature[row], top_k[row], top_p[row], min_p[row] = (
            sp.temperature,
            min(sp.top_k, self.cfg.vocab_size),  # past the vocabulary: all of it, as off
            sp.top_p,
            sp.min_p,
        )

    def _grow_batch(self, stepping: list[int], tokens: int) -> None:
        """The batch's span, grown when a step's `tokens` per row would pass its end."""
        need = self._span(max(len(self._rows[r].decoder.tokens) for r in stepping) + tokens)
        if need > self._batch_span:
            self._resize_batch(need)

    def _step(self, batch: Any, grid: np.ndarray | None, override: np.ndarray,
              *sampling: np.ndarray, chunk: Any = None, logprobs: bool = False,
              ) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
        """One batched step of `len(override)` rows: dense rows, or (`grid`: their page
        tables) rows reading and writing the page pool; `chunk` (`model.batch.Chunk`) rides
        along. Returns (batch, tokens, keys, the chunk's prompt state or None, with
        `logprobs` the step's `model.batch.Logprobs` else None)."""
        size = len(override)
        args = (override, *sampling, np.int32(self.tokenizer.eos_id))
        if self.pages is None:
            with self._on_mesh():
                out = batch_ops.step(self.params, batch, *args, chunk, cfg=self.cfg, size=size,
                                     logprobs=logprobs)  # fmt: skip
        else:
            with self._on_mesh():
                out = batch_ops.paged_step(
                    self.params, batch, self.pages.arrays, grid, *args, chunk, cfg=self.cfg,
                    size=size, span=self._batch_span, shards=self.shards, logprobs=logprobs,
                )  # fmt: skip
            self.pages.arrays = out[1]
            out = (out[0], *out[2:])
        batch, tokens, keys, rest = out[0], out[1], out[2], list(out[3:])
        prompt = rest.pop(0) if chunk is not None else None
        return batch, tokens, keys, prompt, rest.pop(0) if logprobs else None

    def _on_mesh(self) -> Any:
        """The context the model's programs run in: the engine's mesh set, so the routed
        experts run expert-parallel over it (`sharding.expert_parallel`)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _prefill(self, state: Any, tokens: Sequence[int], chunk_sizes: Sequence[int]) -> Any:
        """`state` grown by `tokens` (`forward.prefill`, on the mesh)."""
        with self._on_mesh():
            return prefill(self.params, state, tokens, self.cfg, chunk_sizes=chunk_sizes)[0]

    def _grid(self, size: int, stepping: list[int], tokens: int = 1) -> np.ndarray:
        """The page tables of rows [0, size) for a step, each stepping row's grown by the
        `tokens` it may evaluate (its tail its own); other rows' are all null pages, so
        they neither read nor write any page."""
        width = pages_for(self._batch_span)
        grid = np.zeros((size, width), np.int32)
        for row in stepping:
            try:
                self._tables[row] = self._advance(self._tables[row], tokens)
            except OutOfPages as err:  # the row ends; its session keeps its prompt end
                self._rows[row], ticket = None, self._rows[row]
                self.pages.pool.release(self._tables[row])
                self._tables[row] = None
                ticket.fail(EngineError(529, f"overloaded: the page pool is full ({err}); "
                                        "retry shortly", "overloaded_error"))  # fmt: skip
                continue
            grid[row] = self._tables[row].padded(width)
        return grid

    def _advance(self, table: PageTable, tokens: int = 1) -> PageTable:
        """A row's table grown by the tokens its step may evaluate; when the pool is full,
        fork points and idle sessions give up pages first, as the state budget orders them
        (`continuation.pool.evictions`), and the growth is tried once more."""
        try:
            return self.pages.advance(table, tokens)
        except OutOfPages as err:
            with self._state_lock:
                held = self.pool.state_bytes()
            target = held - err.wanted * self.pages.page_nbytes
            if not self._enforce_budget(None, target, pages=err.wanted):
                raise
            return self.pages.advance(table, tokens)

    def _release_tables(self) -> None:
        for row, table in enumerate(self._tables):
            if table is not None and self.pages is not None:
                self.pages.pool.release(table)
            self._tables[row] = None

    def _row_frontier(self, row: int, tokens: int) -> Any:
        """The state a row leaves with: dense, or its pages (the table cut back to the
        tokens it evaluated: a sampled EOS is not) and its small part."""
        small = batch_ops.extract(self._batch, np.int32(row))
        if self.pages is None:
            return self._fit(small, tokens)
        table, self._tables[row] = self._tables[row], None
        return self.pages.adopt(self.pages.pool.trim(table, tokens), small)

    def _finish_row(self, row: int) -> None:
        ticket = self._rows[row]
        self._rows[row] = None
        try:
            state = self._row_frontier(row, len(ticket.decoder.tokens))
            result = ticket.decoder.finish(state)
            result.source = ticket.decision.source
            result.cached = ticket.decision.cached
            result.prefilled = ticket.suffix_n
            result.prefill_seconds = ticket.prefill_seconds
            result.session = ticket.session.slot
            result.forked_from = ticket.routed.fork.owner if ticket.routed.fork else None
            result.restored = ticket.restored
        except Exception as err:
            ticket.fail(err)
        else:
            ticket.succeed(result)
        finally:
            self._enforce_budget(ticket.session.slot)
            active = [len(t.decoder.tokens) + 1 for t in self._rows if t is not None]
            need = self._span(max(active, default=0))
            if need < self._batch_span:  # the longest row left: the step shrinks with it
                self._resize_batch(need)

    def _span(self, tokens: int) -> int:
        """The span for `tokens` tokens; the context's own capacity also holds its last
        step (a reply that fills the context: `decoding.RowDecoder` stops there)."""
        return span_for(self.spans, min(tokens, self.max_len - 1))

    def _fit(self, state: Any, tokens: int) -> Any:
        """`state` (dense, holding at most `tokens` tokens) at the span for `tokens`."""
        span = self._span(tokens)
        if holds(self.cfg, state, span):
            return state
        return self._place(resize(state, cfg=self.cfg, span=span))

    def _resize_batch(self, span: int) -> None:
        """The batch's span: what its rows' compressed rows take in a step. Paged rows keep
        them in pages, so only the tables' width changes."""
        if self.pages is None:
            self._batch = self._place_batch(resize(self._batch, cfg=self.cfg, span=span))
        self._batch_span = span

    def _keep(self, state: Any, ids: Sequence[int], base: Any, shard: int = 0) -> Any:
        """What a retained frontier holds of `state` (of the tokens `ids`): itself, or with
        paged frontiers its pages, grown from `base`'s (else on `shard`) and shared where
        another frontier's pages hold the same prefix."""
        if self.pages is None:
            return state
        tokens = len(ids)
        try:
            return self.pages.keep(state, tokens, base, ids, shard)
        except OutOfPages as err:  # kept dense instead: correct, and the budget counts it so
            log.warning("page pool full (%s): a frontier of %d tokens kept whole", err, tokens)
            return state

    def _before_think_cut(self, prepared: Prepared, decision: Decision, tokens: list[int]):
        """Where to keep a second fork point, just before the prompt's closing `<think>`,
        if anywhere. In thinking mode without tools the official format replays this turn
        as `<｜Assistant｜></think>content`, so the prompt end (`…<think>`) is never a prefix
        of the next request; the state before `<think>` is — even after a reply cut short
        by max_tokens or a stop sequence, where no thinking-visible binding is left."""
        conv = prepared.conversation
        if (
            not self.pool.keep_forks
            or not prepared.thinking
            or any(m.tools for m in conv.messages)
            or not tokens
            or tokens[-1] != self._think_start
            or len(tokens) - 1 <= len(decision.base)
        ):
            return None
        return len(tokens) - 1

    def _enforce_budget(self, keep: int | None, budget: int | None = None, pages: int = 0) -> bool:
        """Drop what the state budget (or `budget`) no longer holds, beside the sessions
        serving requests and `keep`; with a store, evicted states are saved first (they
        come back as disk hits). With `pages`, only if that frees so many pages (False, and
        nothing dropped, when it cannot)."""
        with self._state_lock:
            busy = self._busy_slots() | ({keep} if keep is not None else set())
            forks, slots = evictions(self.pool, busy, budget)
            if pages and self._pages_freed(forks, slots) < pages:
                return False
            dropped = [f.frontier for f in forks]
            self.pool.forks = [f for f in self.pool.forks if f not in forks]
            for i in slots:
                session = self.pool.sessions[i]
                if not self._to_host(session, busy, dropped):
                    dropped.append(session.live)
                    session.clear()
        for frontier in dropped:
            if frontier is not None and frontier.pos:
                log.info("evict %d tokens (state budget)", frontier.pos)
                self._save(frontier.tokens, frontier.state, "evict")
        return True

    def _pages_freed(self, forks: list[Any], slots: list[int]) -> int:
        """Pages no frontier or row would hold once `forks` and the sessions `slots` are
        dropped (a session whose pages its fork points share frees none of them)."""
        gone = {id(f) for f in forks}
        out = [f.frontier for f in forks] + [self.pool.sessions[i].live for i in slots]
        kept = [s.live for s in self.pool.sessions if s.slot not in slots]
        kept += [f.frontier for f in self.pool.forks if id(f) not in gone]

        def pages(frontiers: list[Any]) -> set[int]:
            states = (f.state for f in frontiers if f is not None)
            return set().union(*(s.table.pages for s in states if isinstance(s, PagedFrontier)))

        rows = set().union(*(t.pages for t in self._tables if t is not None))
        return len(pages(out) - pages(kept) - rows)

    def _to_host(self, session: Session, keep: set[int], dropped: list[Any]) -> bool:
        """Move an evicted session's state to the host tier, whole session kept (sessions
        held there longest go on to `dropped` to make room); False when there is no tier or
        the state cannot fit it. Under the state lock."""
        if self.host_budget is None or session.live is None:
            return False
        dense = self.pages.dense(session.live.state) if self.pages else session.live.state
        victims = host_victims(self.pool, dense.nbytes, self.host_budget, keep | {session.slot})
        if victims is None:
            return False
        for i in victims:
            dropped.append(self.pool.sessions[i].live)
            self.pool.sessions[i].clear()
        session.live = replace(session.live, state=to_host(dense))
        log.info("spill %d tokens of session %d to host RAM (%d bytes)", session.live.pos,
                 session.slot, dense.nbytes)  # fmt: skip
        return True

    def _check_room(self, tokens: int, slot: int) -> None:
        """Refuse, changing nothing, a request whose state the budget cannot hold beside
        the states of the requests in flight, whatever else it evicts: a 529 (the client
        retries; `serve` adds `retry-after`)."""
        budget = self.pool.budget
        if budget is None:
            return
        if self.pages is None:
            need = capacity_bytes(self.cfg, self._span(tokens))
        else:  # its pages (none shared, at worst) and its small part
            need = pages_for(tokens) * self.pages.page_nbytes + self.pages.small_nbytes
        with self._state_lock:
            busy = self._busy_slots() - {slot}
            held = held_bytes(self.pool, busy)
        if held + need > budget:
            raise EngineError(
                529,
                f"overloaded: a {tokens}-token state ({need} bytes) does not fit the state "
                f"budget ({budget} bytes) beside the {len(busy)} requests in flight "
                f"({held} bytes); retry shortly",
                "overloaded_error",
            )

    # ------------------------------------------------------------------ disk hooks

    def _save_points(self, decision: Decision, tokens: list[int]) -> dict[int, str]:
        """Positions inside this prefill where the store wants a checkpoint (→ reason): the
        cold save point of a cold prefill, and every multiple of the continued interval."""
        points: dict[int, str] = {}
        every = self.store.continued_every
        if every:
            first = (decision.cached // every + 1) * every
            points |= dict.fromkeys(range(first, len(tokens), every), "continued")
        if decision.source == CacheSource.COLD:
            cut = self.store.cold_cut(tuple(tokens), normalize(self.segments_of(tokens)))
            if cut:
                points[cut] = "cold"
        # a short prompt's cold point is its end: saved whole, after the prefill
        return {
            p: r
            for p, r in points.items()
            if decision.cached < p < len(tokens) or (r == "cold" and p == len(tokens))
        }

    def _save(self, tokens: tuple[int, ...], state: Any, reason: str) -> None:
        """Hand a state to the store (written in the background unless the engine was made
        without `background_saves`: the state is immutable). Never rolls the live state
        back; a failing store is logged, not raised: serving goes on without the
        checkpoint."""
        try:
            if isinstance(self.store, NoStore):
                return
            if isinstance(state, HostState):
                state = state.state
            elif self.pages is not None:
                state = self.pages.dense(state)
            self.store.save(
                tokens, normalize(self.segments_of(tokens)), state, reason, self.tool_memory
            )
        except Exception as err:
            log.warning("kv store: %s save of %d tokens failed: %s", reason, len(tokens), err)

    def shutdown(self) -> None:
        """Clean exit: persist every session's live frontier (the store decides whether to
        keep each), the latest request's first."""
        with self._lock:
            order = sorted(self.pool.sessions, key=lambda s: -s.used)
            for live in (s.live for s in order):
                if live is not None and live.pos:
                    self._save(live.tokens, live.state, "shutdown")
        flush = getattr(self.store, "flush", None)
        if flush is not None:  # every save asked for, written before the process exits
            flush()

    # ------------------------------------------------------------------ introspection

    def warm_up(self, logprobs: bool = False) -> None:
        """Compile every prefill chunk size and the batched step at every size up to
        `max_batch` (before serving), on throwaway states: no session is touched. With
        `stall_bound`, each size's mixed step with the smallest chunk too (other chunk sizes
        and spans compile on first use, then come from the persistent cache). `logprobs`:
        each of those steps' variant that reports log-probabilities too (else the first
        request asking for them compiles it)."""
        for size in self.chunk_sizes:
            state = self._prefill(self._empty, [self.tokenizer.bos_id] * size, (size,))
            state.logits.block_until_ready()
        # the batched step at every size up to max_batch, on a throwaway batch of the same
        # shapes (rows of the real one may be decoding), and the row insert / extract; with
        # pages, on the pool itself through null tables (nothing is read or written)
        with self._lock:
            scratch = self._new_batch()
            empty = self._empty if self.pages is None else small_part(self._empty)
            scratch = batch_ops.insert(scratch, np.int32(0), empty)
            # with the prefill bound, also each size's step with the smallest chunk riding in
            # it, the first that a prompt arriving while rows decode takes
            small = min(self.chunk_sizes)
            chunks = [None, (self._empty, np.zeros(small, np.int32), np.int32(1))]
            # (with data shards the step always runs the whole batch: `_step_size`)
            sizes = [self.max_batch] if self.shards > 1 else batch_ops.BATCH_SIZES
            for size in sizes:
                if size > self.max_batch:
                    break
                grid = np.zeros((size, pages_for(self._batch_span)), np.int32)
                variants = [(c, lp) for c in chunks[: 2 if self.stall_bound else 1]
                            for lp in ((False, True) if logprobs else (False,))]  # fmt: skip
                for chunk, lp in variants:
                    for _ in range(2):  # the second call sees the step's own outputs
                        scratch, *_ = self._step(
                            scratch, grid, np.full(size, -1, np.int32),
                            np.zeros((size, 2), np.uint32), np.zeros(size, np.float32),
                            np.zeros(size, np.int32), np.ones(size, np.float32),
                            np.zeros(size, np.float32), chunk=chunk, logprobs=lp,
                        )  # fmt: skip
            jax.block_until_ready(batch_ops.extract(scratch, np.int32(0)))
        if self.pages is not None:  # the page programs: write, copy (a shared tail), read
            a = self.pages.keep(self._empty, 1)
            self.pages.keep(self._empty, 2, a)
            b = self.pages.keep(self._empty, 2, a)
            jax.block_until_ready(self.pages.dense(b))

    def logits_for(self, tokens: Sequence[int]) -> np.ndarray:
        """Next-token logits of a cold prefill of `tokens` (fidelity checks)."""
        state = self._prefill(self._fit(self._empty, len(tokens)), list(tokens),
                              self.chunk_sizes)  # fmt: skip
        return np.asarray(state.logits)

    def reset(self) -> None:
        """Forget every session and fork point (a restart, as far as RAM goes)."""
        with self._lock, self._state_lock:
            self.pool = Pool.create(len(self.pool.sessions), **self._pool_args)
