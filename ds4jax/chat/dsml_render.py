"""Canonical DSML rendering of tool calls, in the official V4 encoder's format.

Used when a client replays a `tool_use` whose exact sampled bytes are not remembered (exact
replay by tool id arrives with the engine). Bytes follow `encoding_dsv4.py`: string values
raw, other values `json.dumps(v, ensure_ascii=False)` with default separators, one element
per line. One deliberate difference: a string value containing the exact closing tag
`</｜DSML｜parameter>` has that tag written `&lt;/｜DSML｜parameter>` (as ds4 does), because
the official form would end the value early and the parser decodes `&lt;` back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ds4jax.chat import specials
from ds4jax.chat.conversation import ToolCall
from ds4jax.chat.segments import Segment, special

_PARAM_CLOSE = "</" + specials.DSML + "parameter>"


def to_json(value: Any) -> str:
    """JSON exactly as the official encoder writes schemas and non-string arguments."""
    return json.dumps(value, ensure_ascii=False)


def escape_string_value(value: str) -> str:
    return value.replace(_PARAM_CLOSE, "&lt;" + _PARAM_CLOSE[1:])


def _arguments(call: ToolCall) -> dict[str, Any]:
    if isinstance(call.arguments, dict):
        return call.arguments
    if isinstance(call.arguments, str):
        try:
            parsed = json.loads(call.arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
        return {"arguments": call.arguments}
    return {"arguments": call.arguments}


def render_tool_calls(calls: Sequence[ToolCall]) -> list[Segment]:
    """`\\n\\n<｜DSML｜tool_calls>\\n…\\n</｜DSML｜tool_calls>` as segments (empty for no calls)."""
    if not calls:
        return []
    dsml = special(specials.DSML)
    out: list[Segment] = [Segment("\n\n<"), dsml, Segment("tool_calls>\n")]
    for n, call in enumerate(calls):
        if n:
            out.append(Segment("\n"))
        out += [Segment("<"), dsml, Segment(f'invoke name="{call.name}">\n')]
        for i, (key, value) in enumerate(_arguments(call).items()):
            if i:
                out.append(Segment("\n"))
            is_str = isinstance(value, str)
            text = escape_string_value(value) if is_str else to_json(value)
            out += [Segment("<"), dsml]
            out.append(Segment(f'parameter name="{key}" string="{"true" if is_str else "false"}">'))
            out += [Segment(text), Segment("</"), dsml, Segment("parameter>")]
        out += [Segment("\n</"), dsml, Segment("invoke>")]
    out += [Segment("\n</"), dsml, Segment("tool_calls>")]
    return out
