"""The simulated agent and its clients: the system prompt, tasks, tools and tool results of
the seeded conversations, the argument bytes a model may sample (`sampled_dsml`), and how each
client re-serialises the `tool_use.input` it replays (`client_roundtrip`). No model here."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ds4jax.chat import specials

#: How clients serialise the `tool_use.input` they replay: Python (`json` round trip, floats
#: stay floats), TypeScript (`JSON.stringify` writes 30.0 as 30), Go (`encoding/json` on a
#: `map[string]any`: sorted keys, 30.0 as 30).
CLIENTS: tuple[str, ...] = ("python", "typescript", "go")

SYSTEM = "You are a careful coding agent working in a Python repository."
TASKS: tuple[str, ...] = (
    "The HTTP client times out on large uploads. Find where the timeout is set and fix it.",
    "Run the failing test in tests/test_io.py and tell me why it fails.",
    "Rename the helper `load_cfg` to `load_config` everywhere.",
    "Is there a résumé parser in this repo? Find it and check its unicode handling.",
    "Add a retry with backoff to the download function.",
    "Count the TODO comments under src/ and list the files.",
)
TOOLS: list[dict[str, Any]] = [
    {
        "name": "bash",
        "description": "Run a shell command and return its output",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
    {
        "name": "edit",
        "description": "Replace text in a file",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "replace": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["path", "replace"],
        },
    },
    {
        "name": "search",
        "description": "Search the repository",
        "input_schema": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "paths": {"type": "array", "items": {"type": "string"}},
                "max_results": {"type": "integer"},
                "regex": {"type": "boolean"},
            },
            "required": ["query"],
        },
    },
]

#: Argument bytes as a model may sample them: (DSML value text, string attribute). Several are
#: valid but not canonical, so the client's JSON round trip re-serialises them differently.
_ARGS: dict[str, dict[str, list[tuple[str, bool]]]] = {
    "bash": {
        "command": [
            ("ls -la src", True),
            ('grep -rn "timeout" --include=*.py .', True),
            ("pytest -q tests/test_io.py::test_read", True),
            ("sed -n '1,40p' README.md", True),
            ('echo "café" | wc -c', True),
            ("make test &amp;&amp; git status", True),  # entities: decoded by the parser
        ],
        "timeout": [("30", False), ("30.0", False), ("3e1", False), ("30.50", False)],
    },
    "edit": {
        "path": [("src/client.py", True), ("src/résumé.py", True)],
        "line": [("42", False), ("7", False)],
        "replace": [
            ('{"old": "timeout=10", "new": "timeout=60"}', False),
            ('{"old":"timeout=10","new":"timeout=60"}', False),
            ('{ "new": "retries = 5", "old": "retries = 3" }', False),
            ('{"old": "na\\u00efve", "new": "naïve"}', False),
        ],
        "tags": [
            ('["fix", "io"]', False),
            ('["fix","io"]', False),
            ('["r\\u00e9sum\\u00e9"]', False),
        ],
    },
    "search": {
        "query": [("load_cfg", True), ("TODO", True), ("def download", True)],
        "paths": [('["src", "tests"]', False), ('[ "src" ]', False)],
        "max_results": [("20", False), ("100", False)],
        "regex": [("false", False), ("true", False)],
    },
}
_RESULTS: tuple[str, ...] = (
    "src/client.py:12:    timeout=10\nsrc/upload.py:88:    timeout=timeout",
    "F\n=================== FAILURES ===================\nAssertionError: b'' != b'data'\n"
    "1 failed in 0.04s",
    "Applied 1 edit to src/client.py",
    "7\n",
    "src/parse/résumé.py\nsrc/parse/__init__.py",
)


def _tool_call(rng: np.random.Generator, tool: str) -> list[tuple[str, str, bool]]:
    """(name, value text, string) of one sampled call: the required parameters and, with
    probability 1/2 each, the optional ones, in schema order."""
    schema = next(t for t in TOOLS if t["name"] == tool)["input_schema"]
    out = []
    for name in schema["properties"]:
        if name in schema["required"] or rng.random() < 0.5:
            options = _ARGS[tool][name]
            value, is_str = options[int(rng.integers(len(options)))]
            out.append((name, value, is_str))
    return out


def sampled_dsml(rng: np.random.Generator) -> tuple[str, int]:
    """A DSML tool-call block as a model may sample it (one call, or two in parallel) and the
    number of calls. The byte layout is the official one; only argument values vary."""
    calls = 2 if rng.random() < 0.3 else 1
    invokes = []
    for _ in range(calls):
        tool = TOOLS[int(rng.integers(len(TOOLS)))]["name"]
        params = [
            f'<{specials.DSML}parameter name="{n}" string="{"true" if s else "false"}">'
            f"{v}</{specials.DSML}parameter>"
            for n, v, s in _tool_call(rng, tool)
        ]
        invokes.append(
            f'<{specials.DSML}invoke name="{tool}">\n'
            + "\n".join(params)
            + f"\n</{specials.DSML}invoke>"
        )
    block = (
        f"\n\n<{specials.DSML}tool_calls>\n"
        + "\n".join(invokes)
        + f"\n</{specials.DSML}tool_calls>"
    )
    return block, calls


def client_roundtrip(value: Any, client: str) -> Any:
    """`value` after a client parsed it from the response and serialised it back (see
    `CLIENTS`)."""
    if client not in CLIENTS:
        raise ValueError(f"unknown client {client!r} (one of {CLIENTS})")
    out = json.loads(json.dumps(value, ensure_ascii=False))
    if client == "python":
        return out

    def fix(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [fix(x) for x in v]
        if isinstance(v, dict):
            keys = sorted(v) if client == "go" else list(v)
            return {k: fix(v[k]) for k in keys}
        return v

    return fix(out)
