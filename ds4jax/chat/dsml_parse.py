"""Parse a generated DeepSeek V4 assistant turn (reasoning, text, DSML tool calls) into events.

There is exactly one parser: `DSMLStreamParser`, an incremental state machine. The final parse
(`parse_generated`) is that same machine fed the whole text and finished, folded by
`collect_events`. So "the events streamed over any chunking, concatenated, equal the final parse"
holds by construction, not by keeping two parsers in step as ds4 does. The machine only acts on a
decision once no continuation of the text could change it; anything still ambiguous (a possible
`</think>`, a possible tool-call marker and the whitespace before it, a partial closing tag, a
partial `&entity`, a possible stop sequence, a partial UTF-8 sequence) is held back.

Deliberate differences from ds4 (`parse_generated_message_ex`, the live projections), all because
a streaming server cannot retract events it has already sent, so the final parse must agree with
the stream:

* The start marker is found by position (the first one in the text wins), not by ds4's dialect
  priority list.
* Thinking mode with no `</think>`: everything is reasoning and the content is empty (ds4 makes
  the whole text the content).
* A malformed block stops tool parsing. An open call is closed so its JSON stays valid, marked
  `complete=False` (its `ToolUseStop` says so), and the text from the offending element to the
  end of the turn becomes a trailing text block; `error` is "invalid tool call". If the block had
  not started any call yet, the whole block, including the whitespace before its marker, becomes
  text, so the content then equals ds4's (the whole raw text). The caller must not execute calls
  or report `tool_use` when `error` is set or a call is incomplete.
* Text that ends inside a block (max_tokens): an open call is closed as above, `complete=False`,
  `error` is "unterminated tool call", and an unfinished tag is dropped (never shown as text).
  An unfinished string value keeps the part already decoded.
* `string="false"` values are held until their closing tag, then validated: valid JSON is
  re-emitted compact, invalid text becomes a JSON string (ds4 passes it through unvalidated,
  which can produce invalid arguments JSON).
* A missing `string` attribute is a string (or a loose nested object, ds4's recovery rule) in
  the stream too; ds4's live projection rejects it.
* A duplicate parameter name in one object is malformed (ds4 would emit a duplicate JSON key).
* Attribute values may not contain `<` or a newline: such a tag is malformed instead of
  swallowing the following tags while waiting for the closing quote.
* Stop sequences hold only a tail that is still a prefix of one of them, instead of ds4's fixed
  `max_stop_len - 1` bytes.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from ds4jax.chat.specials import DSML, THINK_END, THINK_START
from ds4jax.chat.turn import (
    Event,
    ParsedMessage,
    TextDelta,
    ThinkingDelta,
    ToolInputDelta,
    ToolUseStart,
    ToolUseStop,
    collect_events,
)

__all__ = ["DSMLStreamParser", "find_stop", "parse_generated", "stop_safe_len"]


# ---------------------------------------------------------------------------------------------
# Small text helpers


_WS = " \t\r\n"
_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'"}
_ENTITY_RE = re.compile("|".join(re.escape(e) for e in _ENTITIES))
#: A tag longer than this is malformed: bounds the rescanning of a tag that never closes.
_MAX_TAG = 4096


def _decode_entities(text: str) -> str:
    return _ENTITY_RE.sub(lambda m: _ENTITIES[m.group(0)], text) if "&" in text else text


def _json_fragment(text: str) -> str:
    """JSON string escaping is per character, so escaped fragments concatenate correctly."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _json_value(text: str) -> str:
    """Compact JSON for a `string="false"` body; text that is not strict JSON becomes a string."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError):
        return json.dumps(text, ensure_ascii=False)


def _held_start(text: str, lo: int, candidates: Sequence[str]) -> int:
    """Start of the longest tail of `text[lo:]` that is a prefix of a candidate.

    "Is a prefix of a candidate" is closed under taking prefixes, which is what makes holding
    such a tail chunk-invariant: a tail held now was held (at least) in every earlier, shorter
    buffer too. A whole candidate is held as well: a complete stop sequence is never sent.
    """
    n = len(text)
    longest = max((len(c) for c in candidates), default=0)
    for j in range(max(lo, n - longest), n):
        tail = text[j:]
        if any(c.startswith(tail) for c in candidates):
            return j
    return n


def _ws_start(text: str, lo: int, end: int) -> int:
    while end > lo and text[end - 1] in _WS:
        end -= 1
    return end


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def stop_safe_len(text: str, stops: Sequence[str]) -> int:
    """How much of `text` can be sent now: all but a tail that is, or may still grow into, a
    stop sequence."""
    return _held_start(text, 0, [s for s in stops if s])


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """The earliest stop match as (position, length). At one position the shortest stop wins,
    because it is the one that completes first while tokens arrive."""
    best: tuple[int, int] | None = None
    for s in stops:
        if not s:
            continue
        pos = text.find(s)
        if pos >= 0 and (best is None or (pos, len(s)) < best):
            best = (pos, len(s))
    return best


# ---------------------------------------------------------------------------------------------
# Tag matching. Each matcher answers DONE, MORE (the text so far is a prefix of a valid tag)
# or BAD, and never changes its answer from DONE or BAD when more text arrives.


class _Match(Enum):
    MORE = auto()
    BAD = auto()
    DONE = auto()


def _match_fixed(text: str, i: int, tag: str) -> _Match:
    if text.startswith(tag, i):
        return _Match.DONE
    if len(text) - i < len(tag) and tag.startswith(text[i:]):
        return _Match.MORE
    return _Match.BAD


def _scan_tag(text: str, i: int, head: str) -> tuple[int, dict[str, str]] | _Match:
    """Match `head (WS+ attr="value")* WS* >` at `i`; on success (end, decoded attributes).

    Only the first `_MAX_TAG` characters are looked at, so the answer for a prefix of the text
    is MORE or the same answer as for the whole text.
    """
    head_match = _match_fixed(text, i, head)
    if head_match is not _Match.DONE:
        return head_match
    n = min(len(text), i + _MAX_TAG)
    ran_out = _Match.MORE if n == len(text) else _Match.BAD
    j = i + len(head)
    attrs: dict[str, str] = {}
    while j < n:
        if text[j] == ">":
            return j + 1, attrs
        if text[j] not in _WS:
            return _Match.BAD
        j = _skip_ws(text, j)
        if j < n and text[j] == ">":
            continue
        k = j
        while k < n and text[k].isascii() and (text[k].isalnum() or text[k] in "_:-."):
            k += 1
        if k + 1 >= n:
            return ran_out if k == n or text[k] == "=" else _Match.BAD
        if k == j or text[k] != "=" or text[k + 1] != '"':
            return _Match.BAD
        v = k + 2
        while v < n and text[v] not in '"<\n':
            v += 1
        if v == n:
            return ran_out
        if text[v] != '"':
            return _Match.BAD
        attrs.setdefault(text[j:k], _decode_entities(text[k + 2 : v]))
        j = v + 1
    return ran_out


@dataclass(frozen=True)
class _Dialect:
    """The tag spellings of one DSML dialect; the start marker fixes it for the whole block."""

    marker: str
    invoke_head: str
    invoke_end: str
    param_head: str
    param_end: str
    block_end: str

    @classmethod
    def with_prefix(cls, p: str) -> _Dialect:
        return cls(
            marker=f"<{p}tool_calls>",
            invoke_head=f"<{p}invoke",
            invoke_end=f"</{p}invoke>",
            param_head=f"<{p}parameter",
            param_end=f"</{p}parameter>",
            block_end=f"</{p}tool_calls>",
        )


#: Full (`<｜DSML｜…`), short (first bar missing, `<DSML｜…`) and plain XML (`<tool_calls>`).
_DIALECTS = tuple(_Dialect.with_prefix(p) for p in (DSML, DSML[1:], ""))
_MARKERS = tuple(d.marker for d in _DIALECTS)


class _State(Enum):
    THINK_OPEN = auto()  # thinking mode, at the very start: a repeated `<think>` is skipped
    THINK = auto()  # reasoning, until `</think>`
    TEXT = auto()  # visible text, until a tool_calls marker
    BLOCK = auto()  # inside tool_calls, between invokes
    PARAMS = auto()  # inside an invoke (or a loose nested object), between parameters
    STRING = auto()  # a string value, streamed
    JSON = auto()  # a string="false" value, held until its closing tag
    LOOSE = auto()  # a value without `string`: nested object or string, not yet known
    TRAILER = auto()  # after a malformed block: the rest of the turn is text
    DONE = auto()


@dataclass
class _Obj:
    """One open JSON object of the current call: the arguments, or a loose nested value."""

    keys: set[str] = field(default_factory=set)
    emitted: int = 0


class DSMLStreamParser:
    """Incremental parser of one generated assistant turn; see the module docstring."""

    def __init__(self, *, thinking: bool, stop_sequences: Sequence[str] = ()) -> None:
        self._stops = tuple(s for s in stop_sequences if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""  # text not yet consumed starts at self._i
        self._i = 0
        self._state = _State.THINK_OPEN if thinking else _State.TEXT
        self._out: list[Event] = []
        self._dialect = _DIALECTS[0]
        self._raw: list[str] = []  # the current block's text consumed so far
        self._raw_dsml: str | None = None
        self._error: str | None = None
        self._calls = 0  # calls started this turn; the open call is self._calls - 1
        self._block_calls = 0  # calls started in the current block
        self._objs: list[_Obj] = []  # open objects of the open call; empty when none is open
        self._key = ""  # the parameter whose value is being read
        self._finished = False

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def raw_dsml(self) -> str | None:
        return self._raw_dsml

    @property
    def in_block(self) -> bool:
        """Inside a tool-call block: its marker consumed, its end not yet."""
        return self._state in (_State.BLOCK, _State.PARAMS, _State.STRING, _State.JSON,
                               _State.LOOSE)  # fmt: skip

    def feed(self, chunk: str | bytes) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if isinstance(chunk, bytes | bytearray | memoryview):
            text = self._decoder.decode(bytes(chunk))
        else:
            text = self._decoder.decode(b"", final=True) + chunk
            self._decoder.reset()
        self._buf = self._buf[self._i :] + text
        self._i = 0
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        if not self._finished:
            self._finished = True
            self._buf = self._buf[self._i :] + self._decoder.decode(b"", final=True)
            self._i = 0
            self._run(final=True)
        return self._take()

    # -- plumbing ------------------------------------------------------------------------------

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _run(self, final: bool) -> None:
        handlers = {
            _State.THINK_OPEN: self._think_open,
            _State.THINK: self._think,
            _State.TEXT: self._text,
            _State.BLOCK: self._block,
            _State.PARAMS: self._params,
            _State.STRING: self._string,
            _State.JSON: self._json,
            _State.LOOSE: self._loose,
            _State.TRAILER: self._trailer,
            _State.DONE: lambda final: False,
        }
        while handlers[self._state](final):
            pass

    def _consume(self, j: int) -> None:
        if self._state not in (_State.THINK_OPEN, _State.THINK, _State.TEXT, _State.TRAILER):
            self._raw.append(self._buf[self._i : j])
        self._i = j

    def _emit_text(self, j: int, kind: type[TextDelta] | type[ThinkingDelta]) -> None:
        if j > self._i:
            self._out.append(kind(self._buf[self._i : j]))
        self._i = j

    def _emit_json(self, s: str) -> None:
        if s:
            self._out.append(ToolInputDelta(self._calls - 1, s))

    def _key_prefix(self) -> str:
        obj = self._objs[-1]
        obj.emitted += 1
        return ("," if obj.emitted > 1 else "") + json.dumps(self._key, ensure_ascii=False) + ":"

    def _text_hold(self, candidates: Sequence[str]) -> int:
        return min(_held_start(self._buf, self._i, candidates), self._stop_hold())

    def _stop_hold(self) -> int:
        return _held_start(self._buf, self._i, self._stops)

    # -- reasoning and text --------------------------------------------------------------------

    def _think_open(self, final: bool) -> bool:
        buf, i = self._buf, self._i
        if buf.startswith(THINK_START, i):
            self._i += len(THINK_START)
        elif not final and len(buf) - i < len(THINK_START) and THINK_START.startswith(buf[i:]):
            return False
        self._state = _State.THINK
        return True

    def _think(self, final: bool) -> bool:
        k = self._buf.find(THINK_END, self._i)
        if k >= 0:
            self._emit_text(k, ThinkingDelta)
            self._i = k + len(THINK_END)
            self._state = _State.TEXT
            return True
        end = len(self._buf) if final else self._text_hold((THINK_END,))
        self._emit_text(end, ThinkingDelta)
        return False

    def _text(self, final: bool) -> bool:
        buf, i = self._buf, self._i
        found = [(k, d) for d in _DIALECTS if (k := buf.find(d.marker, i)) >= 0]
        if found:
            k, dialect = min(found, key=lambda kd: kd[0])
            sep = _ws_start(buf, i, k)
            self._emit_text(sep, TextDelta)
            self._dialect, self._block_calls = dialect, 0
            self._raw = [buf[sep : k + len(dialect.marker)]]
            self._i = k + len(dialect.marker)
            self._state = _State.BLOCK
            return True
        # Hold a possible marker and the whitespace before it: that whitespace is the block's
        # separator, never content.
        marker_at = _ws_start(buf, i, _held_start(buf, i, _MARKERS))
        if final:
            # a marker the turn ended inside (max_tokens cut `<｜DSML｜tool`) is markup begun,
            # never text; a bare `<` may be text, and is shown
            self._emit_text(marker_at if DSML in buf[marker_at:] else len(buf), TextDelta)
            return False
        self._emit_text(min(marker_at, self._stop_hold()), TextDelta)
        return False

    def _trailer(self, final: bool) -> bool:
        self._emit_text(len(self._buf) if final else self._stop_hold(), TextDelta)
        return False

    # -- the tool_calls block ------------------------------------------------------------------

    def _skip_to_element(self, final: bool) -> bool:
        """Consume whitespace between elements; False when the text ran out first."""
        j = _skip_ws(self._buf, self._i)
        self._consume(j)
        if j < len(self._buf):
            return True
        if final:
            self._unterminated()
        return False

    def _block(self, final: bool) -> bool:
        if not self._skip_to_element(final):
            return False
        d, buf, i = self._dialect, self._buf, self._i
        end = _match_fixed(buf, i, d.block_end)
        if end is _Match.DONE:
            self._consume(i + len(d.block_end))
            if self._raw_dsml is None:
                self._raw_dsml = "".join(self._raw)
            self._raw = []
            self._state = _State.TEXT
            return True
        tag = _scan_tag(buf, i, d.invoke_head)
        if isinstance(tag, tuple):
            j, attrs = tag
            name = attrs.get("name")
            if not name:
                return self._fail()
            self._consume(j)
            self._calls += 1
            self._block_calls += 1
            self._objs = [_Obj()]
            self._out.append(ToolUseStart(self._calls - 1, name))
            self._emit_json("{")
            self._state = _State.PARAMS
            return True
        return self._wait_or_fail(final, end, tag)

    def _params(self, final: bool) -> bool:
        if not self._skip_to_element(final):
            return False
        d, buf, i = self._dialect, self._buf, self._i
        nested = len(self._objs) > 1
        end_tag = d.param_end if nested else d.invoke_end
        end = _match_fixed(buf, i, end_tag)
        if end is _Match.DONE:
            self._consume(i + len(end_tag))
            self._objs.pop()
            self._emit_json("}")
            if not nested:
                self._out.append(ToolUseStop(self._calls - 1))
                self._state = _State.BLOCK
            return True
        tag = _scan_tag(buf, i, d.param_head)
        if isinstance(tag, tuple):
            j, attrs = tag
            key, kind = attrs.get("name"), attrs.get("string")
            if key is None or key in self._objs[-1].keys or kind not in (None, "true", "false"):
                return self._fail()
            self._consume(j)
            self._objs[-1].keys.add(key)
            self._key = key
            if kind == "true" or (kind is None and nested):
                self._emit_json(self._key_prefix() + '"')
                self._state = _State.STRING
            else:
                self._state = _State.JSON if kind == "false" else _State.LOOSE
            return True
        return self._wait_or_fail(final, end, tag)

    def _string(self, final: bool) -> bool:
        end_tag, buf, i = self._dialect.param_end, self._buf, self._i
        k = buf.find(end_tag, i)
        if k >= 0:
            self._emit_json(_json_fragment(_decode_entities(buf[i:k])) + '"')
            self._consume(k + len(end_tag))
            self._state = _State.PARAMS
            return True
        # A partial closing tag is never value text; a partial entity is, once the text ends.
        hold = _held_start(buf, i, (end_tag,) if final else (end_tag, *_ENTITIES))
        self._emit_json(_json_fragment(_decode_entities(buf[i:hold])))
        self._consume(hold)
        if final:
            self._unterminated()
        return False

    def _json(self, final: bool) -> bool:
        end_tag = self._dialect.param_end
        k = self._buf.find(end_tag, self._i)
        if k >= 0:
            self._emit_json(self._key_prefix() + _json_value(self._buf[self._i : k]))
            self._consume(k + len(end_tag))
            self._state = _State.PARAMS
            return True
        if final:
            self._unterminated()
        return False

    def _loose(self, final: bool) -> bool:
        """ds4's recovery: no `string` attribute and the value opens with another parameter tag
        means the leaf parameters form a JSON object; otherwise the value is a string."""
        head, buf = self._dialect.param_head, self._buf
        j = _skip_ws(buf, self._i)
        if buf.startswith(head, j):
            self._emit_json(self._key_prefix() + "{")
            self._objs.append(_Obj())
            self._state = _State.PARAMS
            return True
        if j == len(buf) or _match_fixed(buf, j, head) is _Match.MORE:
            if final:
                self._unterminated()
            return False
        self._emit_json(self._key_prefix() + '"')
        self._state = _State.STRING
        return True

    def _wait_or_fail(self, final: bool, *answers: Any) -> bool:
        if _Match.MORE not in answers:
            return self._fail()
        if final:
            self._unterminated()
        return False

    def _close_call(self) -> None:
        if self._objs:
            self._emit_json(('"' if self._state is _State.STRING else "") + "}" * len(self._objs))
            self._out.append(ToolUseStop(self._calls - 1, complete=False))
            self._objs = []

    def _fail(self) -> bool:
        """Malformed block: the offending element and the rest of the turn become text."""
        self._close_call()
        self._error = self._error or "invalid tool call"
        rest = self._buf[self._i :]
        self._buf = ("".join(self._raw) if self._block_calls == 0 else "") + rest
        self._i = 0
        self._raw = []
        self._state = _State.TRAILER
        return True

    def _unterminated(self) -> None:
        self._close_call()
        self._error = self._error or "unterminated tool call"
        self._buf, self._i, self._raw = "", 0, []
        self._state = _State.DONE


def parse_generated(text: str, *, thinking: bool) -> ParsedMessage:
    """The authoritative parse of a whole turn: the streaming parser fed everything at once."""
    parser = DSMLStreamParser(thinking=thinking)
    msg = collect_events([*parser.feed(text), *parser.finish()], thinking=thinking)
    msg.raw_dsml, msg.error = parser.raw_dsml, parser.error
    return msg
