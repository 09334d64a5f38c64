"""DeepSeek's official V4 prompt format (`encoding_dsv4.py` of the V4 release), byte for byte.

The model was trained on this format, so every shape the official encoder covers renders
exactly as it would; the output is a list of `Segment`s so template special tokens and
client text stay distinguishable (see `segments`). Rules, in the encoder's own order:

* BOS; in thinking mode with Think-Max the "Reasoning Effort" prefix comes right after it.
* system → its text, then `\\n\\n` + the tools block when tools are attached.
* developer → `<｜User｜>` + text (+ tools); latest_reminder → `<｜latest_reminder｜>` + text.
* user → `<｜User｜>` + blocks joined by `\\n\\n`, a tool result as
  `<tool_result>…</tool_result>` (no escaping), tool results reordered to the preceding
  assistant's call order.
* assistant → [reasoning + `</think>`] + content + DSML calls + EOS (no EOS for a prefill).
* After a user/developer message that ends the list or is followed by an assistant or a
  latest_reminder: `<｜Assistant｜>` + `<think>` (thinking, and reasoning kept or this is the
  last user turn) or `</think>`.
* Reasoning drop: in thinking mode, unless any message carries tools, assistant turns before
  the last user turn lose their reasoning and earlier developer turns are removed.
"""

from __future__ import annotations

import dataclasses

from ds4jax.chat import specials
from ds4jax.chat.conversation import Conversation, Message, UserBlock
from ds4jax.chat.dsml_render import render_tool_calls, to_json
from ds4jax.chat.segments import Segment, join, special, template

THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

_TOOLS_HEAD = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning \
inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""
_TOOLS_TAIL = """

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def render_tools(message: Message) -> list[Segment]:
    schemas = "\n".join(to_json(t.as_official()) for t in message.tools)
    return [*template(_TOOLS_HEAD), Segment(schemas), *template(_TOOLS_TAIL)]


def _last_user_index(messages: list[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role in ("user", "developer"):
            return i
    return -1


def _merge_users(messages: list[Message]) -> list[Message]:
    """Consecutive user turns are one turn in V4 (tool results live inside user turns)."""
    out: list[Message] = []
    for m in messages:
        if m.role == "user" and out and out[-1].role == "user":
            out[-1] = dataclasses.replace(out[-1], blocks=[*out[-1].blocks, *m.blocks])
        else:
            out.append(m)
    return out


def _sort_tool_results(messages: list[Message]) -> list[Message]:
    """Tool results follow the order of the calls of the latest assistant turn with calls;
    non-result blocks keep their slots (the official encoder's stable sort, unknown ids
    ranking as call 0)."""
    order: dict[str, int] = {}
    out: list[Message] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            order = {c.id: i for i, c in enumerate(m.tool_calls) if c.id}
        elif m.role == "user" and order:
            results = [b for b in m.blocks if b.kind == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b.tool_use_id or "", 0)))
                blocks = [next(ranked) if b.kind == "tool_result" else b for b in m.blocks]
                m = dataclasses.replace(m, blocks=blocks)
        out.append(m)
    return out


def _drop_reasoning(messages: list[Message]) -> list[Message]:
    last_user = _last_user_index(messages)
    out: list[Message] = []
    for i, m in enumerate(messages):
        if i >= last_user or m.role in ("user", "system", "latest_reminder"):
            out.append(m)
        elif m.role == "assistant":
            out.append(dataclasses.replace(m, reasoning=None))
        # developer turns before the last user turn are dropped
    return out


def _user_block(block: UserBlock) -> Segment:
    if block.kind == "tool_result":
        return Segment(f"<tool_result>{block.text}</tool_result>")
    return Segment(block.text)


def _render_message(
    index: int, messages: list[Message], conv: Conversation, keep_reasoning: bool
) -> list[Segment]:
    m = messages[index]
    out: list[Segment] = []
    if index == 0 and conv.thinking and conv.think_max:
        out += template(THINK_MAX_PREFIX)
    if m.role == "system":
        out.append(Segment(m.content))
        if m.tools:
            out += [Segment("\n\n"), *render_tools(m)]
    elif m.role == "developer":
        out += [special(specials.USER), Segment(m.content)]
        if m.tools:
            out += [Segment("\n\n"), *render_tools(m)]
    elif m.role == "user":
        out.append(special(specials.USER))
        for i, block in enumerate(m.blocks):
            if i:
                out.append(Segment("\n\n"))
            out.append(_user_block(block))
    elif m.role == "latest_reminder":
        out += [special(specials.LATEST_REMINDER), Segment(m.content)]
    elif m.role == "assistant":
        if conv.thinking and (keep_reasoning or index > _last_user_index(messages)):
            out += [Segment(m.reasoning or ""), special(specials.THINK_END)]
        out.append(Segment(m.content))
        if m.raw_tool_calls is not None:
            # sampled bytes: the model emitted its DSML markers as special tokens
            out += template(m.raw_tool_calls)
        else:
            out += render_tool_calls(m.tool_calls)
        if not m.prefill:
            out.append(special(specials.EOS))
    else:  # pragma: no cover - Role is a closed Literal
        raise ValueError(f"unknown role {m.role!r}")

    following = messages[index + 1].role if index + 1 < len(messages) else None
    if following not in (None, "assistant", "latest_reminder"):
        return out
    if m.role in ("user", "developer"):
        out.append(special(specials.ASSISTANT))
        open_think = conv.thinking and (keep_reasoning or index >= _last_user_index(messages))
        out.append(special(specials.THINK_START if open_think else specials.THINK_END))
    return out


def render(conv: Conversation) -> list[Segment]:
    """The whole prompt as segments, BOS first."""
    messages = _sort_tool_results(_merge_users(list(conv.messages)))
    keep_reasoning = any(m.tools for m in messages)
    if conv.thinking and not keep_reasoning:
        messages = _drop_reasoning(messages)
    out: list[Segment] = [special(specials.BOS)]
    for i in range(len(messages)):
        out += _render_message(i, messages, conv, keep_reasoning)
    return out


def render_text(conv: Conversation) -> str:
    return join(render(conv))
