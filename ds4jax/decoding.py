"""One request's decoding, token by token, as a state machine the batched step can drive.

The engine steps every active request together (`model.batch.step`); what each row does
between steps is here: before a step, `plan` says which token to force (tool_choice, a
spent thinking budget, teacher forcing), that the row samples — or samples among a few
tokens only (`CHOOSE`: a call's name under `tool_choice` any, `chat.tool_names`) —, or
that it is finished
(cancelled, max_tokens, a full context); after the step, `accept` takes the token the row
evaluated — or sampled EOS, which is never evaluated — feeds the streaming DSML parser and
the stop sequences, and may finish the row. `finish` turns the row's final state into its
session's live frontier and bindings and returns the `Result`.

A row that asked for log-probabilities (`SamplingParams.logprobs`) is handed each token's
`TokenLogprob` with it; `accept` emits it before any event the token produces and keeps it
for `Result.logprobs`, one entry per token `Result.output_tokens` counts.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ds4jax.chat import specials
from ds4jax.chat.dsml_parse import DSMLStreamParser, find_stop, stop_safe_len
from ds4jax.chat.ids import id_stream, new_tool_id
from ds4jax.chat.kinds import Api, Finish
from ds4jax.chat.segments import Segment, normalize, template
from ds4jax.chat.tool_names import DSML_TAG, NAME_OPEN, NameIndex, allowed, targets
from ds4jax.chat.turn import Event, ParsedMessage, ToolUseStart, collect_events
from ds4jax.continuation.types import CacheSource, LiveFrontier, ThinkingBinding, ToolBinding

# names for annotations only: at run time `ds4jax.engine.requests` would load the engine
# package, which imports this module
if TYPE_CHECKING:
    import threading

    from ds4jax.chat.tokenizer import Tokenizer
    from ds4jax.continuation.tool_memory import ToolMemory
    from ds4jax.engine.requests import Prepared

SAMPLE = -1  # `plan`: no forced token, the row samples
#: `plan`: the row samples among `RowDecoder.choices` only (a call's name)
CHOOSE = -2
ID_PREFIXES = {Api.ANTHROPIC: "toolu_"}  # the OpenAI protocols: `call_`


@dataclass(frozen=True)
class ToolCallStarted:
    """A tool call opened in the stream, with the id the turn will be remembered under."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and its position's most likely alternatives,
    under the model's raw distribution (`SamplingParams.logprobs`). `text` is the token
    decoded alone (a partial UTF-8 character comes out as U+FFFD), `bytes` its real bytes
    (OpenAI's `bytes`: a byte-level piece's, whole or partial). `top`: (token id, text,
    bytes, logprob) of the k most likely tokens, most likely first (ties: the lower id).
    Lists, as the wire has them: an entry compares by value but is not hashable."""

    token: int
    text: str
    bytes: list[int]
    logprob: float
    top: tuple[tuple[int, str, list[int], float], ...] = ()


def token_logprob(tokenizer: Tokenizer, token: int, logprob: float, top_ids: Sequence[int],
                  top_logprobs: Sequence[float]) -> TokenLogprob:  # fmt: skip
    """A `TokenLogprob` from a step's numbers (`model.batch.Logprobs`, sliced to k)."""

    def piece(t: int) -> tuple[str, list[int]]:
        return tokenizer.decode([t]), list(tokenizer.token_bytes(t))

    top = tuple((int(t), *piece(int(t)), float(lp)) for t, lp in zip(top_ids, top_logprobs,
                                                                       strict=True))  # fmt: skip
    return TokenLogprob(int(token), *piece(int(token)), float(logprob), top)


@dataclass
class Result:
    source: CacheSource
    cached: int  # tokens reused from a stored state
    prefilled: int  # tokens evaluated for the prompt
    output_tokens: int
    finish: Finish  # how the turn ended
    message: ParsedMessage
    tool_ids: list[str]
    stop_sequence: str | None = None
    raw_text: str = ""
    prefill_seconds: float = 0.0
    session: int = 0  # the slot that served it
    forked_from: int | None = None  # the slot whose fork point it continued
    restored: str | None = None  # the tier its base state came back from ("host")
    #: with `SamplingParams.logprobs`: one entry per token `output_tokens` counts, in order
    #: (a sampled EOS included), else None
    logprobs: list[TokenLogprob] | None = None
    #: of `output_tokens`, those of the reasoning (through its `</think>`)
    reasoning_tokens: int = 0
    #: the token ids the state it left holds (its live frontier's): the first
    #: `prompt_tokens` of them are the prompt as evaluated — on a live continuation the
    #: sampled ids, whatever the client's history renders to (`--trace` writes both)
    evaluated: tuple[int, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return self.cached + self.prefilled


class RowOwner(Protocol):
    """What a row asks of the engine that steps it (`ds4jax.engine.Engine` is one): a
    protocol, so decoding stays below the engine — it names the engine's request types
    (`ds4jax.engine.requests`), never the engine."""

    tokenizer: Tokenizer
    max_len: int
    tool_memory: ToolMemory
    #: the tokens a call's name may take (`tool_choice` any among several tools)
    name_index: NameIndex
    #: held while `finish` writes the session's frontier and bindings
    _state_lock: threading.Lock

    def live_tool_ids(self) -> frozenset[str]: ...

    def segments_of(self, tokens: Sequence[int]) -> list[Segment]: ...


def _tool_ids_complete(message: ParsedMessage) -> bool:
    calls = message.tool_calls
    return bool(calls) and message.error is None and all(c.complete for c in calls)


class RowDecoder:
    def __init__(
        self,
        engine: RowOwner,
        prepared: Prepared,
        session: Any,
        tokens: list[int],
        segments: tuple[Segment, ...],
        emit: Callable[[Event | ToolCallStarted | TokenLogprob], None],
        cancel: Any,
        forced: list[int] | None,
    ) -> None:
        self.engine, self.prepared, self.session = engine, prepared, session
        self.tokens, self.segments = tokens, segments
        self.emit, self.cancel, self.forced = emit, cancel, forced
        tok = engine.tokenizer
        self.parser = DSMLStreamParser(thinking=prepared.thinking)
        self.events: list[Event] = []
        self.tool_ids: list[str] = []
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.raw = ""
        self.fed = 0  # chars of `raw` given to the parser
        self.generated: list[int] = []
        self.finish_reason: Finish | None = None
        self.stop_hit: str | None = None
        self.think_end = tok.special_id(specials.THINK_END)
        self.in_thinking = prepared.thinking
        self.queue: list[int] = []  # tokens forced by tool_choice / disable_parallel_tool_use
        self.forced_at = 0
        self.pending_force = prepared.force_after_think
        #: with `tool_choice` any among several tools: what a call's name must spell, the
        #: bytes of the one being spelled (None: none is), and the next token's choices
        self.name_goals = targets(prepared.tool_names)
        self.name_written: bytes | None = None
        self.choices: list[int] = []
        self.closed_single = False
        self._id_hex = id_stream(prepared.nonce)
        #: a sampled EOS (counted in `output_tokens`, never evaluated)
        self.sampled_eos = False
        #: a forced token `take` found planned where a burst had sampled: the next plan
        self.ahead: int | None = None
        #: a request without tools (or with `tool_choice` none) whose model began a tool-call
        #: block: the turn ended at its marker, the block shown to no one (`accept`)
        self.block_dropped = False
        self.logprobs: list[TokenLogprob] | None = (
            None if prepared.sampling.logprobs is None else []
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def naming(self) -> bool:
        """Whether this row spells, or may next spell, a call's name held to the declared
        ones (`tool_choice` any among several tools): while it spells one, and while its
        text since its last DSML marker could still become a call's opening — so it steps
        plain, its choices drawn from the logits it holds (a speculative step's drafts and
        samples never see the mask); its reasoning and a call's arguments speculate."""
        if not self.name_goals or self.pending_force is not None:
            return False
        if self.name_written is not None:
            return True
        at = self.raw.rfind(DSML_TAG)
        return at >= 0 and NAME_OPEN.startswith(self.raw[at:])

    def _push(self, events: list[Event]) -> None:
        for ev in events:
            self.events.append(ev)
            if isinstance(ev, ToolUseStart):
                taken = [*self.tool_ids, *self.engine.live_tool_ids()]
                tid = new_tool_id(taken, ID_PREFIXES.get(self.prepared.api, "call_"),
                                  self._id_hex)  # fmt: skip
                self.tool_ids.append(tid)
                self.emit(ToolCallStarted(ev.index, tid, ev.name))
            self.emit(ev)

    def plan(self) -> int | None:
        """Before a step: a forced token id, `SAMPLE`, or None when the row is finished."""
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            return ahead
        p, tok = self.prepared, self.engine.tokenizer
        if len(self.generated) >= p.max_tokens:
            self.finish_reason = Finish.MAX_TOKENS
            return None
        if self.cancel is not None and self.cancel.is_set():
            self.finish_reason = Finish.CANCELLED
            return None
        if len(self.tokens) >= self.engine.max_len:
            self.finish_reason = Finish.MAX_TOKENS
            return None
        if self.pending_force is not None and not self.in_thinking:
            self.queue = tok.encode_segments(template(self.pending_force))
            self.pending_force = None
        if self.queue:  # server-forced tokens (tool_choice) come first
            return self.queue.pop(0)
        if (
            self.in_thinking
            and p.thinking_budget is not None
            and len(self.generated) >= p.thinking_budget
        ):
            return self.think_end  # the budget is spent: close the reasoning
        if self.forced is not None:  # teacher forcing (tests) stands in for sampling only
            if self.forced_at >= len(self.forced):
                self.finish_reason = Finish.END_TURN
                return None
            self.forced_at += 1
            return int(self.forced[self.forced_at - 1])
        if self.name_written is not None:
            self.choices = allowed(self.engine.name_index, self.name_written, self.name_goals)
            if len(self.choices) > 1:
                return CHOOSE
            if self.choices:
                return self.choices[0]
            self.name_written = None  # a dead end (no token spells the rest): left free
        return SAMPLE

    def room(self, most: int) -> int:
        """Tokens, up to `most`, this row may sample in a row before its output or the
        context ends (a burst's `allowed`; what else stops it, `take` finds)."""
        p = self.prepared
        return max(0, min(most, p.max_tokens - len(self.generated),
                          self.engine.max_len - len(self.tokens)))  # fmt: skip

    def take(self, t: int) -> bool:
        """A token a burst sampled for this row ahead of its plan: accepted where the row
        would have sampled (`plan` says `SAMPLE`); else not — a forced token planned instead
        is the next plan, a finished row takes nothing — and the row steps back to here."""
        planned = self.plan()
        if planned is None:
            return False
        if planned != SAMPLE:
            self.ahead = planned
            return False
        self.accept(t)
        return True

    def accept(self, t: int, logprob: TokenLogprob | None = None) -> None:
        """After a step: the token this row evaluated (or sampled EOS, not evaluated), with
        its `logprob` when the row asked for them (emitted before its events)."""
        p, tok = self.prepared, self.engine.tokenizer
        eos = t == tok.eos_id
        if eos and self.pending_force is not None and self.in_thinking:
            # `tool_choice` any / tool must end in a call: an EOS sampled inside the
            # reasoning (never evaluated) becomes its close, and the call opening follows
            self.ahead = self.think_end
            return
        counted = not eos or self.forced is None  # a teacher-forced EOS is no output token
        if self.logprobs is not None and counted:
            if logprob is None or logprob.token != t:
                raise RuntimeError(f"token {t} of a row that reports logprobs came without "
                                   "its own (a step that does not compute them)")  # fmt: skip
            self.logprobs.append(logprob)
            self.emit(logprob)
        if eos:
            self.sampled_eos = counted
            self.finish_reason = Finish.END_TURN  # never evaluated: the next turn's suffix has it
            return
        self.generated.append(t)
        self.tokens.append(t)
        if t == self.think_end:
            self.in_thinking = False
        piece = self.utf8.decode(tok.token_bytes(t))
        self.raw += piece
        if self.name_written is not None:
            self.name_written += tok.token_bytes(t)
            if self.name_written in self.name_goals:  # spelled out: the call goes on freely
                self.name_written = None
        elif self.name_goals and not self.in_thinking:
            self._name_opened(len(piece))
        stops = p.stop_sequences
        hit = find_stop(self.raw, stops) if stops else None
        if hit is not None:
            at, length = hit
            self._push(self.parser.feed(self.raw[self.fed : at]))
            self.fed = at
            self.stop_hit = self.raw[at : at + length]
            self.finish_reason = Finish.STOP_SEQUENCE
            return
        safe = stop_safe_len(self.raw, stops) if stops else len(self.raw)
        if safe > self.fed:
            self._push(self.parser.feed(self.raw[self.fed : safe]))
            self.fed = safe
        if p.has_tools and self.parser.raw_dsml is not None:
            self.finish_reason = Finish.TOOL_USE
            return
        if not p.has_tools and self.parser.in_block:
            # no tool was offered, so no call is answered (a call to a name the client never
            # declared would break it): the turn ends where the block begins, its text kept
            self.block_dropped = True
            self.finish_reason = Finish.END_TURN
            return
        if p.single_tool_call and not self.closed_single and not self.queue:
            after = self.raw.rfind(specials.THINK_END) + 1 if p.thinking else 0
            if "</" + specials.DSML + "invoke>" in self.raw[after:]:
                close = "\n</" + specials.DSML + "tool_calls>"
                self.queue = tok.encode_segments(template(close))
                self.closed_single = True

    def _name_opened(self, last: int) -> None:
        """A call's name begins when the row's text ends in its opening — the forced one's
        or another call's — or when the last token (`last` characters of it) ran past the
        opening into the name (`="_`, `"github`: 152 V4 tokens straddle it): held from
        there while that start is on a declared name (one that is not cannot be taken
        back)."""
        at = self.raw.rfind(NAME_OPEN, max(0, len(self.raw) - last - len(NAME_OPEN)))
        if at < 0 or at + len(NAME_OPEN) <= len(self.raw) - last:
            return  # none, or one that ended before this token
        written = self.raw[at + len(NAME_OPEN) :].encode("utf-8")
        if written not in self.name_goals and any(g.startswith(written) for g in self.name_goals):
            self.name_written = written

    def finish(self, state: Any) -> Result:
        """The row's final state (holding `self.tokens`) becomes its session's live frontier;
        returns the request's result (the prompt fields are the engine's to fill)."""
        engine, p, finish = self.engine, self.prepared, self.finish_reason or Finish.MAX_TOKENS
        raw = self.raw
        if finish != Finish.STOP_SEQUENCE and not self.block_dropped:
            raw += self.utf8.decode(b"", final=True)
            if self.fed < len(raw):
                self._push(self.parser.feed(raw[self.fed :]))
        self.raw = raw
        if not self.block_dropped:  # a dropped block's unfinished call is no one's
            self._push(self.parser.finish())

        message = collect_events(self.events, thinking=p.thinking)
        message.raw_dsml = self.parser.raw_dsml
        message.error = self.parser.error
        if finish not in (
            Finish.STOP_SEQUENCE,
            Finish.CANCELLED,
            Finish.MAX_TOKENS,
        ) and _tool_ids_complete(message):
            finish = Finish.TOOL_USE

        live = LiveFrontier(
            state,
            tuple(self.tokens),
            normalize([*self.segments, *engine.segments_of(self.generated)]),
        )
        session = self.session
        with engine._state_lock:
            session.live = live
            session.bindings.tool = None
            session.bindings.thinking = None
            if finish == Finish.TOOL_USE and self.parser.raw_dsml is not None:
                engine.tool_memory.remember(self.tool_ids, self.parser.raw_dsml)
                session.bindings.tool = ToolBinding(frozenset(self.tool_ids), live.pos)
            if (
                p.thinking
                and message.reasoning is not None
                and not self.in_thinking
                and (
                    (
                        finish == Finish.END_TURN
                        and not p.has_tools
                        and not message.tool_calls
                        and not self.block_dropped
                    )  # its live tokens hold the marker too
                    or (p.api != Api.ANTHROPIC and finish in (Finish.END_TURN, Finish.TOOL_USE))
                )
            ):
                shown = [Segment(message.content)]
                if finish == Finish.TOOL_USE and self.parser.raw_dsml is not None:
                    shown += template(self.parser.raw_dsml)
                session.bindings.thinking = ThinkingBinding(
                    visible_transcript(p.view.segments, shown, keep_think=p.has_tools), live.pos
                )
        return Result(
            source=CacheSource.COLD,
            cached=0,
            prefilled=0,
            output_tokens=len(self.generated) + (1 if self.sampled_eos else 0),
            finish=finish,
            message=message,
            tool_ids=self.tool_ids if message.tool_calls else [],
            stop_sequence=self.stop_hit,
            raw_text=raw,
            logprobs=self.logprobs,
            reasoning_tokens=self._reasoning_tokens(),
            evaluated=live.tokens,
        )

    def _reasoning_tokens(self) -> int:
        if not self.prepared.thinking:
            return 0
        if self.think_end in self.generated:
            return self.generated.index(self.think_end) + 1
        return len(self.generated)  # cut (or ended) inside the reasoning


def visible_transcript(
    prompt: tuple[Segment, ...], shown: list[Segment], *, keep_think: bool = False
) -> tuple[Segment, ...]:
    """What the next render shows for this turn without its reasoning: the prompt, `</think>`,
    then what the turn showed (its content, and the sampled DSML block of a tool-call turn).
    Without tools the official format drops old reasoning and renders the turn as
    `<｜Assistant｜></think>…`, so the prompt's closing `<think>` goes; with tools it keeps
    reasoning, and a client that did not replay it renders `<think></think>…`
    (`keep_think`). The EOS that follows is deliberately left out, so the next turn's suffix
    starts with it."""
    body = list(prompt)
    if not keep_think and body and body[-1] == Segment(specials.THINK_START, True):
        body.pop()
    return normalize([*body, Segment(specials.THINK_END, True), *shown])
