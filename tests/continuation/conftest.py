"""A real engine on the tiny config (real V4 tokenizer, random weights), shared by the
continuation tests; every test starts from a reset engine."""

from __future__ import annotations

from typing import Any

import pytest

from ds4jax.chat.anthropic import parse_messages_request
from ds4jax.chat.segments import template
from ds4jax.chat.tokenizer import V4Tokenizer
from ds4jax.config import Config, load_config
from ds4jax.engine import Engine, Prepared
from ds4jax.model.params import init_params

TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


def exact_tiny_engine() -> Engine:
    """The tiny model with quantization simulation off: exact math, so "a continued state
    equals a cold prefill" is checked to float32 rounding, not to the odd FP8 rounding flip
    between chunkings. The serve tests' engine too, so both families run the same programs."""
    cfg = load_config("tiny").replace(quant_sim=False)
    return Engine(cfg, init_params(cfg, 0), V4Tokenizer(), max_len=2048, chunk_sizes=(16, 64))


@pytest.fixture(scope="session")
def _engine() -> Engine:
    return exact_tiny_engine()


def like(e: Engine, cfg: Config | None = None, **kw: Any) -> Engine:
    """Another engine on `e`'s model, context and chunk sizes (so it compiles what `e` did),
    with the pool options `kw` (sessions, fork points, batch, pages, spans…) and, with
    `cfg`, another config of the same weights (a state dtype, say)."""
    return Engine(cfg or e.cfg, e.params, e.tokenizer, max_len=e.max_len,
                  chunk_sizes=e.chunk_sizes, **kw)  # fmt: skip


@pytest.fixture
def engine(_engine: Engine) -> Engine:
    _engine.reset()
    _engine.tool_memory = type(_engine.tool_memory)()
    return _engine


def prepare(engine: Engine, body: dict[str, Any], max_tokens: int = 8) -> Prepared:
    req = parse_messages_request(body)
    return engine.prepare(
        req.conversation,
        max_tokens=max_tokens,
        has_tools=bool(req.conversation.messages and req.conversation.messages[0].tools),
        stop_sequences=req.stop_sequences,
    )


def forced(engine: Engine, text: str) -> list[int]:
    """Token ids a model would emit for `text` (its DSML and think markers as specials)."""
    return engine.tokenizer.encode_segments(template(text))


def tool_call_text(command: str, reasoning: str = "I should run it.") -> str:
    return (
        f'{reasoning}</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
        f'<｜DSML｜parameter name="command" string="true">{command}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
