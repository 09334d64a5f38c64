"""Request preparation, on the client's thread: a converted request (`Conversation`) checked
against the live tool ids, rendered, tokenized and given its forcing, as a `Prepared`; and
the way back, tokens to segments.

Functions of what they are handed (the tokenizer, the context, the tool memory and the live
tool ids), apart from the scheduler: a request is refused before it queues, and of what the
engine holds only the tool memory's recency is touched (a replayed block refreshes its ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ds4jax.chat.conversation import Conversation
from ds4jax.chat.kinds import Api
from ds4jax.chat.render import render
from ds4jax.chat.segments import Segment, normalize
from ds4jax.chat.tokenizer import Tokenizer
from ds4jax.continuation.evidence import attach_tool_memory, tool_tail, validate_tool_results
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.continuation.types import RequestView
from ds4jax.engine.requests import EngineError, Prepared, SamplingParams, prompt_too_long
from ds4jax.sampling import MAX_LOGPROBS


def prepare(
    conversation: Conversation,
    *,
    tokenizer: Tokenizer,
    max_len: int,
    tool_memory: ToolMemory,
    live_tool_ids: Callable[[], frozenset[str]],
    max_tokens: int,
    has_tools: bool,
    sampling: SamplingParams | None = None,
    stop_sequences: Sequence[str] = (),
    thinking_budget: int | None = None,
    tool_choice: dict[str, Any] | None = None,
    hint: str | None = None,
    api: str = Api.ANTHROPIC,
) -> Prepared:
    """`Engine.prepare`, given the engine's tokenizer, context (`max_len`), tool memory and
    its live tool ids (asked for only once the log-probabilities passed: they take the
    engine's state lock)."""
    k = sampling.logprobs if sampling is not None else None
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise EngineError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {k}")
    try:
        requires_live = validate_tool_results(conversation, live_tool_ids(), api)
    except ValueError as err:
        raise EngineError(400, str(err)) from err
    attach_tool_memory(conversation, tool_memory.block_for)
    segments = normalize(render(conversation))
    tokens = tuple(tokenizer.encode_segments(segments))
    if len(tokens) >= max_len:
        raise prompt_too_long(len(tokens), max_len, api)
    tail_ids, tail = tool_tail(conversation)
    view = RequestView(segments, tokens, tail_ids, tail, requires_live, api)
    force, names = None, ()
    choice = (tool_choice or {}).get("type")
    if has_tools and choice in ("any", "tool"):
        force = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="'
        declared = [t.name for m in conversation.messages for t in m.tools or ()]
        if choice == "any" and len(declared) == 1:  # the one tool there is: its name too
            force += f'{declared[0]}">\n'  # (a small model named a tool it knew instead)
        elif choice == "tool":
            force += f'{tool_choice["name"]}">\n'
        else:  # the name is sampled, among the declared ones only
            names = tuple(declared)
    # a final assistant turn (a prefill) is rendered after its `</think>`: what the model
    # continues is content, so the row decodes as without thinking (else its text came back
    # as a thinking block, and a thinking budget forced `</think>` into it)
    prefill = bool(conversation.messages) and conversation.messages[-1].prefill
    return Prepared(
        conversation=conversation,
        view=view,
        thinking=conversation.thinking and not prefill,
        has_tools=has_tools,
        max_tokens=max_tokens,
        sampling=sampling or SamplingParams(),
        stop_sequences=tuple(s for s in stop_sequences if s),
        thinking_budget=thinking_budget,
        force_after_think=force,
        tool_names=names,
        single_tool_call=bool((tool_choice or {}).get("disable_parallel_tool_use")),
        hint=hint,
        api=api,
    )


def segments_of(
    tokenizer: Tokenizer, special_ids: set[int], tokens: Sequence[int]
) -> list[Segment]:
    """The text of `tokens` as segments. Runs of ordinary tokens are decoded together:
    a character split over byte-level tokens must come out whole, not as U+FFFD."""
    out: list[Segment] = []
    run = bytearray()
    for t in tokens:
        if t in special_ids:
            if run:
                out.append(Segment(run.decode("utf-8", errors="replace")))
                run.clear()
            out.append(Segment(tokenizer.token_bytes(t).decode("utf-8"), True))
        else:
            run += tokenizer.token_bytes(t)
    if run:
        out.append(Segment(run.decode("utf-8", errors="replace")))
    return out
