"""A request's way from the queue to a decode row.

`Admission` routes the oldest waiting request (`continuation.pool.route`: a session and a
decision; beside the prompts in flight when its own is short, `interleave.overtakes`),
takes its base state (live, fork point, host tier, disk, or empty), prefills the suffix a
chunk at a time — stopping where the store wants a checkpoint and before a closing
`<think>` worth a fork point — and at the prompt's end retains the prompt as the session's
frontier and gives it a row. Where a prompt's prefill stops is decided by this module's
pure functions; `Admission` is a part of `Engine`, which makes and owns every state these
methods write (`core`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ds4jax.chat import specials
from ds4jax.chat.kinds import Api, Finish
from ds4jax.chat.segments import Segment, normalize
from ds4jax.chat.turn import Event, ParsedMessage
from ds4jax.continuation.decide import cold, match_disk
from ds4jax.continuation.pool import Route, route
from ds4jax.continuation.types import CacheSource, Decision, LiveFrontier, Rejection, source_label
from ds4jax.decoding import Result, RowDecoder, TokenLogprob, ToolCallStarted
from ds4jax.engine.placement import place_state
from ds4jax.engine.requests import Cancelled, EngineError, Prepared, prompt_too_long
from ds4jax.engine.ticket import Ticket
from ds4jax.interleave import PASS_BOUND, overtakes
from ds4jax.kvstore.host import HostState
from ds4jax.kvstore.store import KVStore, NoStore, SaveReason
from ds4jax.model import batch as batch_ops
from ds4jax.model.forward import plan_chunks
from ds4jax.model.page_io import PagedFrontier
from ds4jax.model.state import holds

#: one logger for the whole engine, so its lines keep the name they always had
log = logging.getLogger("ds4jax.engine")

THINK_START_SEGMENT = Segment(specials.THINK_START, True)

#: checkpoints a request tries to load, longest first, before it prefills cold
DISK_TRIES = 3
#: waiting requests looked at for one to start beside the prompts in flight
ADMISSION_SCAN = 8
#: what candidates beside prompts in flight are routed with (`_next_admission`)
NO_STORE = NoStore()
#: routes that continue a conversation a session holds (no session taken)
CONTINUES = (CacheSource.LIVE_TOOL, CacheSource.THINKING_VISIBLE, CacheSource.TOKEN_PREFIX,
             CacheSource.TEXT_PREFIX)  # fmt: skip


def save_points(
    decision: Decision,
    tokens: list[int],
    store: KVStore,
    segments_of: Callable[[Sequence[int]], list[Segment]],
) -> dict[int, str]:
    """Positions inside this prefill where the store wants a checkpoint (→ reason): the
    cold save point of a cold prefill, and every multiple of the continued interval."""
    points: dict[int, str] = {}
    every = store.continued_every
    if every:
        first = (decision.cached // every + 1) * every
        points |= dict.fromkeys(range(first, len(tokens), every), SaveReason.CONTINUED)
    if decision.source == CacheSource.COLD:
        cut = store.cold_cut(tuple(tokens), normalize(segments_of(tokens)))
        if cut:
            points[cut] = SaveReason.COLD
    # a short prompt's cold point is its end: saved whole, after the prefill
    return {
        p: r
        for p, r in points.items()
        if decision.cached < p < len(tokens) or (r == SaveReason.COLD and p == len(tokens))
    }


def before_think_cut(
    prepared: Prepared, decision: Decision, tokens: list[int], keep_forks: bool, think_start: int
) -> int | None:
    """Where to keep a second fork point, just before the prompt's closing `<think>`,
    if anywhere. In thinking mode without tools the official format replays this turn
    as `<｜Assistant｜></think>content`, so the prompt end (`…<think>`) is never a prefix
    of the next request; the state before `<think>` is — even after a reply cut short
    by max_tokens or a stop sequence, where no thinking-visible binding is left."""
    conv = prepared.conversation
    if (
        not keep_forks
        or not prepared.thinking
        or any(m.tools for m in conv.messages)
        or not tokens
        or tokens[-1] != think_start
        or len(tokens) - 1 <= len(decision.base)
    ):
        return None
    return len(tokens) - 1


def next_chunk(ticket: Ticket, limit: int, chunk_sizes: Sequence[int]) -> tuple[int, int] | None:
    """(end, padded size) of the prompt's next chunk: at most `limit` tokens, stopping at
    the store's save points and the fork point before `<think>`; None when the prompt
    is done."""
    stops = sorted({*ticket.cuts, ticket.before_think, len(ticket.tokens)} - {None})
    end = next((c for c in stops if c > ticket.done_tokens), None)
    if end is None:
        return None
    end = min(end, ticket.done_tokens + limit)
    ((size, _),) = plan_chunks(end - ticket.done_tokens, [s for s in chunk_sizes if s <= limit])
    return end, size


def suffix_estimate(decision: Decision, prompt_tokens: int) -> int:
    """The tokens a route leaves to prefill, before its suffix is tokenized: exact on the
    token paths, the request's tokens past the base on the text ones."""
    if decision.suffix_tokens is not None:
        return len(decision.suffix_tokens)
    return max(prompt_tokens - decision.cached, 1)


class Admission:
    """Submitting a request, and its prompt's prefill up to the row it takes."""

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

    def _drop_withdrawn(self) -> None:
        """Requests whose caller left while they waited end here, unrouted: no slot is
        chosen, no session displaced, nothing prefilled for a client that is gone."""
        gone = [t for t in self.waiting if t.withdrawn]
        if not gone:
            return
        with self._state_lock:
            for t in gone:
                self.waiting.remove(t)
        for t in gone:
            t.fail(Cancelled("the client went away while the request was queued"))

    def _withdraw(self, ticket: Ticket) -> None:
        """Its caller left while its prompt prefilled: the prefill stops at this chunk
        boundary. The session its route would replace keeps its live frontier (that is
        written only at the prompt's end); the prefix evaluated so far is kept as a fork
        point, so a client that timed out on a long prompt and sends it again continues
        from there (`route`'s fork-point path) instead of starting over."""
        self._prefilling.remove(ticket)
        done = ticket.done_tokens
        if done > len(ticket.decision.base):
            ids = tuple(ticket.tokens[:done])
            paged = ticket.base_paged
            on_pages = self.pages is not None and isinstance(paged, PagedFrontier)
            shard = self.pages.pool.table_shard(paged.table) if on_pages else 0
            kept = self._keep(ticket.state, ids, paged, shard)
            with self._state_lock:
                self.pool.retain(
                    LiveFrontier(kept, ids, normalize(self.segments_of(ids))), ticket.session.slot
                )
            self._enforce_budget(None)
        log.info("prefill withdrawn at %d of %d tokens: the client went away", done,
                 len(ticket.tokens))  # fmt: skip
        ticket.prefill_seconds = time.perf_counter() - ticket.t0
        ticket.succeed(Result(output_tokens=0, finish=Finish.CANCELLED,
                              message=ParsedMessage(reasoning=None), tool_ids=[],
                              **ticket.route_fields()))  # fmt: skip

    def _admit(self) -> None:
        """Start a waiting request (`_next_admission`) if a row is free for it — every
        prompt in flight has one for its end; with data shards one at a time, as a
        prompt's row must be of its pages' shard."""
        while self.waiting and self._free_rows() > len(self._prefilling):
            if self._prefilling and self.shards > 1:
                return
            picked = self._next_admission()
            if picked is None:
                return
            ticket, routed = picked
            self.waiting.remove(ticket)
            try:
                self._begin(ticket, routed)
            except Exception as err:
                ticket.fail(err)
                continue
            ticket.passed = 0
            self._prefilling.append(ticket)
            return

    def _next_admission(self) -> tuple[Ticket, Route | Rejection] | None:
        """The waiting request to start now, and its route: the oldest — beside prompts in
        flight only when its prefill is short (`interleave.overtakes`) — or, while the
        oldest waits for them, a later short one that continues a conversation a session
        holds, other than one the oldest continues (an agent's live tool turn no longer waits
        behind a new conversation waiting for a long prompt), at most `PASS_BOUND` times
        in a row. None: nothing starts this tick.

        Beside prompts in flight the candidates are routed without the disk store (a
        lookup waits for the store's pending saves: a tick froze for a whole checkpoint
        write): what starts beside them is short, and the one that starts is routed again
        with the store."""
        remaining = [len(t.tokens) - t.done_tokens for t in self._prefilling]
        if not remaining:  # the oldest starts whole, unless every slot is busy
            ticket = self.waiting[0]
            routed = self._route(ticket, self.store)
            return None if routed is None else (ticket, routed)
        head, head_slot = self.waiting[0], None
        for i, ticket in enumerate(list(itertools.islice(self.waiting, ADMISSION_SCAN))):
            routed = self._route(ticket, NO_STORE)
            if routed is None or isinstance(routed, Rejection):
                if i == 0 and routed is not None:
                    return ticket, routed  # refused at once
                continue
            if i == 0 and routed.decision.source in CONTINUES:
                head_slot = routed.slot  # the session the oldest continues: kept for it
            own = (routed.displaced is None and routed.decision.source in CONTINUES
                   and routed.slot != head_slot and head.passed < PASS_BOUND)  # fmt: skip
            suffix = suffix_estimate(routed.decision, len(ticket.prepared.view.tokens))
            if (i == 0 or own) and overtakes(suffix, remaining, self.chunk_sizes,
                                             displaces=self._displaces_agent(routed)):  # fmt: skip
                routed = self._route(ticket, self.store)
                if routed is None:
                    return None
                if i:
                    head.passed += 1
                return ticket, routed
        return None

    def _route(self, ticket: Ticket, store: Any) -> Route | Rejection | None:
        with self._state_lock:
            return route(ticket.prepared.view, self.pool, store, ticket.prepared.hint,
                         busy=self._busy_slots())  # fmt: skip

    def _displaces_agent(self, routed: Route) -> bool:
        """Whether the route replaces the live session of an agent between two tool turns
        (its tool results may come next: `interleave.overtakes`)."""
        if routed.displaced is None or not routed.displaced.pos:
            return False
        return self.pool.sessions[routed.slot].bindings.tool is not None

    def _begin(self, ticket: Ticket, routed: Route | Rejection) -> None:
        """Apply the routing decision: the base state, the suffix, the log line, the evict
        save of a displaced frontier; prefill starts at the next chunk."""
        prepared = ticket.prepared
        if isinstance(routed, Rejection):
            raise EngineError(routed.status, routed.message, routed.error_type)
        decision, session = routed.decision, self.pool.sessions[routed.slot]
        tries = 0
        while decision.source == CacheSource.DISK:
            try:
                disk_state = decision.disk.load()
                break
            except Exception as err:  # a checkpoint that cannot load is never served: the
                tries += 1  # store no longer offers it, so the next longest is tried
                shorter = match_disk(prepared.view, self.store) if tries < DISK_TRIES else None
                then = "the next longest checkpoint" if shorter else "cold prefill"
                log.warning("kv store: load of %s failed (%s); %s", decision.disk.key, err, then)
                decision = shorter or cold(prepared.view)
        if decision.source == CacheSource.COLD:
            base_state, base_segments = self._empty, ()
        elif decision.source == CacheSource.DISK:
            base_state, base_segments = place_state(self.mesh, disk_state), decision.disk.segments
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
            base_state = place_state(self.mesh, base_state.dense())
        if decision.suffix_tokens is not None:
            suffix = list(decision.suffix_tokens)
        else:
            suffix = self.tokenizer.encode_segments(decision.suffix_segments or ())
        tokens = list(decision.base) + suffix
        api = prepared.api
        if len(tokens) >= self.max_len:
            raise prompt_too_long(len(tokens), self.max_len, api)
        self._check_room(len(tokens), session.slot)
        base_state = self._fit(base_state, len(tokens))
        live_match = {CacheSource.LIVE_TOOL: "tool-output-ids"}
        if api != Api.ANTHROPIC:
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
            self._save(displaced.tokens, displaced.state, SaveReason.EVICT)

        ticket.routed, ticket.decision, ticket.session = routed, decision, session
        ticket.tokens, ticket.suffix_n, ticket.base_segments = tokens, len(suffix), base_segments
        ticket.state, ticket.done_tokens = base_state, len(decision.base)
        ticket.cuts = save_points(decision, tokens, self.store, self.segments_of)
        ticket.before_think = before_think_cut(
            prepared, decision, tokens, self.pool.keep_forks, self._think_start
        )
        ticket.t0 = time.perf_counter()

    def _prefill_chunk(self, ticket: Ticket, limit: int) -> None:
        """Evaluate the prompt's next chunk (`_next_chunk`) as a program of its own, and
        wait for the one before it: one chunk queued ahead keeps the device busy, and no
        more — dispatched without waiting, a 15k-token prompt's 30 chunks were queued in
        milliseconds, so a short request started beside it queued its own chunk behind all
        of them (9 s to its first token), and one arriving later was not even admitted
        until the prompt's end."""
        nxt = next_chunk(ticket, limit, self.chunk_sizes)
        if nxt is not None:
            end, size = nxt
            before = ticket.state
            state = self._prefill(before, ticket.tokens[ticket.done_tokens : end], (size,))
            before.logits.block_until_ready()
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
        self._prefilling.remove(ticket)
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
        self._fit_rows(max(row + 1, self._active_end()))
        self._batch = batch_ops.insert(self._batch, np.int32(row), state)
        self._rows[row] = ticket
        if self.spec is not None:
            self.spec.admit(row)
