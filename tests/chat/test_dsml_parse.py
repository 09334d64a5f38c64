"""The generated-turn parser: pinned event streams, ports of ds4's DSML tests, and properties.

The central property is that the final parse is chunk-invariant: whatever the split (by
characters or by UTF-8 bytes), the folded events equal `parse_generated`. Round trips from a
test-local DSML renderer pin the parse to independently computed expectations, so a parser that
is consistent but wrong still fails.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4jax.chat.dsml_parse import DSMLStreamParser, find_stop, parse_generated, stop_safe_len
from ds4jax.chat.turn import (
    Event,
    ParsedCall,
    ParsedMessage,
    ParsedText,
    TextDelta,
    ThinkingDelta,
    ToolInputDelta,
    ToolUseStart,
    ToolUseStop,
    collect_events,
)

PROPS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FULL, SHORT, PLAIN = "｜DSML｜", "DSML｜", ""
WS = " \t\r\n"


def block(*invokes: str, p: str = FULL) -> str:
    return f"<{p}tool_calls>\n" + "".join(invokes) + f"</{p}tool_calls>"


def invoke(name: str, *params: str, p: str = FULL) -> str:
    return f'<{p}invoke name="{name}">\n' + "".join(params) + f"</{p}invoke>\n"


def param(key: str, value: str, string: str | None = "true", p: str = FULL) -> str:
    attr = "" if string is None else f' string="{string}"'
    return f'<{p}parameter name="{key}"{attr}>{value}</{p}parameter>\n'


def stream(
    chunks: Sequence[str | bytes], *, thinking: bool, stops: Sequence[str] = ()
) -> tuple[list[list[Event]], DSMLStreamParser]:
    """Events per feed call, with finish()'s events as the last entry."""
    parser = DSMLStreamParser(thinking=thinking, stop_sequences=stops)
    per_feed = [parser.feed(c) for c in chunks]
    per_feed.append(parser.finish())
    return per_feed, parser


def folded(
    chunks: Sequence[str | bytes], *, thinking: bool, stops: Sequence[str] = ()
) -> tuple[ParsedMessage, list[Event]]:
    per_feed, parser = stream(chunks, thinking=thinking, stops=stops)
    events = [e for feed in per_feed for e in feed]
    msg = collect_events(events, thinking=thinking)
    msg.raw_dsml, msg.error = parser.raw_dsml, parser.error
    return msg, events


def input_fragments(events: Sequence[Event], index: int = 0) -> list[str]:
    return [e.partial_json for e in events if isinstance(e, ToolInputDelta) and e.index == index]


def shown_text(events: Sequence[Event]) -> list[str]:
    return [e.text for e in events if isinstance(e, TextDelta | ThinkingDelta)]


def split(seq: Any, points: Sequence[int]) -> list[Any]:
    cuts = [0, *sorted(set(points)), len(seq)]
    return [seq[a:b] for a, b in pairwise(cuts) if b > a]


# ---------------------------------------------------------------------------------------------
# Pinned event streams


def test_event_stream_for_reasoning_text_and_one_call_is_exact() -> None:
    call = invoke("bash", param("command", "echo partial"))
    text = f"<think>We need to check</think>Sure.\n\n{block(call)}"
    cut1 = text.index("</th") + 4
    cut2 = text.index("\n\n")
    cut3 = text.index(" partial") + 8
    per_feed, parser = stream(
        [text[:17], text[17:cut1], text[cut1:cut2], text[cut2:cut3], text[cut3:]], thinking=True
    )
    assert per_feed == [
        [ThinkingDelta("We need to")],
        [ThinkingDelta(" check")],
        [TextDelta("Sure.")],
        [
            ToolUseStart(0, "bash"),
            ToolInputDelta(0, "{"),
            ToolInputDelta(0, '"command":"'),
            ToolInputDelta(0, "echo partial"),
        ],
        [ToolInputDelta(0, '"'), ToolInputDelta(0, "}"), ToolUseStop(0)],
        [],
    ]
    assert parser.error is None
    assert parser.raw_dsml == "\n\n" + block(call)


def test_event_stream_for_malformed_block_closes_call_and_returns_rest_as_text() -> None:
    bad = '<invoke name="b"></invoke></tool_calls> bye'
    text = f'Hi <tool_calls><invoke name="a"><parameter name="x" string="true">1</parameter>{bad}'
    per_feed, parser = stream([text], thinking=False)
    assert per_feed[0] == [
        TextDelta("Hi"),
        ToolUseStart(0, "a"),
        ToolInputDelta(0, "{"),
        ToolInputDelta(0, '"x":"'),
        ToolInputDelta(0, '1"'),
        ToolInputDelta(0, "}"),
        ToolUseStop(0, complete=False),
        TextDelta(bad),
    ]
    assert per_feed[1] == []
    assert parser.error == "invalid tool call"
    assert parser.raw_dsml is None


def test_event_stream_for_text_ending_inside_a_json_value_is_exact() -> None:
    text = 'x <DSML｜tool_calls><DSML｜invoke name="f"><DSML｜parameter name="a" string="false">[1,'
    per_feed, parser = stream([text], thinking=False)
    assert per_feed == [
        [TextDelta("x"), ToolUseStart(0, "f"), ToolInputDelta(0, "{")],
        [ToolInputDelta(0, "}"), ToolUseStop(0, complete=False)],
    ]
    assert parser.error == "unterminated tool call"
    assert parse_generated(text, thinking=False).blocks == [
        ParsedText("x"),
        ParsedCall("f", {}, complete=False),
    ]


def test_text_ending_inside_a_string_value_keeps_the_decoded_part_and_drops_the_tag() -> None:
    text = '<tool_calls><invoke name="f"><parameter name="a" string="true">a &amp b &lt;</param'
    msg = parse_generated(text, thinking=False)
    assert msg.tool_calls == [ParsedCall("f", {"a": "a &amp b <"}, complete=False)]
    assert msg.error == "unterminated tool call"
    assert msg.content == ""


# ---------------------------------------------------------------------------------------------
# Ports of ds4's streaming tests (§6.4) and parsing tests (§6.5)


def test_stream_sends_text_then_tool_call_with_partial_command() -> None:
    head = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    head += '<｜DSML｜parameter name="command" string="true">'
    tail = "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    msg, events = folded(["Hello.", head, "echo partial", " done", tail], thinking=False)
    fragments = input_fragments(events)
    order = [fragments.index(f) for f in ('"command":"', "echo partial", " done")]
    assert order == sorted(order)
    first_tool = next(i for i, e in enumerate(events) if isinstance(e, ToolUseStart))
    assert [e for e in events[:first_tool] if isinstance(e, TextDelta)] == [TextDelta("Hello.")]
    assert not any("DSML" in t for t in shown_text(events))
    assert msg.tool_calls == [ParsedCall("bash", {"command": "echo partial done"})]


def test_stream_waits_for_incomplete_invoke_and_parameter_tags() -> None:
    parser = DSMLStreamParser(thinking=False)
    assert parser.feed("\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv") == []
    assert parser.feed('oke name="ba') == []
    assert parser.feed('sh">\n') == [ToolUseStart(0, "bash"), ToolInputDelta(0, "{")]
    assert parser.feed("<｜DSML｜param") == []
    assert parser.feed('eter name="command" string="tr') == []
    assert parser.feed('ue">ls') == [ToolInputDelta(0, '"command":"'), ToolInputDelta(0, "ls")]


def test_stream_holds_raw_json_until_the_parameter_closes() -> None:
    parser = DSMLStreamParser(thinking=False)
    parser.feed('<｜DSML｜tool_calls><｜DSML｜invoke name="f">')
    assert parser.feed('<｜DSML｜parameter name="nums" string="false">[1,2,3') == []
    assert parser.feed("]</｜DSML｜parameter>") == [ToolInputDelta(0, '"nums":[1,2,3]')]


def test_stream_holds_partial_entities_in_string_values() -> None:
    head = '<｜DSML｜tool_calls><｜DSML｜invoke name="bash">'
    head += '<｜DSML｜parameter name="command" string="true">echo &amp'
    tail = "; done</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>"
    per_feed, _ = stream([head, tail], thinking=False)
    assert input_fragments(per_feed[0])[-1] == "echo "
    assert input_fragments(per_feed[1])[0] == '& done"'
    events = [e for feed in per_feed for e in feed]
    assert not any("&amp" in f for f in input_fragments(events))
    assert collect_events(events).tool_calls[0].arguments == {"command": "echo & done"}


def test_stream_holds_split_utf8_in_arguments_and_sends_it_whole() -> None:
    head = (
        '<｜DSML｜tool_calls><｜DSML｜invoke name="say"><｜DSML｜parameter name="t" string="true">'
    )
    body = "ok 😀!".encode()
    cut = body.index("😀".encode()) + 2
    tail = "</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>".encode()
    per_feed, _ = stream([head.encode() + body[:cut], body[cut:] + tail], thinking=False)
    assert input_fragments(per_feed[0])[-1] == "ok "
    assert input_fragments(per_feed[1])[0] == '😀!"'
    events = [e for feed in per_feed for e in feed]
    assert not any("\ufffd" in f for f in input_fragments(events))


def test_two_invokes_give_two_calls_with_their_names_and_keys() -> None:
    text = block(invoke("read", param("path", "a.c")), invoke("bash", param("command", "ls")))
    msg, events = folded(split(text, [5, 40, 90, 120]), thinking=False)
    assert msg.tool_calls == [
        ParsedCall("read", {"path": "a.c"}),
        ParsedCall("bash", {"command": "ls"}),
    ]
    assert [e.index for e in events if isinstance(e, ToolUseStart)] == [0, 1]
    assert json.loads("".join(input_fragments(events, 1))) == {"command": "ls"}


def test_arguments_keep_the_sampled_order_not_schema_order() -> None:
    params = param("description", "list") + param("command", "ls") + param("timeout", "5", "false")
    msg, events = folded([block(invoke("bash", params))], thinking=False)
    args = msg.tool_calls[0].arguments
    assert list(args) == ["description", "command", "timeout"]
    joined = "".join(input_fragments(events))
    assert joined.index("description") < joined.index("command") < joined.index("timeout")


def test_short_dialect_parses() -> None:
    text = "need a tool</think>\n\n" + block(
        invoke(
            "bash", param("description", "d", p=SHORT), param("command", "ls", p=SHORT), p=SHORT
        ),
        p=SHORT,
    )
    msg = parse_generated(text, thinking=True)
    assert msg.reasoning == "need a tool"
    assert msg.content == ""
    assert msg.tool_calls == [ParsedCall("bash", {"description": "d", "command": "ls"})]
    assert msg.raw_dsml == text[len("need a tool</think>") :]


def test_loose_nested_parameters_become_an_object() -> None:
    edits = "\n" + param("oldText", "old &lt;text>") + param("newText", "new", None)
    text = "review done\n\n" + block(
        invoke("edit", param("path", "/src/tetris.c"), param("edits", edits, None))
    )
    msg = parse_generated(text, thinking=False)
    assert msg.content == "review done"
    assert msg.error is None
    assert msg.tool_calls == [
        ParsedCall(
            "edit", {"path": "/src/tetris.c", "edits": {"oldText": "old <text>", "newText": "new"}}
        )
    ]


def test_malformed_invoke_without_name_returns_the_raw_text_as_content() -> None:
    text = "Let me look.\n\n" + block("<｜DSML｜invoke>\n</｜DSML｜invoke>\n")
    msg = parse_generated(text, thinking=False)
    assert msg.error == "invalid tool call"
    assert msg.content == text
    assert msg.tool_calls == []
    assert msg.raw_dsml is None


def test_dsml_inside_reasoning_is_not_executable() -> None:
    dsml = block(invoke("bash", param("command", "rm -rf /")))
    msg = parse_generated(f"<think>I could run {dsml}</think>Final answer.", thinking=True)
    assert msg.tool_calls == []
    assert dsml in (msg.reasoning or "")
    assert msg.content == "Final answer."
    assert msg.error is None


def test_dsml_after_reasoning_is_executable() -> None:
    text = "need a shell check</think>\n\n" + block(invoke("bash", param("command", "pwd")))
    msg = parse_generated(text, thinking=True)
    assert msg.reasoning == "need a shell check"
    assert msg.content == ""
    assert msg.tool_calls == [ParsedCall("bash", {"command": "pwd"})]


def test_tool_separator_whitespace_is_not_content() -> None:
    dsml = block(invoke("ls", param("path", ".")))
    text = "I will inspect the files.\n\n\n\n" + dsml
    for chunks in ([text], list(text)):
        msg, _ = folded(chunks, thinking=False)
        assert msg.content == "I will inspect the files."
        assert msg.raw_dsml == "\n\n\n\n" + dsml


def test_a_marker_the_turn_ended_inside_is_not_text() -> None:
    """max_tokens cutting `<｜DSML｜tool_calls>` short: the begun marker (and the separator
    before it) is markup, never shown; a text that ends in a bare `<` keeps it."""
    marker = block(invoke("ls", param("path", ".")))[: len("<｜DSML｜tool")]
    for chunks in (["Checking.\n\n" + marker], list("Checking.\n\n" + marker)):
        msg, events = folded(chunks, thinking=False)
        assert msg.content == "Checking." and not msg.tool_calls, events
        assert "DSML" not in "".join(shown_text(events))
    for text in ("a < b and c <", "x\n\n<"):
        assert folded([text], thinking=False)[0].content == text


def test_reasoning_stream_holds_back_a_possible_think_close() -> None:
    per_feed, _ = stream(["We need to generate ", "a title<", "/think>Title"], thinking=True)
    assert per_feed[:3] == [
        [ThinkingDelta("We need to generate ")],
        [ThinkingDelta("a title")],
        [TextDelta("Title")],
    ]


def test_reasoning_without_think_close_is_all_reasoning() -> None:
    msg = parse_generated("<think>still thinking " + block(invoke("x")), thinking=True)
    assert msg.reasoning == "still thinking " + block(invoke("x"))
    assert msg.blocks == []
    assert parse_generated("", thinking=True).reasoning == ""
    assert parse_generated("</think>hi", thinking=True).reasoning == ""
    assert parse_generated("hi", thinking=False).reasoning is None


def test_non_json_false_value_becomes_a_string_and_duplicate_key_is_malformed() -> None:
    text = block(invoke("f", param("a", "not json", "false"), param("b", ' {"x": 1} ', "false")))
    assert parse_generated(text, thinking=False).tool_calls == [
        ParsedCall("f", {"a": "not json", "b": {"x": 1}})
    ]
    dup = block(invoke("f", param("a", "1"), param("a", "2")))
    msg = parse_generated(dup, thinking=False)
    assert msg.error == "invalid tool call"
    assert msg.tool_calls == [ParsedCall("f", {"a": "1"}, complete=False)]
    assert msg.content.startswith('<｜DSML｜parameter name="a"')


def test_stop_list_finds_the_earliest_match() -> None:
    assert find_stop("hello STOP tail END", ["END", "STOP"]) == (6, 4)
    assert find_stop("hello </END> STOP", ["</END>", "STOP"]) == (6, 6)
    assert find_stop("abc", ["abc", "ab", ""]) == (0, 2)
    assert find_stop("nothing", ["END", ""]) is None


def test_stop_list_holds_only_a_tail_that_can_still_become_a_stop() -> None:
    # ds4 holds max_stop_len - 1 bytes (3 and 3 here); only a real prefix is held here.
    assert stop_safe_len("hello ", ["END", "STOP"]) == 6
    assert stop_safe_len("hello ST", ["END", "STOP"]) == 6
    assert stop_safe_len("hello </", ["</END>", "STOP"]) == 6
    assert stop_safe_len("hello </EN", ["</END>", "STOP"]) == 6
    assert stop_safe_len("hello </X", ["</END>", "STOP"]) == 9
    assert stop_safe_len("hello STOP", ["</END>", "STOP"]) == 6
    assert stop_safe_len("hello", ["", "lo!"]) == 3


def test_stream_holds_text_that_may_become_a_stop_sequence() -> None:
    per_feed, _ = stream(["hello </", "EN", "X"], thinking=False, stops=["</END>"])
    assert per_feed == [[TextDelta("hello ")], [], [TextDelta("</ENX")], []]
    per_feed, _ = stream(["why ST", "OP", "!"], thinking=True, stops=["STOP"])
    assert per_feed == [[ThinkingDelta("why ")], [], [ThinkingDelta("STOP!")], []]


# ---------------------------------------------------------------------------------------------
# Strategies


def fragments_for(p: str) -> list[str]:
    return [
        f"<{p}tool_calls>",
        f'<{p}invoke name="bash">',
        f'<{p}parameter name="cmd" string="true">',
        f'<{p}parameter name="n" string="false">',
        f'<{p}parameter name="e">',
        f"</{p}parameter>",
        f"</{p}invoke>",
        f"</{p}tool_calls>",
    ]


FRAGMENTS = [
    *fragments_for(FULL),
    *fragments_for(SHORT),
    *fragments_for(PLAIN),
    *("<｜DSML｜", "<DSML｜", "｜DSML｜", "<", "</", ">", "=", '"', "tool_calls>", "invoke"),
    *('invoke name="', "parameter", 'parameter name="', ' string="true">', ' string="false">'),
    *(' string="maybe">', " ", "\n", "\n\n", "\t", "&amp;", "&lt", "&", ";", "&quot;"),
    *("</think>", "<think>", "😀", "é", "x", "bash", "[1,2]", '{"a":1}', "STOP"),
]
grammar_text = st.lists(
    st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=3)), max_size=40
).map("".join)

# No "_" (so no marker, "tool_calls" or "think" can form) and no "｜".
plain_text = st.text(alphabet="ab <>/&;=\"'\n\t😀é{}[]", max_size=12)
attr_text = st.text(alphabet="ab <>&\"'=/😀é", max_size=6)
gap = st.sampled_from(["", "\n", " ", "\n\n", "\t ", "\r\n"])
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | plain_text,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(plain_text, c, max_size=3),
    max_leaves=8,
)


def esc_attr(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def esc_body(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;")


def render_param(draw: Any, p: str, key: str, string: str | None, body: str) -> str:
    attr = "" if string is None else f' string="{string}"'
    return f'<{p}parameter name="{esc_attr(key)}"{attr}>{body}</{p}parameter>' + draw(gap)


def draw_call(draw: Any, p: str) -> tuple[str, ParsedCall]:
    """Render one invoke with a test-local DSML writer and return the call it must parse to."""
    name = draw(attr_text.filter(bool))
    args: dict[str, Any] = {}
    params = ""
    for key in draw(st.lists(attr_text, unique=True, max_size=4)):
        kind = draw(st.sampled_from(["string", "loose", "json", "nested"]))
        if kind in ("string", "loose"):
            args[key] = draw(plain_text)
            params += render_param(
                draw, p, key, "true" if kind == "string" else None, esc_body(args[key])
            )
        elif kind == "json":
            args[key] = draw(json_values)
            seps = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
            ascii_ = draw(st.booleans())
            body = json.dumps(args[key], ensure_ascii=ascii_, separators=seps)
            params += render_param(draw, p, key, "false", body.replace("<", "\\u003c"))
        else:
            leaves = draw(st.dictionaries(attr_text, plain_text, min_size=1, max_size=3))
            args[key] = leaves
            inner = draw(gap)
            for k, v in leaves.items():
                inner += render_param(
                    draw, p, k, draw(st.sampled_from(["true", None])), esc_body(v)
                )
            params += render_param(draw, p, key, None, inner)
    text = f'<{p}invoke name="{esc_attr(name)}">' + draw(gap) + params + f"</{p}invoke>" + draw(gap)
    return text, ParsedCall(name, args)


@st.composite
def well_formed(draw: Any) -> tuple[str, bool, ParsedMessage]:
    """A turn that must parse cleanly, and the message it must parse to."""
    thinking = draw(st.booleans())
    p = draw(st.sampled_from([FULL, SHORT, PLAIN]))
    text, reasoning = "", None
    if thinking:
        reasoning = draw(plain_text)
        text = draw(st.sampled_from(["", "<think>"])) + reasoning + "</think>"
    content = draw(plain_text)
    text += content
    blocks: list[ParsedText | ParsedCall] = []
    raw_dsml = None
    if draw(st.booleans()):
        kept = content.rstrip(WS)
        calls = [draw_call(draw, p) for _ in range(draw(st.integers(0, 3)))]
        dsml = f"<{p}tool_calls>" + draw(gap) + "".join(c for c, _ in calls) + f"</{p}tool_calls>"
        raw_dsml = content[len(kept) :] + draw(gap) + dsml
        trailing = draw(plain_text)
        text = text[: len(text) - len(content)] + kept + raw_dsml + trailing
        pieces: list[ParsedText | ParsedCall] = [ParsedText(kept), *(c for _, c in calls)]
        pieces.append(ParsedText(trailing))
    else:
        pieces = [ParsedText(content)]
    for piece in pieces:  # adjacent texts fold into one block; empty ones vanish
        if isinstance(piece, ParsedText) and blocks and isinstance(blocks[-1], ParsedText):
            blocks[-1] = ParsedText(blocks[-1].text + piece.text)
        else:
            blocks.append(piece)
    blocks = [b for b in blocks if b != ParsedText("")]
    return text, thinking, ParsedMessage(reasoning, blocks, raw_dsml, None)


@st.composite
def damaged(draw: Any) -> str:
    """A well-formed turn cut short or with a fragment spliced in: reaches the deep states."""
    text = draw(well_formed())[0]
    at = draw(st.integers(0, len(text)))
    if draw(st.booleans()):
        return text[:at]
    return text[:at] + draw(st.sampled_from(FRAGMENTS)) + text[at:]


any_text = st.one_of(
    grammar_text, damaged(), st.text(max_size=60), well_formed().map(lambda w: w[0])
)


def check_calls_json(events: Sequence[Event], msg: ParsedMessage) -> None:
    starts = [e.index for e in events if isinstance(e, ToolUseStart)]
    stops = [e.index for e in events if isinstance(e, ToolUseStop)]
    assert starts == stops == list(range(len(starts)))
    for index, call in zip(starts, msg.tool_calls, strict=True):
        assert json.loads("".join(input_fragments(events, index))) == call.arguments


# ---------------------------------------------------------------------------------------------
# Properties


@PROPS
@given(any_text, st.booleans(), st.data())
def test_any_character_chunking_folds_to_the_final_parse(
    text: str, thinking: bool, data: Any
) -> None:
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    stops = data.draw(st.lists(st.sampled_from(["STOP", "</", "\n\n", "a>", "😀x"]), max_size=2))
    msg, events = folded(split(text, points), thinking=thinking, stops=stops)
    assert msg == parse_generated(text, thinking=thinking)
    check_calls_json(events, msg)
    assert all(e.text for e in events if isinstance(e, TextDelta | ThinkingDelta))


@PROPS
@given(any_text, st.booleans(), st.data())
def test_any_byte_chunking_folds_to_the_final_parse(text: str, thinking: bool, data: Any) -> None:
    raw = text.encode()
    points = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    msg, events = folded(split(raw, points), thinking=thinking)
    assert msg == parse_generated(raw.decode("utf-8", errors="replace"), thinking=thinking)
    check_calls_json(events, msg)
    if "\ufffd" not in text:
        assert not any("\ufffd" in t for t in shown_text(events) + input_fragments(events))


@PROPS
@given(well_formed(), st.data())
def test_well_formed_turns_parse_to_what_was_rendered(case: Any, data: Any) -> None:
    text, thinking, expected = case
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    msg, events = folded(split(text, points), thinking=thinking)
    assert msg == expected
    assert parse_generated(text, thinking=thinking) == expected
    assert not any("DSML" in t or "tool_calls" in t for t in shown_text(events))
    assert all(
        isinstance(e, ToolUseStop) and e.complete for e in events if isinstance(e, ToolUseStop)
    )


@PROPS
@given(st.binary(max_size=200), st.booleans(), st.data())
def test_arbitrary_bytes_never_raise(raw: bytes, thinking: bool, data: Any) -> None:
    points = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    msg, _ = folded(split(raw, points), thinking=thinking, stops=["\x00", "ab"])
    assert msg == parse_generated(raw.decode("utf-8", errors="replace"), thinking=thinking)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200), st.booleans())
def test_parse_generated_never_raises(text: str, thinking: bool) -> None:
    msg = parse_generated(text, thinking=thinking)
    assert (msg.reasoning is None) is (not thinking)
