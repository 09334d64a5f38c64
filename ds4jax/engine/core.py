"""`Engine`: the single owner of the params and of every retained state.

The class is assembled from parts, each in the module named for what its methods work on
(`sessions`, `admission`, `stepping`, `speculative`, `paging`); this module makes the states
they share (`Engine.__init__`), shapes them (spans), and holds the entry points that are
neither scheduling nor retention: preparing a request, warm-up, fidelity logits.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import numpy as np

from ds4jax.chat import specials
from ds4jax.chat.anthropic import MessagesRequest
from ds4jax.chat.conversation import Conversation
from ds4jax.chat.kinds import Api
from ds4jax.chat.segments import Segment
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.chat.tool_names import NameIndex
from ds4jax.config import Config
from ds4jax.continuation.pool import Pool
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.engine.admission import Admission
from ds4jax.engine.paging import PAGED_START, Paging
from ds4jax.engine.placement import on_mesh, place_batch, place_pages, place_state
from ds4jax.engine.prepare import prepare, segments_of
from ds4jax.engine.requests import Prepared, SamplingParams
from ds4jax.engine.sessions import Sessions
from ds4jax.engine.speculative import Speculating
from ds4jax.engine.stepping import Stepping, draw_among, sampling_arrays
from ds4jax.engine.ticket import Ticket
from ds4jax.interleave import TickCosts
from ds4jax.kvstore.background import BackgroundSaves
from ds4jax.kvstore.page_store import PageStore
from ds4jax.kvstore.pages import pages_for
from ds4jax.kvstore.store import KVStore, NoStore
from ds4jax.model import batch as batch_ops
from ds4jax.model.forward import CHUNK_SIZES
from ds4jax.model.page_io import small_part
from ds4jax.model.page_table import PageTable
from ds4jax.model.params import Params
from ds4jax.model.sharding import DATA_AXIS
from ds4jax.model.state import SPAN_BASE, capacity_bytes, holds, init_state, resize, span_for, spans
from ds4jax.speculation import Speculator


class Engine(Sessions, Admission, Stepping, Speculating, Paging):
    """The engine (`ds4jax.engine`). One instance owns every state its parts read and
    write; the parts hold no state of their own."""

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
        burst: int = batch_ops.BURST_STEPS,
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
        (`ds4jax.speculation`); on one device only in this version. `burst`: while the
        active rows only sample and nothing waits or prefills, one program takes up to
        that many tokens per row (`model.batch.burst`; 1: a program per token)."""
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
        #: the rows' data axis (1: none), read once: `_rows_follow_steps` runs every step
        self._data = 1 if mesh is None else int(dict(mesh.shape).get(DATA_AXIS, 1))
        self.spans = spans(cfg, max_len, span_base)
        self._empty = place_state(self.mesh, init_state(cfg, self.spans[0]))
        #: bytes of the smallest state (a conversation shorter than the first span)
        self.state_nbytes = capacity_bytes(cfg, self.spans[0])
        self.pages: PageStore | None = None
        paging: dict[str, int] = {}
        #: data shards the page pool and the batch rows are split into (1: none)
        self.shards = 1
        #: prompts kept on another shard than their base's (its pages written again there)
        self.shard_moves = 0
        if paged_pages is not None:
            self.shards = self._data
            held = sessions * (2 if fork_points else 1) + max_batch  # frontiers at most
            self.pages = PageStore(cfg, self.spans, paged_pages, cfg.state_dtype,
                                   place=partial(place_pages, mesh, self.shards),
                                   start_pages=PAGED_START, shards=self.shards,
                                   frontiers=held)  # fmt: skip
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
        #: prompts being prefilled, in the order they started (`interleave.next_prefill`)
        self._prefilling: list[Ticket] = []
        self._lock = threading.Lock()  # one scheduler step at a time
        self._state_lock = threading.Lock()  # guards live + bindings for readers
        self._special_ids = {tokenizer.special_id(s) for s in specials.TEMPLATE_SPECIALS}
        self.name_index = NameIndex(tokenizer, frozenset(self._special_ids))
        if not 1 <= burst <= batch_ops.BURST_STEPS:
            raise ValueError(f"burst takes 1…{batch_ops.BURST_STEPS} tokens, not {burst}")
        self.burst = burst
        #: burst programs run (`model.batch.burst`)
        self.bursts = 0
        self.spec: Speculator | None = None
        self.spec_max_batch = 0
        if speculative is not None:
            self._speculate(speculative, speculative_max_batch)
        self._think_start = tokenizer.special_id(specials.THINK_START)

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
        api: str = Api.ANTHROPIC,
    ) -> Prepared:
        """Validation and rendering, before queueing. Raises EngineError(400) for a
        tool_result that is neither live nor backed by a replayed tool_use, a prompt that
        does not fit the context, or more log-probabilities than a step computes."""
        return prepare(
            conversation,
            tokenizer=self.tokenizer,
            max_len=self.max_len,
            tool_memory=self.tool_memory,
            live_tool_ids=self.live_tool_ids,
            max_tokens=max_tokens,
            has_tools=has_tools,
            sampling=sampling,
            stop_sequences=stop_sequences,
            thinking_budget=thinking_budget,
            tool_choice=tool_choice,
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
        api: str = Api.ANTHROPIC,
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

    def segments_of(self, tokens: Sequence[int]) -> list[Segment]:
        """The text of `tokens` as segments. Runs of ordinary tokens are decoded together:
        a character split over byte-level tokens must come out whole, not as U+FFFD."""
        return segments_of(self.tokenizer, self._special_ids, tokens)

    def _span(self, tokens: int) -> int:
        """The span for `tokens` tokens; the context's own capacity also holds its last
        step (a reply that fills the context: `decoding.RowDecoder` stops there)."""
        return span_for(self.spans, min(tokens, self.max_len - 1))

    def _fit(self, state: Any, tokens: int) -> Any:
        """`state` (dense, holding at most `tokens` tokens) at the span for `tokens`."""
        span = self._span(tokens)
        if holds(self.cfg, state, span):
            return state
        return place_state(self.mesh, resize(state, cfg=self.cfg, span=span))

    def _resize_batch(self, span: int) -> None:
        """The batch's span: what its rows' compressed rows take in a step. Paged rows keep
        them in pages, so only the tables' width changes."""
        if self.pages is None:
            self._batch = place_batch(
                self.mesh, self.max_batch, resize(self._batch, cfg=self.cfg, span=span)
            )
        self._batch_span = span

    @property
    def _rows_follow_steps(self) -> bool:
        """The batch holds the rows a step runs, not `max_batch` (`_fit_rows`): dense rows
        on one data shard. Paged rows hold small parts only (nothing big to copy); rows
        split over a data axis keep `max_batch`, a multiple of it (a batch of one row did
        not split: `serve --mesh data=4,expert=2` without `--paged` refused to start)."""
        return self.pages is None and self._data == 1

    def _fit_rows(self, need: int) -> None:
        """The batch at `bucket(need)` rows (every active row below `need`): a step of four
        rows on a batch of eight copied their whole states out of it and back (~20 against
        ~16 ms on bench-192m, `model.batch.with_rows`); the batch grows and shrinks at
        admissions and steps instead, rarely."""
        if not self._rows_follow_steps:
            return
        rows = batch_ops.bucket(max(need, 1))
        have = jax.tree.leaves(self._batch)[0].shape[0]
        while have != rows:  # a size at a time: the transitions `warm_up` compiled
            sizes = batch_ops.BATCH_SIZES
            have = sizes[sizes.index(have) + (1 if have < rows else -1)]
            out = batch_ops.with_rows(self._batch, cfg=self.cfg, span=self._batch_span, rows=have)
            self._batch = place_batch(self.mesh, have, out)

    def _active_end(self) -> int:
        """One past the last active row (0: none)."""
        return max((i + 1 for i, t in enumerate(self._rows) if t is not None), default=0)

    def _new_batch(self) -> Any:
        rows = 1 if self._rows_follow_steps else self.max_batch
        empty = batch_ops.empty_batch(
            self.cfg, self._batch_span, rows, small=self.pages is not None
        )
        return place_batch(self.mesh, rows, empty)

    def warm_up(self, logprobs: bool = False) -> None:
        """Compile every prefill chunk size and the batched step at every size up to
        `max_batch` (before serving) — and, where bursts run, each size's burst and a row's
        step back — on throwaway states: no session is touched. With
        `stall_bound`, each size's mixed step with the smallest chunk too (other chunk sizes
        and spans compile on first use, then come from the persistent cache). `logprobs`:
        each of those steps' variant that reports log-probabilities too (else the first
        request asking for them compiles it). With speculation, each size's speculative
        step. And what a call's name under `tool_choice` any needs: the token index and
        the host's draw (a first such request stalled every stream ~1 s on them)."""
        for size in self.chunk_sizes:
            state = self._prefill(self._empty, [self.tokenizer.bos_id] * size, (size,))
            state.logits.block_until_ready()
        _ = self.name_index.by_bytes  # built once, here
        draw_among(np.zeros(self.cfg.vocab_size, np.float32), [0, 1],
                   np.zeros(2, np.uint32), sampling_arrays(1))  # fmt: skip
        # the batched step at every size up to max_batch, on a throwaway batch of the same
        # shapes (rows of the real one may be decoding), and the row insert / extract; with
        # pages, on the pool itself through null tables (nothing is read or written)
        with self._lock:
            scratch = self._new_batch()
            empty = self._empty if self.pages is None else small_part(self._empty)
            if not self._rows_follow_steps:  # one batch shape: insert / extract once
                scratch = batch_ops.insert(scratch, np.int32(0), empty)
                jax.block_until_ready(batch_ops.extract(scratch, np.int32(0)))
            # with the prefill bound, also each size's step with the smallest chunk riding in
            # it, the first that a prompt arriving while rows decode takes
            small = min(self.chunk_sizes)
            chunks = [None, (self._empty, np.zeros(small, np.int32), np.int32(1))]
            # (with data shards the step always runs the whole batch: `_step_size`)
            sizes = [self.max_batch] if self.shards > 1 else batch_ops.BATCH_SIZES
            for size in sizes:
                if size > self.max_batch:
                    break
                if self._rows_follow_steps:  # a batch of each size, grown from the last
                    scratch = batch_ops.with_rows(scratch, cfg=self.cfg, span=self._batch_span,
                                                  rows=size)  # fmt: skip
                    scratch = place_batch(self.mesh, size, scratch)
                    scratch = batch_ops.insert(scratch, np.int32(0), empty)
                    jax.block_until_ready(batch_ops.extract(scratch, np.int32(0)))
                grid = np.zeros((size, pages_for(self._batch_span)), np.int32)
                variants = [(c, lp) for c in chunks[: 2 if self.stall_bound else 1]
                            for lp in ((False, True) if logprobs else (False,))]  # fmt: skip
                sampling = (np.zeros((size, 2), np.uint32), *sampling_arrays(size))
                for chunk, lp in variants:
                    for _ in range(2):  # the second call sees the step's own outputs
                        scratch, *_ = self._step(scratch, grid, np.full(size, -1, np.int32),
                                                 *sampling, chunk=chunk, logprobs=lp)  # fmt: skip
                # every size, not only those up to the bound: the gate counts active rows,
                # and two of them in rows 2 and 3 step at size 4
                if self.spec is not None and self.spec_max_batch > 0:
                    scratch = self._warm_speculative(scratch, grid, size, sampling)
                if self._bursts_run:
                    # the burst (and a row's step back) a server decoding rows that only
                    # sample runs: else six streams' first tokens wait out its compile at
                    # each batch size (rows allowed nothing: nothing is written)
                    with on_mesh(self.mesh):
                        scratch, _, _, logits = batch_ops.burst(
                            self.params, scratch, np.zeros(size, np.int32), *sampling,
                            np.int32(self.tokenizer.eos_id), cfg=self.cfg, size=size,
                            steps=self.burst,
                        )  # fmt: skip
                        scratch = batch_ops.rewind_row(scratch, np.int32(0), np.int32(0),
                                                       logits[0, 0])  # fmt: skip
            if self._rows_follow_steps:  # and the batch shrinking size by size
                for size in (s for s in reversed(batch_ops.BATCH_SIZES) if s < self.max_batch):
                    scratch = batch_ops.with_rows(scratch, cfg=self.cfg, span=self._batch_span,
                                                  rows=size)  # fmt: skip
                jax.block_until_ready(scratch)
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
