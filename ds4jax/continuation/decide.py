"""The continuation decision: which already-evaluated state a request continues from.

First match wins, in this order (ds4's procedure with our fixes):

1. **Live tool output** — the request's trailing `tool_result` ids equal the ids of the tool
   call the live frontier just sampled, and the frontier has not moved since: append EOS +
   the tool-result turn + `<｜Assistant｜><think>` only. Nothing else in the request is
   compared: protocol ids select the sampled state, which is the truth.
   A request that *needs* the live state (a tool_result with no replayed tool_use) and does
   not match here is rejected with 409; nothing changes.
2. **Thinking visible** — after a tool-less thinking turn, whose reasoning the official
   format drops on replay, a request whose render strictly extends the visible transcript
   continues from the live state (which keeps the reasoning).
3. **Exact token prefix** of the live tokens.
4. **Live rendered-text prefix** — the request's text starts with the live text; the rest is
   tokenized on its own, never sliced out of the full tokenization (BPE merges across a cut).
5. **Disk** — the longest stored checkpoint whose text is a prefix of the request's.
6. **Cold prefill.**

`decide` is that procedure for one live frontier. With several resident sessions
(`continuation.pool`) steps 1–4 run per session through `match_tool` and `match_live`, and
retained fork points come between step 4 and the disk (`match_fork`).

The EOS fix: the live state never holds the EOS that ended its turn (EOS is sampled, not
evaluated, and decoding stops right after a tool-call block). Every path's suffix therefore
starts at or before that EOS — the tool path prepends it, the visible transcript stops before
it — so a continued state always equals a cold prefill of the same tokens.
"""

from __future__ import annotations

from ds4jax.chat import specials
from ds4jax.chat.segments import Segment, strip_prefix
from ds4jax.continuation.types import (
    Bindings,
    CacheSource,
    Decision,
    LiveFrontier,
    Rejection,
    RequestView,
    live_gone_message,
)
from ds4jax.kvstore.store import KVStore

EOS_SEGMENT = Segment(specials.EOS, True)


def first_user_turn(segments: tuple[Segment, ...]) -> str | None:
    """The text of a render's first user turn (between its first `<｜User｜>` and the next
    `<｜Assistant｜>`), None when it has no complete one."""
    text: list[str] | None = None
    for seg in segments:
        if seg.special and seg.text == specials.USER and text is None:
            text = []
        elif seg.special and seg.text == specials.ASSISTANT and text is not None:
            return "".join(text)
        elif text is not None:
            text.append(seg.text)
    return None


def same_conversation(req: RequestView, live: LiveFrontier) -> bool:
    """Whether a request whose tool_result ids are a frontier's live ones is that
    frontier's conversation: where its history has a whole turn before its tool results,
    its first user turn is the frontier's. The ids alone handed one agent's live state to
    another client that sent them (its own question answered from the first agent's
    conversation, the owner's next turn then no longer live); the first user turn is what
    an agent never rewrites, while the assistant turns it replays may differ from what was
    sampled (reasoning dropped, JSON re-serialised: the sampled state stays the truth). A
    tool-result-only request (no history) is answered by its ids, as before."""
    head = req.segments[: len(req.segments) - len(req.tail or ())]
    if not any(s.special and s.text == specials.ASSISTANT for s in head):
        return True
    return first_user_turn(head) == first_user_turn(live.segments)


def match_tool(req: RequestView, live: LiveFrontier | None, bindings: Bindings) -> Decision | None:
    """Step 1: the request answers exactly the tool call this frontier just sampled, from
    the same conversation (`same_conversation`)."""
    tb = bindings.tool
    if (
        live is not None
        and tb is not None
        and tb.pos == live.pos > 0
        and req.tail is not None
        and req.tail_ids
        and frozenset(req.tail_ids) == tb.ids
        and same_conversation(req, live)
    ):
        return Decision(
            CacheSource.LIVE_TOOL, live.tokens, suffix_segments=(EOS_SEGMENT, *req.tail)
        )
    return None


def match_live(req: RequestView, live: LiveFrontier | None, bindings: Bindings) -> Decision | None:
    """Steps 2–4: the request extends this frontier (visible transcript, tokens, text)."""
    if live is None or live.pos == 0:
        return None
    th = bindings.thinking
    if th is not None and th.pos == live.pos:
        rest = strip_prefix(req.segments, th.visible)
        if rest:  # strictly longer
            return Decision(CacheSource.THINKING_VISIBLE, live.tokens, suffix_segments=rest)
    return _extends(req, live, CacheSource.TOKEN_PREFIX, CacheSource.TEXT_PREFIX)


def match_fork(req: RequestView, point: LiveFrontier) -> Decision | None:
    """A retained prompt-end state whose tokens, or else text, the request starts with."""
    return _extends(req, point, CacheSource.FORK, CacheSource.FORK)


def _extends(
    req: RequestView, frontier: LiveFrontier, by_tokens: CacheSource, by_text: CacheSource
) -> Decision | None:
    pos = frontier.pos
    if pos == 0:
        return None
    if len(req.tokens) >= pos and req.tokens[:pos] == frontier.tokens:
        return Decision(by_tokens, frontier.tokens, suffix_tokens=req.tokens[pos:])
    rest = strip_prefix(req.segments, frontier.segments)
    if rest is not None:
        return Decision(by_text, frontier.tokens, suffix_segments=rest)
    return None


def match_disk(req: RequestView, store: KVStore) -> Decision | None:
    hit = store.lookup(req.segments)
    if hit is not None:
        rest = strip_prefix(req.segments, hit.segments)
        if rest is not None:
            return Decision(CacheSource.DISK, hit.tokens, suffix_segments=rest, disk=hit)
    return None


def cold(req: RequestView) -> Decision:
    return Decision(CacheSource.COLD, (), suffix_tokens=req.tokens)


def decide(
    req: RequestView, live: LiveFrontier | None, bindings: Bindings, store: KVStore
) -> Decision | Rejection:
    hit = match_tool(req, live, bindings)
    if hit is not None:
        return hit
    if req.requires_live:
        return Rejection(409, live_gone_message(req.api))
    return match_live(req, live, bindings) or match_disk(req, store) or cold(req)
