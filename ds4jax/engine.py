"""The engine: the single owner of the params and of every retained state.

One request at a time (`run` holds a lock; the server gives it one worker thread):
validate (`prepare`) → route (`continuation.pool.route`: a session and a decision) →
prefill the suffix in chunks → retain the prompt-end state as a fork point → decode with
sampling and stop conditions → events through the streaming DSML parser → update that
session's bindings → drop what the state budget no longer holds (`pool.evictions`, saved to
disk first when a store is configured). A live frontier is replaced, never mutated, and only
after the step that produced it finished; a cancelled or failed request leaves a consistent
frontier (the last evaluated token). Fork points hold prompt ends only, never a state that
would paper over a tool-id mismatch.

`Engine(...)` alone is the single-session engine of the original rules (one session, no
fork points); `ds4jax serve` runs it with `--sessions` (default 4) and fork points on.
"""

from __future__ import annotations

import codecs
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ds4jax.chat import specials
from ds4jax.chat.anthropic import MessagesRequest
from ds4jax.chat.conversation import Conversation
from ds4jax.chat.dsml_parse import (
    DSMLStreamParser,
    Event,
    ParsedMessage,
    ToolUseStart,
    collect_events,
    find_stop,
    stop_safe_len,
)
from ds4jax.chat.render import render
from ds4jax.chat.segments import Segment, normalize, template
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.config import Config
from ds4jax.continuation.evidence import attach_tool_memory, tool_tail, validate_tool_results
from ds4jax.continuation.pool import Pool, Route, Session, evictions, route
from ds4jax.continuation.tool_memory import ToolMemory, new_tool_id
from ds4jax.continuation.types import (
    Bindings,
    CacheSource,
    Decision,
    LiveFrontier,
    Rejection,
    RequestView,
    ThinkingBinding,
    ToolBinding,
)
from ds4jax.kvstore.store import KVStore, NoStore
from ds4jax.model.forward import CHUNK_SIZES, decode_step, prefill
from ds4jax.model.params import Params
from ds4jax.model.state import capacity_bytes, init_state
from ds4jax.sampling import sample

log = logging.getLogger("ds4jax.engine")

THINK_START_SEGMENT = Segment(specials.THINK_START, True)


class EngineError(RuntimeError):
    """A request the engine refuses; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None


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
    #: a client's session hint (`metadata.user_id`, `x-session-id`): breaks routing ties
    hint: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.view.tokens)


@dataclass(frozen=True)
class ToolCallStarted:
    """A tool call opened in the stream, with the id the turn will be remembered under."""

    index: int
    id: str
    name: str


@dataclass
class Result:
    source: CacheSource
    cached: int  # tokens reused from a stored state
    prefilled: int  # tokens evaluated for the prompt
    output_tokens: int
    finish: str  # end_turn | max_tokens | stop_sequence | tool_use | cancelled
    message: ParsedMessage
    tool_ids: list[str]
    stop_sequence: str | None = None
    raw_text: str = ""
    prefill_seconds: float = 0.0
    session: int = 0  # the slot that served it
    forked_from: int | None = None  # the slot whose fork point it continued

    @property
    def prompt_tokens(self) -> int:
        return self.cached + self.prefilled


def _tool_ids_complete(message: ParsedMessage) -> bool:
    calls = message.tool_calls
    return bool(calls) and message.error is None and all(c.complete for c in calls)


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
    ) -> None:
        """`sessions`, `fork_points`, `state_budget_bytes`: the session pool
        (`continuation.pool`); the budget bounds the retained states (None: unbounded)."""
        self.cfg = cfg
        self.params = params
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.store = store or NoStore()
        self.tool_memory = tool_memory or ToolMemory()
        self.chunk_sizes = tuple(chunk_sizes)
        self._empty = init_state(cfg, max_len)
        self.state_nbytes = capacity_bytes(cfg, max_len)
        if state_budget_bytes is not None and state_budget_bytes < self.state_nbytes:
            raise ValueError(
                f"the state budget ({state_budget_bytes} bytes) holds no state: one takes "
                f"{self.state_nbytes} bytes at a context of {max_len}"
            )
        self._pool_args = dict(budget=state_budget_bytes, state_nbytes=self.state_nbytes,
                               keep_forks=fork_points)  # fmt: skip
        self.pool = Pool.create(sessions, **self._pool_args)
        self._lock = threading.Lock()  # one request at a time
        self._state_lock = threading.Lock()  # guards live + bindings for readers
        self._special_ids = {tokenizer.special_id(s) for s in specials.TEMPLATE_SPECIALS}
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
    ) -> Prepared:
        """Validation and rendering, before queueing. Raises EngineError(400) for a
        tool_result that is neither live nor backed by a replayed tool_use, or a prompt that
        does not fit the context."""
        try:
            requires_live = validate_tool_results(conversation, self.live_tool_ids())
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
        view = RequestView(segments, tokens, tail_ids, tail, requires_live)
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
        )

    def prepare_request(
        self,
        req: MessagesRequest,
        *,
        max_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        hint: str | None = None,
    ) -> Prepared:
        """`prepare` for a parsed Messages request: its stop sequences, thinking budget and
        tool_choice; tools count when the rendered conversation declares some (tool_choice
        "none" has removed them). `max_tokens` overrides the request's; `hint` (a client's
        session header) takes precedence over its `metadata.user_id`."""
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
        )

    # ------------------------------------------------------------------ worker side

    def _segments_of(self, tokens: Sequence[int]) -> list[Segment]:
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

    def route(self, prepared: Prepared) -> Route | Rejection:
        with self._state_lock:
            return route(prepared.view, self.pool, self.store, prepared.hint)

    def decide(self, prepared: Prepared) -> Decision | Rejection:
        r = self.route(prepared)
        return r if isinstance(r, Rejection) else r.decision

    def run(
        self,
        prepared: Prepared,
        *,
        on_event: Callable[[Event | ToolCallStarted], None] | None = None,
        progress: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
        on_decision: Callable[[Decision, int], None] | None = None,
        forced_tokens: Sequence[int] | None = None,
    ) -> Result:
        """Serve one request. `on_decision(decision, prefill_tokens)` fires once the path is
        chosen, before prefill. `forced_tokens` replaces sampling by these tokens (teacher
        forcing, for tests only: the model still evaluates every one of them)."""
        with self._lock:
            return self._run(prepared, on_event, progress, cancel, on_decision, forced_tokens)

    def _run(self, prepared, on_event, progress, cancel, on_decision, forced_tokens) -> Result:
        emit = on_event or (lambda _e: None)
        routed = self.route(prepared)
        if isinstance(routed, Rejection):
            raise EngineError(routed.status, routed.message, routed.error_type)
        decision, session = routed.decision, self.pool.sessions[routed.slot]

        # ---- the base state and the suffix
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
            base_state, base_segments = disk_state, decision.disk.segments
            for tid, block in decision.disk.tool_entries.items():
                self.tool_memory.remember([tid], block)
        elif decision.source == CacheSource.FORK:
            base_state, base_segments = routed.fork.frontier.state, routed.fork.frontier.segments
        else:
            assert session.live is not None
            base_state, base_segments = session.live.state, session.live.segments
        if decision.suffix_tokens is not None:
            suffix = list(decision.suffix_tokens)
        else:
            suffix = self.tokenizer.encode_segments(decision.suffix_segments or ())
        tokens = list(decision.base) + suffix
        if len(tokens) >= self.max_len:
            raise EngineError(
                400, f"prompt is too long: {len(tokens)} tokens, the context is {self.max_len}"
            )
        if decision.source == CacheSource.LIVE_TOOL:
            log.info(
                "anthropic live continuation match=tool-output-ids ids=%d cached=%d prompt=%d "
                "session=%d",
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

        if on_decision is not None:
            on_decision(decision, len(suffix))

        # A request that takes a used slot replaces its live frontier: keep it on disk
        # first, so a client that comes back to that conversation finds it (ds4's "evict")
        displaced = routed.displaced
        if displaced is not None and displaced.pos:
            self._save(displaced.tokens, displaced.state, "evict")

        # ---- prefill the suffix, stopping at the store's save points
        t0 = time.perf_counter()
        state = base_state
        done = len(decision.base)
        cuts = self._save_points(decision, tokens)
        before_think = self._before_think_cut(prepared, decision, tokens)
        before_think_state = None
        for cut in [*sorted({*cuts, before_think} - {None}), len(tokens)]:
            if cut <= done:
                continue
            state, _ = prefill(
                self.params, state, tokens[done:cut], self.cfg, chunk_sizes=self.chunk_sizes,
                progress=(lambda d, _t, o=done: progress(o + d - len(decision.base), len(suffix)))
                if progress else None,
            )  # fmt: skip
            done = cut
            if cut in cuts:
                self._save(tuple(tokens[:cut]), state, cuts[cut])
            if cut == before_think:
                before_think_state = state
        state.logits.block_until_ready()
        prefill_seconds = time.perf_counter() - t0
        log.info("prompt done %.3fs", prefill_seconds)
        if decision.suffix_tokens is not None:  # all request tokens (cold, token prefixes)
            live_segments = prepared.view.segments
        else:
            live_segments = normalize([*base_segments, *(decision.suffix_segments or ())])
        prompt_end = LiveFrontier(state, tuple(tokens), live_segments)
        with self._state_lock:
            pool = self.pool
            if decision.source in (CacheSource.FORK, CacheSource.DISK, CacheSource.COLD):
                session.clear()  # a new conversation in this slot
            session.live = prompt_end
            session.used = pool.tick()
            session.hint = prepared.hint or session.hint
            pool.current = session.slot
            pool.hits[decision.source.value] += 1
            if decision.source != CacheSource.LIVE_TOOL:
                session.bindings.tool = None
            if decision.source != CacheSource.THINKING_VISIBLE:
                session.bindings.thinking = None
            pool.retain(prompt_end, session.slot)
            if before_think_state is not None and live_segments[-1:] == (THINK_START_SEGMENT,):
                pool.retain(
                    LiveFrontier(before_think_state, tuple(tokens[:-1]), live_segments[:-1]),
                    session.slot,
                )

        # ---- decode
        try:
            result = self._decode(
                prepared, session, state, tokens, live_segments, emit, cancel, forced_tokens
            )
        finally:
            self._enforce_budget(session.slot)
        result.source = decision.source
        result.cached = decision.cached
        result.prefilled = len(suffix)
        result.prefill_seconds = prefill_seconds
        result.session = session.slot
        result.forked_from = routed.fork.owner if routed.fork is not None else None
        return result

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

    def _enforce_budget(self, keep: int) -> None:
        """Drop what the state budget no longer holds; with a store, evicted states are
        saved first (they come back as disk hits)."""
        with self._state_lock:
            forks, slots = evictions(self.pool, keep)
            dropped = [f.frontier for f in forks]
            dropped += [self.pool.sessions[i].live for i in slots]
            self.pool.forks = [f for f in self.pool.forks if f not in forks]
            for i in slots:
                self.pool.sessions[i].clear()
        for frontier in dropped:
            if frontier is not None and frontier.pos:
                log.info("evict %d tokens (state budget)", frontier.pos)
                self._save(frontier.tokens, frontier.state, "evict")

    def _decode(self, prepared, session, state, tokens, segments, emit, cancel, forced) -> Result:
        tok = self.tokenizer
        parser = DSMLStreamParser(thinking=prepared.thinking)
        events: list[Event] = []
        tool_ids: list[str] = []
        stops = prepared.stop_sequences
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        raw = ""
        fed = 0  # chars of `raw` given to the parser
        generated: list[int] = []
        finish = "max_tokens"
        stop_hit: str | None = None
        seed = prepared.sampling.seed
        key = jax.random.key(seed if seed is not None else time.time_ns() % (2**31))
        think_end = tok.special_id(specials.THINK_END)
        in_thinking = prepared.thinking
        queue: list[int] = []  # tokens forced by tool_choice / disable_parallel_tool_use
        forced_at = 0
        pending_force = prepared.force_after_think
        closed_single = False
        invoke_close = "</" + specials.DSML + "invoke>"

        def push(events_in: list[Event]) -> None:
            for ev in events_in:
                events.append(ev)
                if isinstance(ev, ToolUseStart):
                    tid = new_tool_id([*tool_ids, *self.live_tool_ids()])
                    tool_ids.append(tid)
                    emit(ToolCallStarted(ev.index, tid, ev.name))
                emit(ev)

        budget = prepared.max_tokens
        while len(generated) < budget:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if len(tokens) >= self.max_len:
                finish = "max_tokens"
                break
            if pending_force is not None and not in_thinking:
                queue = tok.encode_segments(template(pending_force))
                pending_force = None
            if queue:  # server-forced tokens (tool_choice) come first
                t = queue.pop(0)
            elif (
                in_thinking
                and prepared.thinking_budget is not None
                and len(generated) >= prepared.thinking_budget
            ):
                t = think_end  # the budget is spent: close the reasoning
            elif forced is not None:  # teacher forcing (tests) stands in for sampling only
                if forced_at >= len(forced):
                    finish = "end_turn"
                    break
                t = int(forced[forced_at])
                forced_at += 1
            else:
                key, sub = jax.random.split(key)
                sp = prepared.sampling
                t = int(
                    sample(
                        state.logits, sub, temperature=sp.temperature, top_k=sp.top_k,
                        top_p=sp.top_p, min_p=sp.min_p,
                    )
                )  # fmt: skip
            if t == tok.eos_id:
                finish = "end_turn"  # sampled, never evaluated: the next turn's suffix has it
                break
            state = decode_step(self.params, state, t, self.cfg)
            generated.append(t)
            tokens.append(t)
            if t == think_end:
                in_thinking = False
            raw += utf8.decode(tok.token_bytes(t))
            hit = find_stop(raw, stops) if stops else None
            if hit is not None:
                at, length = hit
                push(parser.feed(raw[fed:at]))
                fed = at
                stop_hit = raw[at : at + length]
                finish = "stop_sequence"
                break
            safe = stop_safe_len(raw, stops) if stops else len(raw)
            if safe > fed:
                push(parser.feed(raw[fed:safe]))
                fed = safe
            if prepared.has_tools and parser.raw_dsml is not None:
                finish = "tool_use"
                break
            if prepared.single_tool_call and not closed_single and not queue:
                after = raw.rfind(specials.THINK_END) + 1 if prepared.thinking else 0
                if invoke_close in raw[after:]:
                    queue = tok.encode_segments(template("\n</" + specials.DSML + "tool_calls>"))
                    closed_single = True
        raw += utf8.decode(b"", final=True) if finish != "stop_sequence" else ""
        if finish != "stop_sequence" and fed < len(raw):
            push(parser.feed(raw[fed:]))
        push(parser.finish())

        message = collect_events(events, thinking=prepared.thinking)
        message.raw_dsml = parser.raw_dsml
        message.error = parser.error
        if finish != "stop_sequence" and finish != "cancelled" and _tool_ids_complete(message):
            if finish != "max_tokens":
                finish = "tool_use"

        live = LiveFrontier(
            state, tuple(tokens), normalize([*segments, *self._segments_of(generated)])
        )
        with self._state_lock:
            session.live = live
            session.bindings.tool = None
            session.bindings.thinking = None
            if finish == "tool_use" and parser.raw_dsml is not None:
                self.tool_memory.remember(tool_ids, parser.raw_dsml)
                session.bindings.tool = ToolBinding(frozenset(tool_ids), live.pos)
            elif (
                finish == "end_turn"
                and prepared.thinking
                and not prepared.has_tools
                and not message.tool_calls
                and message.reasoning is not None
                and not in_thinking
            ):
                session.bindings.thinking = ThinkingBinding(
                    self._visible_transcript(prepared.view.segments, message.content), live.pos
                )
        return Result(
            source=CacheSource.COLD,
            cached=0,
            prefilled=0,
            output_tokens=len(generated) + (1 if finish == "end_turn" and forced is None else 0),
            finish=finish,
            message=message,
            tool_ids=tool_ids if message.tool_calls else [],
            stop_sequence=stop_hit,
            raw_text=raw,
        )

    @staticmethod
    def _visible_transcript(prompt: tuple[Segment, ...], content: str) -> tuple[Segment, ...]:
        """What the next render shows for this turn once its reasoning is dropped: the prompt
        with its closing `<think>` turned into `</think>`, then the content. The EOS that
        follows is deliberately left out, so the next turn's suffix starts with it."""
        body = list(prompt)
        if body and body[-1] == Segment(specials.THINK_START, True):
            body.pop()
        return normalize([*body, Segment(specials.THINK_END, True), Segment(content)])

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
            cut = self.store.cold_cut(tuple(tokens), normalize(self._segments_of(tokens)))
            if cut:
                points[cut] = "cold"
        # a short prompt's cold point is its end: saved whole, after the prefill
        return {
            p: r
            for p, r in points.items()
            if decision.cached < p < len(tokens) or (r == "cold" and p == len(tokens))
        }

    def _save(self, tokens: tuple[int, ...], state: Any, reason: str) -> None:
        """Hand a state to the store. Never rolls the live state back; a failing store is
        logged, not raised: serving goes on without the checkpoint."""
        try:
            self.store.save(
                tokens, normalize(self._segments_of(tokens)), state, reason, self.tool_memory
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

    # ------------------------------------------------------------------ introspection

    def warm_up(self) -> None:
        """Compile every prefill chunk size and the decode step (before serving), on a
        throwaway state: the live frontier is untouched."""
        for size in self.chunk_sizes:
            state, _ = prefill(self.params, self._empty, [self.tokenizer.bos_id] * size, self.cfg,
                               chunk_sizes=(size,))  # fmt: skip
            state.logits.block_until_ready()
        decode_step(
            self.params, self._empty, self.tokenizer.bos_id, self.cfg
        ).logits.block_until_ready()

    def logits_for(self, tokens: Sequence[int]) -> np.ndarray:
        """Next-token logits of a cold prefill of `tokens` (fidelity checks)."""
        state, _ = prefill(
            self.params, self._empty, list(tokens), self.cfg, chunk_sizes=self.chunk_sizes
        )
        return np.asarray(state.logits)

    def reset(self) -> None:
        """Forget every session and fork point (a restart, as far as RAM goes)."""
        with self._lock, self._state_lock:
            self.pool = Pool.create(len(self.pool.sessions), **self._pool_args)
