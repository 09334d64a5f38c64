"""Equivalents of ds4-server's continuation unit tests (ds4-server-behaviour §6.6–6.8), ported to
our design: DeepSeek's official prompt format (not ds4's renderer), `toolu_` ids, a real engine
on the tiny config, and our fixes. Each test names the ds4 test (with its line in
`ds4_server.c`) it stands for; where our behaviour differs from ds4's by decision, the test
asserts ours and its docstring says so.

The Responses API's tests live with its implementation (issue 15): the live tail, call_id
validation and the visible suffix (13325, 13362, 13469) in `tests/serve/test_openai.py` and
`tests/continuation/test_protocols.py` (the Responses decision is this one with different
evidence); namespace flattening in `tests/chat/test_openai_requests.py`. Not ported:
test_responses_stateless_tool_replay_requires_reasoning (13395) — a replay without reasoning
is served from the visible transcript or the fork point, not flagged — and the tool_search
tests (11390, 11500, …), a hosted tool we leave out of the prompt.

No equivalent, because the mechanism does not exist here:

* test_exact_dsml_tool_replay_can_be_disabled (13501): there is no
  `--disable-exact-dsml-tool-replay`; exact replay is always on.
* test_tool_checkpoint_canonicalization_gate_exact_replay (13296) and
  test_canonical_rewrite_rebuilds_when_live_tail_changes (13855): we never canonicalize or
  rewrite the live KV after a tool turn; exact replay plus the live tool tail make the sampled
  bytes the prompt. (The byte-equality those tests protect is ported below as
  `test_tool_turn_is_a_prefix_of_the_next_render`.)
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4jax.chat import specials
from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.ids import new_tool_id
from ds4jax.chat.render import render_text
from ds4jax.continuation.decide import EOS_SEGMENT
from ds4jax.continuation.evidence import attach_tool_memory
from ds4jax.continuation.tool_memory import ToolMemory
from ds4jax.continuation.types import (
    LIVE_GONE_MESSAGE,
    CacheSource,
    Decision,
    unknown_id_message,
)
from ds4jax.engine import Engine, EngineError
from tests.continuation.conftest import TOOLS, forced, prepare, tool_call_text

BOS, EOS, U, A = specials.BOS, specials.EOS, specials.USER, specials.ASSISTANT
TS, TE = specials.THINK_START, specials.THINK_END
SYSTEM = "You are a careful coding agent."

#: The tiny model's logits move by up to ~6e-5 between chunk plans of the same tokens (its
#: simulated FP8 rounding flips on accumulation order); a wrong or missing token moves them
#: by >= 0.1.
FIDELITY_ATOL = 5e-4

#: A sampled call whose parameters are in the model's order (command, timeout, description).
SAMPLED = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="timeout" string="false">5</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="description" string="true">list</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
#: The same call as a client re-serialises it: keys in another order.
CLIENT_INPUT = {"description": "list", "timeout": 5, "command": "ls -la"}


def text_of(segments) -> str:
    return "".join(s.text for s in segments)


def assert_cold_equivalent(engine: Engine) -> None:
    live = engine.live
    assert live is not None
    cold = engine.logits_for(live.tokens)
    assert np.abs(cold - np.asarray(live.state.logits)).max() <= FIDELITY_ATOL


def tool_use(tid: str, command: str = "ls -la", **extra) -> dict:
    return {"type": "tool_use", "id": tid, "name": "bash", "input": {"command": command, **extra}}


def tool_result(tid: str, content: str = "/x") -> dict:
    return {"type": "tool_result", "tool_use_id": tid, "content": content}


def history(tid: str, *, input_json: dict | None = None, reasoning: str | None = None) -> dict:
    """A full replay: user asks, the assistant called bash with `tid`, the result comes back."""
    assistant: list[dict] = []
    if reasoning is not None:
        assistant.append({"type": "thinking", "thinking": reasoning, "signature": "s"})
    call = tool_use(tid)
    if input_json is not None:
        call["input"] = input_json
    assistant.append(call)
    return {
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": [tool_result(tid)]},
        ],
    }


def results_only(*ids: str) -> dict:
    return {
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": [tool_result(t) for t in ids]}],
    }


def sampled_tool_turn(engine: Engine, text: str | None = None):
    """The model calls bash (teacher forced); returns (first request body, result)."""
    body = {"system": SYSTEM, "tools": TOOLS, "messages": [{"role": "user", "content": "list"}]}
    text = text if text is not None else "I should run it.</think>" + SAMPLED
    res = engine.run(prepare(engine, body, 200), forced_tokens=forced(engine, text))
    assert res.finish == "tool_use" and res.tool_ids
    return body, res


def order_in(text: str, *names: str) -> list[int]:
    return [text.index(f'parameter name="{n}"') for n in names]


# ------------------------------------------------------------------ §6.6 tool memory


def test_tool_memory_replays_sampled_dsml(engine: Engine) -> None:
    """ds4 test_tool_memory_replays_sampled_dsml (13024). The engine assigns the `toolu_` id
    and remembers the sampled block; a client replay with reordered JSON renders the sampled
    bytes (ds4 stats mem=1, canonical=0, missing=0 ↔ the turn is attached, the id is known)."""
    _, res = sampled_tool_turn(engine)
    (tid,) = res.tool_ids
    assert tid.startswith("toolu_") and len(tid) == len("toolu_") + 32
    assert tid in engine.tool_memory
    assert engine.tool_memory.block_for([tid]) == SAMPLED == res.message.raw_dsml

    req = prepare(engine, history(tid, input_json=CLIENT_INPUT, reasoning="I should run it."))
    assistant = req.conversation.messages[2]
    assert assistant.raw_tool_calls == SAMPLED  # attached: exact replay
    text = text_of(req.view.segments)
    assert SAMPLED in text
    command, timeout, description = order_in(text, "command", "timeout", "description")
    assert command < timeout < description  # the sampled order, not the client's


def test_tool_memory_attach_stats_equivalent() -> None:
    """ds4's attach statistics (13024, 13087), as `attach_tool_memory`'s count and
    `block_for`: a known id attaches (mem), an unknown one renders canonically, in the
    client's key order (canonical + missing)."""
    memory = ToolMemory()
    known = new_tool_id()
    memory.remember([known], SAMPLED)
    for tid, exact in ((known, True), (new_tool_id([known]), False)):
        conv = parse_messages_request(history(tid, input_json=CLIENT_INPUT)).conversation
        assert attach_tool_memory(conv, memory.block_for) == (1 if exact else 0)
        text = render_text(conv)
        assert (SAMPLED in text) == exact
        command, timeout, description = order_in(text, "command", "timeout", "description")
        if exact:
            assert command < timeout < description
        else:
            assert description < timeout < command  # canonical: the client's order


def test_anthropic_tool_memory_replays_sampled_dsml(engine: Engine) -> None:
    """ds4 test_anthropic_tool_memory_replays_sampled_dsml (13087): with `toolu_exact` put in
    the memory, an Anthropic history (tool_use + tool_result) links the result to the call,
    collects the id, attaches the sampled block and renders the sampled order."""
    engine.tool_memory.remember(["toolu_exact"], SAMPLED)
    req = prepare(engine, history("toolu_exact", input_json=CLIENT_INPUT))
    conv = req.conversation
    assert conv.tool_use_ids == ["toolu_exact"]
    (block,) = conv.messages[-1].blocks
    assert block.kind == "tool_result" and block.tool_use_id == "toolu_exact"
    assert conv.messages[2].raw_tool_calls == SAMPLED
    assert not req.view.requires_live  # the call is replayed
    text = text_of(req.view.segments)
    assert SAMPLED + EOS + U + "<tool_result>/x</tool_result>" + A + TS in text
    command, timeout, description = order_in(text, "command", "timeout", "description")
    assert command < timeout < description


def test_tool_memory_max_ids_prunes_oldest() -> None:
    """ds4 test_tool_memory_max_ids_prunes_oldest (13605): with max 2 ids, the third put
    drops the first, whose replay then renders canonically. Also ds4's LRU rule: a lookup
    touches an entry, so the untouched one goes first."""
    memory = ToolMemory(max_ids=2)
    ids = [new_tool_id() for _ in range(3)]
    for tid in ids:
        memory.remember([tid], SAMPLED)
    assert ids[0] not in memory and ids[1] in memory and ids[2] in memory and len(memory) == 2
    conv = parse_messages_request(history(ids[0], input_json=CLIENT_INPUT)).conversation
    assert attach_tool_memory(conv, memory.block_for) == 0
    assert SAMPLED not in render_text(conv)

    memory = ToolMemory(max_ids=2)
    a, b, c = (new_tool_id() for _ in range(3))
    memory.remember([a], "A")
    memory.remember([b], "B")
    assert memory.block_for([a]) == "A"  # touched: now the most recent
    memory.remember([c], "C")
    assert a in memory and b not in memory


def test_tool_memory_byte_budget_prunes_oldest() -> None:
    """ds4's 512 MiB byte bound (§2.6), scaled down. Our accounting: an entry costs its id's
    and its block's UTF-8 bytes (ds4 shares one ref-counted block between the ids of a turn
    and adds struct sizes; ours counts the block once per id, which only over-estimates)."""
    a, b = "toolu_" + "a" * 32, "toolu_" + "b" * 32
    cost = len(a) + len(SAMPLED.encode())
    memory = ToolMemory(max_bytes=2 * cost)
    memory.remember([a], SAMPLED)
    memory.remember([b], SAMPLED)
    assert a in memory and b in memory
    memory.remember(["toolu_" + "c" * 32], SAMPLED)  # over budget: the oldest goes
    assert a not in memory and b in memory and len(memory) == 2

    tight = ToolMemory(max_bytes=cost - 1)  # a block bigger than the budget is not kept
    tight.remember([a], SAMPLED)
    assert len(tight) == 0 and tight.block_for([a]) is None


def test_partial_id_sets_render_canonically() -> None:
    """ds4 §2.6: replay is exact only when every id of the turn is known and all map to one
    block. One id unknown, or ids from two sampled turns, render canonically. (A subset of one
    turn's ids is exact in ds4 and here: the whole sampled block renders.)"""
    memory = ToolMemory()
    a, b, c = (new_tool_id() for _ in range(3))
    two = SAMPLED.replace("</｜DSML｜tool_calls>", "") + (
        '\n<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">pwd</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    memory.remember([a, b], two)
    memory.remember([c], SAMPLED)
    assert memory.block_for([a, b]) == two
    assert memory.block_for([b, a]) == two
    assert memory.block_for([a, "toolu_unknown"]) is None
    assert memory.block_for([a, c]) is None
    assert memory.block_for([a]) == two  # ds4 semantics: all found, one block

    body = history(a, input_json=CLIENT_INPUT)
    body["messages"][1]["content"].append(tool_use("toolu_unknown", "pwd"))
    conv = parse_messages_request(body).conversation
    assert attach_tool_memory(conv, memory.block_for) == 0
    text = render_text(conv)
    assert two not in text and SAMPLED not in text
    assert text.count('invoke name="bash"') == 2  # the client's two calls, canonical


def test_tool_turn_is_a_prefix_of_the_next_render(engine: Engine) -> None:
    """ds4 test_tool_checkpoint_suffix_is_future_prompt_canonical (12877) and
    ..._minifies_json_parameters (12950). ds4 rewrites the KV to the canonical DSML; we keep the
    sampled bytes, so the property is: the live text + EOS is a prefix of the next render,
    parsed args keep `&&` and `2>` unescaped, and a JSON array parameter round-trips. Without
    the tool memory (a restart) the canonical rendering is the same bytes when the model wrote
    the official format (json.dumps with its default spacing; ds4 minifies instead)."""
    text = (
        'run it</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
        '<｜DSML｜parameter name="command" string="true">make 2>&1 && echo ok</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="args" string="false">[1, "a b", {"k": 2}]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    body, res = sampled_tool_turn(engine, text)
    (call,) = res.message.tool_calls
    assert call.arguments == {"command": "make 2>&1 && echo ok", "args": [1, "a b", {"k": 2}]}
    (tid,) = res.tool_ids
    live_text = engine.tokenizer.decode(engine.live.tokens)
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": res.message.reasoning},
            {"type": "tool_use", "id": tid, "name": "bash", "input": call.arguments},
        ],
    }
    follow = dict(
        body,
        messages=[*body["messages"], assistant, {"role": "user", "content": [tool_result(tid)]}],
    )
    for memory in (engine.tool_memory, ToolMemory()):  # exact, then canonical
        engine.tool_memory = memory
        req = prepare(engine, follow)
        assert text_of(req.view.segments).startswith(live_text + EOS)


# ------------------------------------------------------------------ §6.7 live continuation


def test_live_tail_renders_tool_results_only(engine: Engine) -> None:
    """ds4 test_anthropic_live_tail_renders_tool_results_only (13141), with a trailing system
    message present. The suffix after the live frontier is EOS + the tool-result turn + the
    assistant opening; the tool call itself is not re-rendered. Ours differs by decision: a
    `system` message inside `messages` is the official `latest_reminder` turn (README point 5),
    so it renders at the end of the tail instead of being skipped."""
    _, res = sampled_tool_turn(engine)
    (tid,) = res.tool_ids
    follow = history(tid, reasoning="I should run it.")
    follow["messages"].append({"role": "system", "content": "Remember the rules."})
    req = prepare(engine, follow)
    assert req.view.tail_ids == (tid,)
    decision = engine.decide(req)
    assert isinstance(decision, Decision) and decision.source == CacheSource.LIVE_TOOL
    assert decision.suffix_segments is not None and decision.suffix_segments[0] == EOS_SEGMENT
    suffix = text_of(decision.suffix_segments)
    assert suffix.startswith(EOS + U + "<tool_result>")
    assert "/x</tool_result>" in suffix and A + TS in suffix
    assert "bash" not in suffix
    assert suffix.endswith(specials.LATEST_REMINDER + "Remember the rules.")  # our decision

    pos = engine.live.pos
    out = engine.run(req, forced_tokens=[])
    assert out.source == CacheSource.LIVE_TOOL and out.cached == pos
    assert engine.tokenizer.decode(engine.live.tokens[pos:]) == suffix


def test_tool_result_id_validation(engine: Engine) -> None:
    """ds4 test_anthropic_tool_result_id_validation (13186): an id that is neither live nor
    replayed is a 400 with ds4's message; once the id is live, the same tool-result-only
    request validates and requires the live state."""
    tid = new_tool_id()
    with pytest.raises(EngineError) as info:
        prepare(engine, results_only(tid))
    assert info.value.status == 400 and info.value.message == unknown_id_message(tid)
    assert info.value.message == (
        f"Anthropic continuation state is not available for tool_use_id {tid}; "
        "retry by replaying the full messages history"
    )

    _, res = sampled_tool_turn(engine)
    (live_id,) = res.tool_ids
    req = prepare(engine, results_only(live_id))
    assert req.view.requires_live


def test_full_replay_allows_unknown_live_id(engine: Engine) -> None:
    """ds4 test_anthropic_full_replay_allows_unknown_live_id (13219): the tool_use is in the
    request, so an id unknown to the live state needs no live state."""
    _, res = sampled_tool_turn(engine)  # the live set holds another id
    tid = new_tool_id(res.tool_ids)
    req = prepare(engine, history(tid))
    assert not req.view.requires_live
    assert engine.run(req, forced_tokens=[]).source == CacheSource.COLD


def test_tool_use_parses_before_role(engine: Engine) -> None:
    """ds4 test_anthropic_tool_use_parses_before_role (13250): a message whose JSON has
    `content` before `role` still registers its tool_use, so an old tool_result validates
    although the live set holds only a newer id."""
    old = "toolu_" + "0" * 32
    body = history(old)
    body["messages"][1] = {"content": [tool_use(old)], "role": "assistant"}
    assert list(body["messages"][1]) == ["content", "role"]
    conv = parse_messages_request(body).conversation
    assert conv.tool_use_ids == [old]

    _, res = sampled_tool_turn(engine)
    (newer,) = res.tool_ids
    assert engine.live_tool_ids() == {newer}
    req = prepare(engine, body)
    assert not req.view.requires_live


def test_requires_live_request_is_409_once_the_live_state_moved(engine: Engine) -> None:
    """ds4 §3.2 step 4 (ds4 has no unit test for it): validation passed, but another request
    moved the live state before this one ran: 409 with ds4's message, nothing changes."""
    _, res = sampled_tool_turn(engine)
    req = prepare(engine, results_only(*res.tool_ids))
    engine.run(prepare(engine, {"messages": [{"role": "user", "content": "hi"}]}), forced_tokens=[])
    before = (engine.live, engine.bindings.tool, engine.bindings.thinking)
    with pytest.raises(EngineError) as info:
        engine.run(req, forced_tokens=[])
    assert info.value.status == 409 and info.value.message == LIVE_GONE_MESSAGE
    assert (engine.live, engine.bindings.tool, engine.bindings.thinking) == before


def test_tool_result_only_request_continues_from_the_live_state(engine: Engine) -> None:
    """ds4 §3.1/§3.2 step 3: a tool_result whose tool_use is not replayed is served from the
    live state when its ids are the live call's ids (that is what `requires_live` is for):
    the suffix is EOS + the tool-result turn + the assistant opening, nothing else. (This was
    an engine bug, always a 409, fixed in ecc41ad while these tests were written.)"""
    _, res = sampled_tool_turn(engine)
    live_text, pos = engine.tokenizer.decode(engine.live.tokens), engine.live.pos
    req = prepare(engine, results_only(*res.tool_ids))
    assert req.view.requires_live
    assert req.view.tail is not None and req.view.tail_ids == tuple(res.tool_ids)
    out = engine.run(req, forced_tokens=[])
    assert out.source == CacheSource.LIVE_TOOL and out.cached == pos
    tail = EOS + U + "<tool_result>/x</tool_result>" + A + TS
    assert engine.tokenizer.decode(engine.live.tokens) == live_text + tail


# ------------------------------------------------------------------ §6.8 thinking-visible

CHAT = {"messages": [{"role": "user", "content": "2+2?"}]}  # thinking on, no tools


def test_thinking_checkpoint_remember_gate(engine: Engine) -> None:
    """ds4 test_thinking_checkpoint_remember_gate (13806): the visible-transcript binding is
    made only after a clean end of a tool-less thinking turn; never while still inside
    thinking, on max_tokens (ds4 `length`), with tools (ds4 `has_tools`; with tools the format
    keeps reasoning, ds4's `prompt_preserves_reasoning`), with thinking disabled (ds4 NONE),
    after tool calls, or on a stop sequence (ds4 invalidates the session)."""
    cases = [
        ("inside thinking", CHAT, "still thinking", 50, False),
        ("max_tokens", CHAT, "add them</think>4 and more", 3, False),
        ("tools", dict(CHAT, tools=TOOLS), "add them</think>4", 50, False),
        ("thinking disabled", dict(CHAT, thinking={"type": "disabled"}), "4", 50, False),
        ("tool call", dict(CHAT, tools=TOOLS), tool_call_text("ls"), 200, False),
        ("stop sequence", dict(CHAT, stop_sequences=["STOP"]), "a</think>4 STOP", 50, False),
        ("clean end", CHAT, "add them</think>4", 50, True),
    ]
    for name, body, text, max_tokens, remembered in cases:
        engine.reset()
        engine.run(prepare(engine, body, max_tokens), forced_tokens=forced(engine, text))
        th = engine.bindings.thinking
        assert (th is not None) == remembered, name
        if th is not None:
            assert th.pos == engine.live.pos


def test_thinking_checkpoint_matches_future_prompt(engine: Engine) -> None:
    """ds4 test_thinking_checkpoint_canonical_matches_future_prompt (14431): the visible
    transcript is the prompt with its `<think>` turned into `</think>`, then the content, and
    a strict prefix of the next turn's render, which drops the reasoning. Ours differs by
    decision (the EOS fix, README point 6): the transcript stops before EOS, which the next
    turn's suffix then evaluates; ds4's key ends with an EOS its KV never held."""
    req = prepare(engine, CHAT)
    prompt = text_of(req.view.segments)
    assert prompt.endswith(A + TS)
    engine.run(req, forced_tokens=forced(engine, "add them</think>4"))
    visible = text_of(engine.bindings.thinking.visible)
    assert visible == prompt[: -len(TS)] + TE + "4"
    assert EOS not in visible

    follow = {
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "add them"}, {"type": "text", "text": "4"}]},
            {"role": "user", "content": "and 3+3?"},
        ]
    }  # fmt: skip
    future = text_of(prepare(engine, follow).view.segments)
    assert future.startswith(visible) and len(future) > len(visible)
    assert future[len(visible) :].startswith(EOS)
    assert "add them" not in future


def test_thinking_checkpoint_empty_content_and_three_turns(engine: Engine) -> None:
    """ds4 test_thinking_canonical_empty_content (14514) and ..._multi_turn (14563): the prefix
    property holds with empty content and across three turns, each continued from the live
    state, with both earlier reasonings absent from the render but kept in the live state."""
    messages: list[dict] = [{"role": "user", "content": "q1"}]
    turns = [("r one", ""), ("r two", "a2"), ("r three", "a3")]
    visible = ""
    for n, (reasoning, content) in enumerate(turns):
        req = prepare(engine, {"messages": messages})
        if n:
            assert text_of(req.view.segments).startswith(visible)
        out = engine.run(req, forced_tokens=forced(engine, f"{reasoning}</think>{content}"))
        assert out.source == (CacheSource.THINKING_VISIBLE if n else CacheSource.COLD)
        visible = text_of(engine.bindings.thinking.visible)
        assert visible == text_of(req.view.segments)[: -len(TS)] + TE + content
        messages += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": reasoning}, {"type": "text", "text": content}]},
            {"role": "user", "content": f"q{n + 2}"},
        ]  # fmt: skip
    final = prepare(engine, {"messages": messages})
    rendered = text_of(final.view.segments)
    assert rendered.startswith(visible)
    assert not any(r in rendered for r, _ in turns)
    out = engine.run(final, forced_tokens=[])
    assert out.source == CacheSource.THINKING_VISIBLE
    live_text = engine.tokenizer.decode(engine.live.tokens)
    assert all(r in live_text for r, _ in turns)  # the sampled reasoning is all still there
    assert_cold_equivalent(engine)


def test_thinking_with_tools_preserves_reasoning() -> None:
    """ds4 test_thinking_canonical_with_tools_preserves_reasoning (14632) and
    test_render_preserves_reasoning_with_tools (12601): with tools declared the official
    format keeps earlier reasoning, so the future render holds it verbatim. (ds4 also keeps it
    when the history merely has calls without schemas; the official encoder, which we follow,
    keys on declared tools only.)"""
    body = history("toolu_" + "1" * 32, reasoning="I should run bash")
    text = render_text(parse_messages_request(body).conversation)
    assert TS + "I should run bash" + TE in text
    assert "<tool_result>/x</tool_result>" in text


def test_thinking_disabled_prompt_closes_think() -> None:
    """ds4 test_thinking_canonical_non_thinking_mode_noop (14671): a non-thinking prompt ends
    with `</think>`, so there is nothing for a visible transcript to drop."""
    body = dict(CHAT, thinking={"type": "disabled"})
    text = render_text(parse_messages_request(body).conversation)
    assert text.endswith(A + TE) and not text.endswith(TS)


# ------------------------------------------------------------------ the EOS fix (§5.4)


def test_eos_fix_continued_state_equals_cold_prefill(engine: Engine) -> None:
    """ds4 §5.4 (no ds4 test; README point 6 asks for one): the last turn ended with an EOS
    that was sampled, never evaluated. Whichever path continues — thinking-visible, the live
    tool tail, or a prefix — the continued state holds that EOS right after the previous turn
    and equals a cold prefill of the same tokens. ds4 leaves it out on the visible paths."""
    eos = engine.tokenizer.eos_id
    # thinking-visible
    engine.run(prepare(engine, CHAT), forced_tokens=forced(engine, "add them</think>4"))
    pos = engine.live.pos
    follow = {
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3+3?"},
        ]
    }
    out = engine.run(prepare(engine, follow), forced_tokens=[])
    assert out.source == CacheSource.THINKING_VISIBLE
    assert engine.live.tokens[pos] == eos and engine.live.tokens[pos - 1] != eos
    assert_cold_equivalent(engine)

    # the live tool tail
    engine.reset()
    _, res = sampled_tool_turn(engine)
    pos = engine.live.pos
    out = engine.run(prepare(engine, history(res.tool_ids[0])), forced_tokens=[])
    assert out.source == CacheSource.LIVE_TOOL
    assert engine.live.tokens[pos] == eos
    assert_cold_equivalent(engine)

    # a prefix path, after a plain turn
    engine.reset()
    plain = {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "hi"}]}
    engine.run(prepare(engine, plain), forced_tokens=forced(engine, "Hello"))
    pos = engine.live.pos
    plain["messages"] += [
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"},
    ]
    out = engine.run(prepare(engine, plain), forced_tokens=[])
    assert out.source == CacheSource.TOKEN_PREFIX
    assert engine.live.tokens[pos] == eos
    assert_cold_equivalent(engine)
