"""The engine's request types: what a request is once accepted (`Prepared`), how its rows
sample (`SamplingParams`), how one is refused (`EngineError`), and how one withdrawn before
it started ends (`Cancelled`).

At the bottom of the package, importing none of it: `decoding` names `Prepared` from here,
and the engine imports `decoding`, so the types they share cannot live beside `Engine`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from ds4jax.chat.conversation import Conversation
from ds4jax.chat.errors import RequestError
from ds4jax.chat.kinds import Api
from ds4jax.continuation.types import RequestView


class EngineError(RequestError):
    """A request the engine refuses (a 400 it finds preparing, a 409 when the live state moved,
    a 503/529 under pressure): the one client-error type, so each API renders it in its own
    shape as it does a body's `RequestError`; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 **kw: Any) -> None:  # fmt: skip
        super().__init__(message, status=status, error_type=error_type, **kw)


class Cancelled(RuntimeError):
    """A request whose caller withdrew it (its client left) while it still waited: it was
    never routed, so no slot was chosen, no session displaced and nothing prefilled."""


def prompt_too_long(tokens: int, max_len: int, api: str) -> EngineError:
    """The 400 of a prompt that does not fit the context, as OpenAI words it for every API
    (`code` `context_length_exceeded`, `param` the conversation's field) and with the counts
    (`n_prompt_tokens`, `n_ctx`, as ds4 sends them): an agent tests the code, or Anthropic's
    "prompt is too long", to compact its history and retry."""
    return EngineError(
        400, f"prompt is too long: {tokens} tokens, the context is {max_len}"
        + (" (a prompt must leave room for a token of reply)" if tokens == max_len else ""),
        param="input" if api == Api.RESPONSES else "messages", code="context_length_exceeded",
        fields={"n_prompt_tokens": tokens, "n_ctx": max_len},
    )  # fmt: skip


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
    #: `tool_choice` any with several tools: the names the forced call may take, sampled
    #: among them (`chat.tool_names`)
    tool_names: tuple[str, ...] = ()
    #: `disable_parallel_tool_use`: close the block after its first invoke.
    single_tool_call: bool = False
    #: a client's session hint (`metadata.user_id`, `x-session-id`, `prompt_cache_key`):
    #: breaks routing ties
    hint: str | None = None
    #: the protocol (`continuation.types.APIS`): its error wording, tool-id prefix, log
    #: lines, and whether tool turns leave a visible-transcript binding
    api: str = Api.ANTHROPIC
    #: a per-request secret: its tool ids (`tool_memory.id_stream`) and, unseeded, its
    #: sampling key derive from it, so every process handed the request agrees on both
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(16))

    @property
    def prompt_tokens(self) -> int:
        return len(self.view.tokens)
