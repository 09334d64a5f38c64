"""The agent tool loop over HTTP: live continuation by tool id, and its 400 / 409 refusals."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import anthropic
import httpx2
import pytest

from ds4jax.engine import Engine
from serve.app import ServerConfig
from serve.main import trace_hook
from serve.worker import EngineWorker
from tests.serve.conftest import (
    MODEL,
    NO_THINK,
    TOOLS,
    Gate,
    assert_anthropic_error,
    assert_cold_equivalent,
    force,
    make_app,
    sse_events,
    tool_call_text,
    user,
    wait_until,
)

pytestmark = pytest.mark.anyio

SYSTEM = "You are a careful coding agent."
LIVE_GONE = (
    "Anthropic continuation state is not available; retry by replaying the full messages history"
)


def unknown_id(tid: str) -> str:
    return (
        f"Anthropic continuation state is not available for tool_use_id {tid}; "
        "retry by replaying the full messages history"
    )


async def tool_turn(client: anthropic.AsyncAnthropic, command: str = "ls -la") -> Any:
    """Request 1 of a tool loop, streamed as Claude Code does; returns the final message."""
    async with client.messages.stream(
        model=MODEL,
        max_tokens=200,
        system=SYSTEM,
        tools=TOOLS,
        messages=user("list the files"),
        extra_body=force(tool_call_text(command)),
    ) as stream:
        msg = await stream.get_final_message()
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    return msg


def result_turn(tid: str, content: str = "a.txt\nb.txt") -> dict[str, Any]:
    block = {"type": "tool_result", "tool_use_id": tid, "content": content, "is_error": False}
    return {"role": "user", "content": [block]}


async def test_tool_loop_continues_the_live_state_by_tool_id(
    client: anthropic.AsyncAnthropic, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    first = await tool_turn(client)
    tid = first.content[-1].id
    assert tid.startswith("toolu_")
    # the client replays the turn exactly as it got it (thinking with signature, tool_use)
    replay = [b.model_dump(exclude_none=True) for b in first.content]
    history = [
        *user("list the files"),
        {"role": "assistant", "content": replay},
        result_turn(tid),
    ]
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        async with client.messages.stream(
            model=MODEL,
            max_tokens=16,
            system=SYSTEM,
            tools=TOOLS,
            messages=history,
            extra_body=force("Two files.</think>There are two files."),
        ) as stream:
            second = await stream.get_final_message()
    u1, u2 = first.usage, second.usage
    reused = u1.input_tokens + u1.cache_read_input_tokens + u1.output_tokens
    assert u2.cache_read_input_tokens == reused
    assert 0 < u2.input_tokens < 30  # only EOS + the tool-result turn + the assistant opening
    assert f"anthropic live continuation match=tool-output-ids ids=1 cached={reused}" in (
        caplog.text
    )
    assert second.content[-1].text == "There are two files."
    count = await client.messages.count_tokens(
        model=MODEL, system=SYSTEM, tools=TOOLS, messages=history
    )
    assert u2.input_tokens + u2.cache_read_input_tokens == count.input_tokens
    assert_cold_equivalent(engine)


TWO_CALLS = (
    "both</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">pwd</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)


async def test_parallel_tool_calls_stream_as_blocks_and_continue_live(
    client: anthropic.AsyncAnthropic, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    inputs: dict[int, list[str]] = {}
    async with client.messages.stream(
        model=MODEL,
        max_tokens=300,
        system=SYSTEM,
        tools=TOOLS,
        messages=user("look"),
        extra_body=force(TWO_CALLS),
    ) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                inputs.setdefault(event.index, []).append(event.delta.partial_json)
        first = await stream.get_final_message()
    assert [b.type for b in first.content] == ["thinking", "tool_use", "tool_use"]
    calls = first.content[1:]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("toolu_") for c in calls)
    assert [json.loads("".join(inputs[i])) for i in (1, 2)] == [c.input for c in calls]
    assert [c.input for c in calls] == [{"command": "ls"}, {"command": "pwd"}]
    # both results, in the other order: still the live tool binding
    results = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": calls[1].id, "content": "/work"},
            {"type": "tool_result", "tool_use_id": calls[0].id, "content": "a.txt"},
        ],
    }
    history = [
        *user("look"),
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        results,
    ]
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        second = await client.messages.create(
            model=MODEL,
            max_tokens=4,
            system=SYSTEM,
            tools=TOOLS,
            messages=history,
            extra_body=force("ok</think>done"),
        )
    assert "anthropic live continuation match=tool-output-ids ids=2" in caplog.text
    assert second.usage.cache_read_input_tokens == (
        first.usage.input_tokens + first.usage.output_tokens
    )
    assert_cold_equivalent(engine)


def results_only(tid: str) -> list[dict[str, Any]]:
    """A tool-result-only request: the history lives only in the server's live state."""
    return [result_turn(tid)]


def without_tool_use(tid: str) -> list[dict[str, Any]]:
    """A history whose assistant turn lost its tool_use block (client-side compaction): the
    id is backed only by the live state."""
    return [*user("list the files"), {"role": "assistant", "content": "ok"}, result_turn(tid)]


async def test_tool_result_only_request_continues_while_the_id_is_live(
    client: anthropic.AsyncAnthropic,
) -> None:
    first = await tool_turn(client)
    msg = await client.messages.create(
        model=MODEL,
        max_tokens=8,
        system=SYSTEM,
        tools=TOOLS,
        messages=results_only(first.content[-1].id),
        extra_body=force("done</think>ok"),
    )
    assert msg.usage.cache_read_input_tokens == first.usage.input_tokens + first.usage.output_tokens


async def test_tool_result_backed_only_by_the_live_state_continues_while_live(
    client: anthropic.AsyncAnthropic, engine: Engine
) -> None:
    first = await tool_turn(client)
    msg = await client.messages.create(
        model=MODEL,
        max_tokens=8,
        system=SYSTEM,
        tools=TOOLS,
        messages=without_tool_use(first.content[-1].id),
        extra_body=force("done</think>ok"),
    )
    assert msg.usage.cache_read_input_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert_cold_equivalent(engine)


async def test_unknown_tool_result_id_is_a_400_with_the_replay_hint(
    client: anthropic.AsyncAnthropic, engine: Engine
) -> None:
    await tool_turn(client)
    before = (engine.live, engine.bindings.tool)
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(
            model=MODEL,
            max_tokens=8,
            system=SYSTEM,
            tools=TOOLS,
            messages=[result_turn("toolu_nope")],
        )
    assert info.value.status_code == 400
    message = assert_anthropic_error(info.value.response, 400, "invalid_request_error")
    assert message == unknown_id("toolu_nope")
    assert (engine.live, engine.bindings.tool) == before  # nothing changed


async def test_stale_tool_result_id_after_another_request_is_a_400(
    client: anthropic.AsyncAnthropic,
) -> None:
    """Sequentially, once an unrelated request moved the live state, A's id is simply
    unknown: the parse-time 400 (the 409 is the race below)."""
    tid = (await tool_turn(client)).content[-1].id
    await client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=user("unrelated"),
        thinking=NO_THINK,
        extra_body=force("ok"),
    )
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(
            model=MODEL, max_tokens=8, system=SYSTEM, tools=TOOLS, messages=results_only(tid)
        )
    assert assert_anthropic_error(info.value.response, 400) == unknown_id(tid)


async def live_id_then_held_unrelated(
    client: anthropic.AsyncAnthropic, worker: EngineWorker, gate: Gate
) -> tuple[str, asyncio.Future]:
    """A tool turn's live id, then an unrelated request B taken by the worker and held at
    the gate (it will move the live state once the gate opens)."""
    gate.open()
    tid = (await tool_turn(client)).content[-1].id
    gate.close()
    b = asyncio.ensure_future(
        client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=user("unrelated"),
            thinking=NO_THINK,
            extra_body=force("ok"),
        )
    )
    await wait_until(lambda: worker.running is not None)
    return tid, b


@pytest.mark.parametrize(
    ("shape", "stream"),
    [(results_only, False), (results_only, True), (without_tool_use, False)],
    ids=["results-only", "results-only-stream", "without-tool-use"],
)
async def test_live_only_tool_result_gets_409_when_the_live_state_moved_first(
    client: anthropic.AsyncAnthropic,
    engine: Engine,
    worker: EngineWorker,
    gate: Gate,
    shape: Any,
    stream: bool,
) -> None:
    # B (unrelated) is taken by the worker and held at the gate ...
    tid, b = await live_id_then_held_unrelated(client, worker, gate)
    # ... so C validates against A's live id (accepted, queued behind B) ...
    c = asyncio.ensure_future(
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            system=SYSTEM,
            tools=TOOLS,
            messages=shape(tid),
            stream=stream,
        )
    )
    await wait_until(lambda: worker.depth == 2)
    before_b = engine.live
    gate.open()  # ... and runs after B moved the live state: 409, nothing changes
    assert (await b).stop_reason == "end_turn"
    with pytest.raises(anthropic.ConflictError) as info:
        await c
    assert info.value.status_code == 409
    assert assert_anthropic_error(info.value.response, 409) == LIVE_GONE
    assert engine.live is not before_b and engine.bindings.tool is None


async def test_409_after_the_stream_started_is_an_error_event(
    app: Any,
    client: anthropic.AsyncAnthropic,
    raw: httpx2.AsyncClient,
    engine: Engine,
    worker: EngineWorker,
    gate: Gate,
) -> None:
    """A stream queued past the server's 1 s grace period is already open when its 409
    comes: it ends with an `error` event, with no message_stop."""
    tid, b = await live_id_then_held_unrelated(client, worker, gate)
    payload = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": results_only(tid),
    }
    c = asyncio.ensure_future(raw.post("/v1/messages", json=payload))
    await wait_until(lambda: worker.depth == 2)
    await asyncio.sleep(1.3)
    gate.open()
    await b
    resp = await c
    assert resp.status_code == 200  # the stream had started
    events = sse_events(resp.text)
    # a queued stream opens with message_start; the 409 then arrives as an error event
    assert [e for e, _ in events if e != "ping"] == ["message_start", "error"]
    assert events[-1][1]["error"] == {"type": "invalid_request_error", "message": LIVE_GONE}
    # /metrics: the refusal inside the stream counts once, as the 409 it would have been
    counted = app.metrics.registry.get_sample_value(
        "ds4jax:rejected_requests_total", {"model_name": MODEL, "status": "409"}
    )
    assert counted == 1


async def test_requests_run_in_arrival_order(
    client: anthropic.AsyncAnthropic, worker: EngineWorker, gate: Gate
) -> None:
    tasks = []
    for i in range(4):
        tasks.append(
            asyncio.ensure_future(
                client.messages.create(
                    model=MODEL,
                    max_tokens=8,
                    messages=user(f"request {i}"),
                    thinking=NO_THINK,
                    extra_body=force(f"answer {i}"),
                )
            )
        )
        await wait_until(lambda n=i + 1: worker.depth == n)
    gate.open()
    answers = [(await t).content[0].text for t in tasks]
    assert answers == [f"answer {i}" for i in range(4)]
    assert gate.runs == [f"request {i}" for i in range(4)]


async def queued_stream(worker: EngineWorker, gate: Gate) -> list[str]:
    """A stream held in the queue for 1.5 s (pings every 50 ms): its event kinds."""
    app = make_app(worker, ServerConfig(ping_interval=0.05))
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "stream": True,
        "thinking": NO_THINK,
        "messages": user("hi"),
        **force("ok"),
    }
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://t"
    ) as c:
        post = asyncio.ensure_future(c.post("/v1/messages", json=body))
        await asyncio.sleep(1.5)
        gate.open()
        resp = await post
    assert resp.status_code == 200
    events = sse_events(resp.text)
    text = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    assert text == "ok"
    return [e for e, _ in events]


async def test_queued_stream_gets_pings_while_it_waits(
    engine: Engine, gate: Gate, worker: EngineWorker
) -> None:
    kinds = await queued_stream(worker, gate)
    assert kinds.count("ping") >= 3
    assert kinds[-2:] == ["message_delta", "message_stop"]


async def test_queued_stream_starts_with_message_start(
    engine: Engine, gate: Gate, worker: EngineWorker
) -> None:
    kinds = await queued_stream(worker, gate)
    assert kinds[0] == "message_start"


async def test_the_trace_records_what_was_evaluated_when_the_client_drops_thinking(
    client: anthropic.AsyncAnthropic, worker: EngineWorker, engine: Engine, tmp_path: Any
) -> None:
    """A client that sends the tool-use turn back without its thinking block still
    continues the live state, reasoning and all: the trace's `prompt` is that state's text
    (it was the client's render, 7 tokens short of the usage, the reasoning missing), the
    client's render kept beside it as `client_prompt`."""
    path = tmp_path / "trace.jsonl"
    worker.hooks.append(trace := trace_hook(str(path), engine.tokenizer))
    try:
        first = await tool_turn(client)
        tid = first.content[-1].id
        dropped = [b.model_dump(exclude_none=True) for b in first.content if b.type != "thinking"]
        history = [*user("list the files"), {"role": "assistant", "content": dropped},
                   result_turn(tid)]  # fmt: skip
        second = await client.messages.create(
            model=MODEL, max_tokens=16, system=SYSTEM, tools=TOOLS, messages=history,
            extra_body=force("Two files.</think>There are two files."),
        )  # fmt: skip
    finally:
        worker.hooks.remove(trace)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    rec = recs[-1]
    u = second.usage
    assert rec["source"] == "live_tool_ids"
    assert rec["prompt_tokens"] == u.input_tokens + u.cache_read_input_tokens
    assert rec["prompt_tokens"] == rec["cached"] + rec["prefilled"]
    assert "I should run it." in rec["prompt"]  # the sampled reasoning, as evaluated
    assert "I should run it." not in rec["client_prompt"]
    assert rec["client_prompt_tokens"] < rec["prompt_tokens"]
    assert "client_prompt" not in recs[0]  # a cold request: what it sent is what ran
    assert recs[0]["prompt_tokens"] == first.usage.input_tokens


async def test_another_clients_request_with_the_live_ids_never_takes_the_live_state(
    _engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Client B sends agent A's live tool_use id in its own conversation — replaying a call
    of its own under that id, or the tool_result alone after its own question. The ids
    alone routed B into A's session: B was answered from A's conversation, with A's prompt
    length in its usage, and A's next turn was no longer live (or a 409). Now B is served
    from its own history (or refused), A's state untouched, A's next turn live."""
    from tests.continuation.conftest import like
    from tests.serve.conftest import sdk_client

    engine = like(_engine, sessions=3, fork_points=True)
    worker = EngineWorker(engine, max_queue=4)
    worker.start()
    try:
        async with sdk_client(make_app(worker)) as client:
            first = await tool_turn(client)
            tid = first.content[-1].id
            u1 = first.usage
            reused = u1.input_tokens + u1.cache_read_input_tokens + u1.output_tokens
            own = [{"type": "tool_use", "id": tid, "name": "where", "input": {"dir": "pwd"}}]
            with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
                b = await client.messages.create(
                    model=MODEL, max_tokens=8, system=SYSTEM, tools=TOOLS,
                    messages=[*user("where am I?"), {"role": "assistant", "content": own},
                              result_turn(tid, "/home/b")],
                    extra_body=force("b</think>You are in /home/b."),
                )  # fmt: skip
            assert "match=tool-output-ids" not in caplog.text
            assert b.usage.cache_read_input_tokens < reused  # not A's state
            b_live = next(x.live for x in engine.pool.sessions
                          if x.live is not None and "/home/b" in "".join(
                              g.text for g in x.live.segments))  # fmt: skip
            text = "".join(g.text for g in b_live.segments)
            assert "pwd" in text and "ls -la" not in text  # its own call, not A's bytes
            with pytest.raises(anthropic.APIStatusError) as info:  # the result alone
                await client.messages.create(
                    model=MODEL, max_tokens=8, system=SYSTEM, tools=TOOLS,
                    messages=[*user("where am I?"), result_turn(tid, "/home/b")],
                    extra_body=force("b</think>ok"),
                )  # fmt: skip
            assert info.value.status_code in (400, 409)
            history = [*user("list the files"),
                       {"role": "assistant", "content": [x.model_dump(exclude_none=True)
                                                         for x in first.content]},
                       result_turn(tid)]  # fmt: skip
            a = await client.messages.create(
                model=MODEL, max_tokens=8, system=SYSTEM, tools=TOOLS, messages=history,
                extra_body=force("a</think>Two files."),
            )  # fmt: skip
            assert a.usage.cache_read_input_tokens == reused  # A's own turn: still live
    finally:
        worker.stop()
