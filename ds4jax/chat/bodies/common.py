"""What the three request schemas share: strict types that still pass unknown fields
through, unions chosen by a field (so an error names one branch, not every one tried),
refusals of inputs the server cannot honour, and the turn from pydantic's errors to a
`RequestError` naming the JSON path.

Strict: `"stream": "yes"` is not `true`, `"5"` is not `5`, `true` is not `1`; NaN and
infinities are refused. Unknown fields are kept (`extra="allow"`): Claude Code and Codex send
fields newer than any published schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ds4jax.chat.errors import RequestError, field_error

#: the mark of a union branch's tag in an error location: left out of the JSON path
_TAG = "~"
_OTHER = "~other"
BAD_TAG = "bad_tag:"


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _integral(value: Any) -> Any:
    """JSON Schema's integers include `2.0`; `2.5`, `"2"` and `true` are not integers."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """An integer (`2.0` included) within `bounds` (`ge`, `le`), published as such."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]  # type: ignore[arg-type]


Int = integer()
NonEmpty = Annotated[str, Field(min_length=1)]

#: a `tool_choice` that forces a call (`any`, `required`) where no tool was sent
NO_TOOL_TO_FORCE = "forces a tool call, but the request declares no tool to call"

#: what a tool's name may not hold: the model writes it inside a DSML attribute
#: (`invoke name="…"`), where these end the value or the tag, or decode as entities
_NAME_BREAKERS = frozenset('"<>&') | {chr(c) for c in (*range(32), 127)}


def _tool_name(value: str) -> str:
    if bad := sorted({c for c in value if c in _NAME_BREAKERS}):
        shown = ", ".join(repr(c) for c in bad)
        raise PydanticCustomError(
            "tool_name", "a tool name may not hold {shown}: the model writes it inside a "
            "DSML attribute, where it would not come back as sent", {"shown": shown},
        )  # fmt: skip
    return value


#: a tool's name as a client declares or names it (Anthropic's and OpenAI's own APIs allow
#: only `[a-zA-Z0-9_-]`; this refuses only what the model's format cannot carry)
ToolName = Annotated[str, Field(min_length=1), AfterValidator(_tool_name)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = integer(ge=0)
#: at most int32's: what a step's counters hold (the model's own limit is the server's check)
MaxTokens = integer(ge=1, le=2**31 - 1)


def either(
    choose: Callable[[Any], str | None],
    branches: dict[str, Any],
    expected: str,
    other: Any = None,
    field: str | None = None,
) -> Any:
    """A union whose branch `choose(value)` names (a key of `branches`); a value it names no
    branch for is an `other` when one is given, else an error saying what was `expected`
    (at the object's `field` when `choose` reads one: `messages[0].role`)."""
    if other is not None:
        branches = {**branches, _OTHER: other}
    members = tuple(Annotated[t, Tag(_TAG + name)] for name, t in branches.items())

    def tag(value: Any) -> str | None:
        if isinstance(value, BaseModel):  # serializing a validated body (an echo)
            value = value.model_dump(exclude_unset=True)
        name = choose(value)
        if not isinstance(name, str):  # a discriminating field that is a list or an object
            return None
        if name in branches:
            return _TAG + name
        return _TAG + _OTHER if other is not None else None

    disc = Discriminator(tag, custom_error_type=BAD_TAG + (field or ""),
                         custom_error_message=expected)  # fmt: skip
    union = members[0] if len(members) == 1 else _union(members)
    return Annotated[union, disc]


def _union(members: tuple[Any, ...]) -> Any:
    out = members[0]
    for m in members[1:]:
        out = out | m
    return out


def by_type(default: str | None = None) -> Callable[[Any], str | None]:
    """Choose a branch by the object's `type` field (`default` when absent)."""

    def choose(value: Any) -> str | None:
        if isinstance(value, BaseModel):
            return getattr(value, "type", default)
        if not isinstance(value, dict):
            return None
        kind = value.get("type", default)
        return kind if isinstance(kind, str) else None

    return choose


def typed(
    branches: dict[str, Any], expected: str, *, default: str | None = None, other: Any = None
) -> Any:
    """A union chosen by the object's `type` field (`either` with `by_type`)."""
    return either(by_type(default), branches, expected, other=other, field="type")


def by_shape(value: Any) -> str | None:
    """`text` for a string, `list` for a list: the content of a message."""
    if isinstance(value, str):
        return "text"
    return "list" if isinstance(value, list) else None


def text_or(parts: Any, expected: str) -> Any:
    """A string, or a list of `parts`."""
    return either(by_shape, {"text": str, "list": list[parts]}, expected)


def refused(what: str, why: str = "DeepSeek V4 reads text only") -> type[Body]:
    """A part the server cannot honour (images, audio, files), refused by name rather than
    dropped, so a client never believes the model saw it: `what is not supported: why`."""

    def refuse(cls: type, value: Any) -> Any:
        raise PydanticCustomError("unsupported", f"{what} is not supported: {why}")

    return _refusing("Refused " + what, refuse, f"Refused with a 400: {what} ({why}).")


def unknown(label: str, field: str = "type") -> type[Body]:
    """A branch for values whose `field` names nothing the schema lists: refused as
    `field: unsupported <label> 'kind'` (an `other` of `either`)."""

    def refuse(cls: type, value: Any) -> Any:
        kind = value.get(field) if isinstance(value, dict) else None
        raise PydanticCustomError(
            BAD_TAG + field, "unsupported {label} {kind}", {"label": label, "kind": repr(kind)}
        )

    return _refusing("Unknown " + label, refuse, f"Any other {label}: refused with a 400.")


def _refusing(title: str, refuse: Callable[[type, Any], Any], doc: str) -> type[Body]:
    name = "".join(w[:1].upper() + w[1:] for w in title.replace("_", " ").split())
    check = model_validator(mode="before")(classmethod(refuse))  # type: ignore[arg-type]
    return create_model(name, __base__=Body, __doc__=doc, __validators__={"refuse": check})


class Other(Body):
    """A part of a type the schema does not list, where the official encoder's placeholder
    is the honest rendering (`[Unsupported image]` inside a tool's output)."""

    type: str


def unique_names(named: Iterable[tuple[str, str]]) -> set[str]:
    """The tool names of `(JSON path, name)` pairs, refusing the first repeated one."""
    seen: set[str] = set()
    for where, name in named:
        if name in seen:
            raise field_error(where, f"duplicate tool name {name!r}")
        seen.add(name)
    return seen


M = TypeVar("M", bound=BaseModel)


def path(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as a JSON path: `messages[0].content[1].text`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(_TAG) or part.startswith("function-"):
            continue
        else:
            out += f".{part}" if out else part
    return out


#: the deepest nesting of arrays and objects a request body may have: far past any tool
#: schema, and short of what rendering a schema back to JSON (Python's recursion limit) and
#: the Responses echo (pydantic's depth limit, 255) can take, so depth is one clear 400
MAX_JSON_DEPTH = 128


class JSONConstant:
    """`NaN`, `Infinity` or `-Infinity` as written in a body (`json.loads(parse_constant=)`):
    not JSON numbers, refused by `body_problem` by name."""

    def __init__(self, name: str) -> None:
        self.name = name


def body_problem(body: Any) -> tuple[str, str] | None:
    """(JSON path, what is wrong) of the first value the request may not hold, else None,
    in one walk of the body: a string — value or key — holding a lone UTF-16 surrogate
    (JSON's `\\ud800` escapes parse into such strings, from a JavaScript client's string
    cut inside a pair: not Unicode text, so no tokenizer takes it, as Anthropic's API
    refuses it); NaN or an infinity (a reply echoing one would not parse); a number past
    float range; nesting deeper than `MAX_JSON_DEPTH` (path "")."""
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(body, ())]
    while stack:
        value, at = stack.pop()
        where = path(at) or "request body"
        if isinstance(value, dict | list) and len(at) == MAX_JSON_DEPTH:
            return "", f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        if isinstance(value, dict):
            for key, child in reversed(list(value.items())):
                if (bad := _surrogate(key)) is not None:  # named by where it sits
                    return where, _surrogate_text(f"{bad} in a key")
                stack.append((child, (*at, key)))
        elif isinstance(value, list):
            stack.extend((child, (*at, i)) for i, child in reversed(list(enumerate(value))))
        elif isinstance(value, JSONConstant):
            return where, f"{value.name} is not a JSON number"
        elif isinstance(value, float) and not math.isfinite(value):  # 1e400: valid JSON
            return where, "a number out of range (beyond float)"
        elif (bad := _surrogate(value)) is not None:
            return where, _surrogate_text(bad)
    return None


def _surrogate_text(escape: str) -> str:
    return (f"holds a lone UTF-16 surrogate ({escape}), which is not Unicode text: send each "
            "surrogate pair whole")  # fmt: skip


def _surrogate(value: Any) -> str | None:
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"\\u{ord(value[err.start]):04x}"
    return None


def validate(model: type[M], body: Any, *, checked: bool = False) -> M:
    """`body` as `model`, or a `RequestError` naming the first bad field's path (a value no
    field may hold, anywhere in it, first: `body_problem`; `checked`: the caller ran that
    walk already, as the server's `decode_json` does — one walk of a body, not two)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if not checked and (bad := body_problem(body)) is not None:
        where, what = bad
        raise field_error(where, what) if where else RequestError(what)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, RequestError):  # a check across fields names its own path
            raise cause from None
        where = path(first["loc"])
        tag_field = first["type"].removeprefix(BAD_TAG)
        if tag_field != first["type"] and tag_field and isinstance(first.get("input"), dict):
            where = f"{where}.{tag_field}" if where else tag_field
        message = first["msg"]
        if where:
            raise RequestError(f"{where}: {message}", param=where) from None
        raise RequestError(message) from None


#: a string or a list of strings (stop sequences)
Strings = either(
    by_shape, {"text": str, "list": list[str]}, "must be a string or a list of strings"
)
