"""Memory pressure as a client meets it (issue 26 §5), with the official SDK over a real
socket: an idle session the state budget evicts waits in host RAM and its `tool_result`
still continues it live (`/metrics` counts the host restore), and a request no page can be
found for is a 529 `overloaded_error` with `retry-after`, after which the server goes on
serving and the refused request, retried once there is room, is answered."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from ds4jax.engine import Engine
from serve.app import RETRY_AFTER_S
from serve.worker import EngineWorker
from tests.continuation.conftest import like
from tests.serve.conftest import MODEL, NO_THINK, TOOLS, ThreadServer, dsml_call, force, make_app
from tests.serve.metrics_scrape import scrape

SYSTEM = "You are one of several agents working on the same repository."


Served = tuple[ThreadServer, anthropic.Anthropic, Engine]


def _served(engine: Engine) -> Iterator[Served]:
    worker = EngineWorker(engine)
    worker.start()
    try:
        with ThreadServer(make_app(worker)) as srv:
            # no retries: the SDK retries a 529 itself (after `retry-after`)
            with anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0) as client:
                yield srv, client, engine
    finally:
        worker.stop()


@pytest.fixture
def host_tier(_engine: Engine) -> Iterator[Served]:
    """Room on the device for one state, in host RAM for four."""
    one = _engine.state_nbytes
    yield from _served(like(_engine, sessions=3, state_budget_bytes=one,
                             host_budget_bytes=4 * one))  # fmt: skip


def test_an_evicted_session_waits_in_host_ram_and_its_tool_result_continues_it_live(
    host_tier: Served,
) -> None:
    srv, client, _ = host_tier
    ask = [{"role": "user", "content": "list the files"}]
    first = client.messages.create(
        model=MODEL, max_tokens=200, system=SYSTEM, tools=TOOLS, messages=ask,
        extra_body=force("I will look.</think>" + dsml_call("ls -la")),
    )  # fmt: skip
    tool = next(b for b in first.content if b.type == "tool_use")
    side = client.messages.create(  # another agent's request: the first session is evicted
        model=MODEL, max_tokens=4, thinking=NO_THINK,
        messages=[{"role": "user", "content": "A side task: name a colour."}],
    )  # fmt: skip
    assert side.stop_reason in ("max_tokens", "end_turn")
    before = scrape(srv.url)
    back = client.messages.create(
        model=MODEL, max_tokens=4, system=SYSTEM, tools=TOOLS,
        messages=[*ask, {"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                                "content": "a.txt\nb.txt"}]}],
    )  # fmt: skip
    after = scrape(srv.url)
    held = first.usage.input_tokens + first.usage.cache_read_input_tokens
    held += first.usage.output_tokens
    assert back.usage.cache_read_input_tokens == held  # the whole first turn, not re-prefilled
    assert 0 < back.usage.input_tokens < 30  # EOS + the tool-result turn + the opening
    assert after.delta(before, "ds4jax:state_restores_total", tier="host") == 1
    assert after.delta(before, "ds4jax:continuation_total", source="live_tool_ids") == 1


@pytest.fixture
def four_pages(_engine: Engine) -> Iterator[Served]:
    """A paged store of four pages: a 700-token prompt's frontiers and reply fill it."""
    yield from _served(like(_engine, sessions=2, fork_points=True, paged_pages=4))


def test_a_request_no_page_can_be_found_for_is_a_529_and_the_server_goes_on(
    four_pages: Served,
) -> None:
    _, client, engine = four_pages
    body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM * 40, "tools": TOOLS,
            "extra_body": {"temperature": 0.0},  # greedy
            "thinking": NO_THINK,
            "messages": [{"role": "user", "content": "List the files, please."}]}  # fmt: skip
    first = client.messages.create(**body)
    assert first.usage.input_tokens > 256  # a prompt over one page
    with pytest.raises(anthropic.OverloadedError) as refused:  # its retry needs a page copy
        client.messages.create(**body)
    err = refused.value
    assert err.status_code == 529 and err.response.headers["retry-after"] == str(RETRY_AFTER_S)
    assert err.body["error"]["type"] == "overloaded_error"
    # nothing was lost: with room to grow, the retry continues from the prompt end the
    # refusal left (only the reply is computed) and gives the first reply's text
    engine.pages.limit = 8
    again = client.messages.create(**body)
    assert again.usage.cache_read_input_tokens == first.usage.input_tokens
    assert again.content == first.content
