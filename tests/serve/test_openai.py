"""`/v1/responses` and `/v1/chat/completions` driven by the official `openai` SDK, in
process: the tool loop continues live by call id, visible-prefix continuation, the sealed
reasoning round trip, the streaming event sequence, and the 4xx (ds4's messages)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from quart import Quart

from ds4jax.chat.segments import template
from ds4jax.engine import Engine
from serve.app import ServerConfig
from serve.worker import EngineWorker
from tests.serve.conftest import (
    BASE,
    MODEL,
    Gate,
    assert_cold_equivalent,
    force,
    make_app,
    wait_until,
)
from tests.serve.test_errors import json_values

pytestmark = pytest.mark.anyio

FN = {
    "type": "function",
    "name": "bash",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in FN.items() if k != "type"}}]
DSML = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
CALL = "I should list them.</think>" + DSML
DEV = {"type": "message", "role": "developer", "content": "You are Codex, a coding agent."}


def ask(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def unknown_call(cid: str) -> str:
    return (
        f"Responses continuation state is not available for call_id {cid}; "
        "retry by replaying the full input history"
    )


@pytest.fixture
async def oai(app: Quart) -> AsyncIterator[openai.AsyncOpenAI]:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE)
    async with openai.AsyncOpenAI(base_url=BASE + "/v1", api_key="k", http_client=http,
                                  max_retries=0) as c:  # fmt: skip
        yield c


def replay(items: list[Any]) -> list[dict[str, Any]]:
    return [i.model_dump(exclude_none=True) for i in items]


async def codex_turn(oai: openai.AsyncOpenAI, inp: list, text: str, **kw: Any) -> Any:
    """One Codex-shaped turn (store false, the full input, streamed); the final response."""
    async with oai.responses.stream(
        model=MODEL, input=inp, tools=[FN], store=False, reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"], extra_body=force(text), **kw,
    ) as stream:  # fmt: skip
        events = [e.type async for e in stream]
        final = await stream.get_final_response()
    final.events = events
    return final


async def test_responses_stream_tool_loop_continues_live_by_call_id(
    oai: openai.AsyncOpenAI, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    inp: list = [DEV, ask("list the files")]
    first = await codex_turn(oai, inp, CALL)
    kinds = [i.type for i in first.output]
    assert kinds == ["reasoning", "function_call"], first.output
    rs, fc = first.output
    assert rs.id.startswith("rs_") and rs.summary[0].text == "I should list them."
    assert rs.encrypted_content and fc.id.startswith("fc_") and fc.call_id.startswith("call_")
    assert fc.name == "bash" and fc.arguments == '{"command":"ls"}'
    assert first.id.startswith("resp_") and first.status == "completed"
    assert first.events[:2] == ["response.created", "response.in_progress"]
    assert first.events[-1] == "response.completed"
    for kind in ("response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
                 "response.function_call_arguments.delta", "response.function_call_arguments.done",
                 "response.output_item.added", "response.output_item.done"):  # fmt: skip
        assert kind in first.events

    output = {"type": "function_call_output", "call_id": fc.call_id, "output": "a.txt\n"}
    inp += [*replay(first.output), output]
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        second = await codex_turn(oai, inp, "One file.</think>There is one file.")
    reused = first.usage.input_tokens + first.usage.output_tokens
    u = second.usage
    assert u.input_tokens_details.cached_tokens == reused
    assert 0 < u.input_tokens - reused < 30  # EOS + the tool output turn + `<｜Assistant｜><think>`
    assert f"responses live continuation match=tool-output-ids ids=1 cached={reused}" in caplog.text
    assert second.output_text == "There is one file."
    assert [i.type for i in second.output] == ["reasoning", "message"]
    text_events = [e for e in second.events if "output_text" in e or "content_part" in e]
    assert [e for i, e in enumerate(text_events) if e != text_events[i - 1]] == [
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
    ]  # fmt: skip
    assert_cold_equivalent(engine)


async def test_responses_create_visible_prefix_and_sealed_reasoning(
    oai: openai.AsyncOpenAI, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    inp: list = [ask("hello")]
    kw = {"model": MODEL, "tools": [FN], "store": False}
    first = await oai.responses.create(input=inp, extra_body=force("Greet back.</think>Hi!"), **kw)
    rs, msg = first.output
    assert rs.content[0].text == "Greet back." and rs.summary == []  # no summary asked for
    assert first.output_text == "Hi!"
    live = engine.live.tokens
    # Codex-like replay without the reasoning item: continues from the live state, which
    # keeps the reasoning the replay no longer shows
    follow = [*inp, msg.model_dump(exclude_none=True), ask("again")]
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        second = await oai.responses.create(input=follow, extra_body=force("Ok.</think>Hi."), **kw)
    assert second.usage.input_tokens_details.cached_tokens == len(live)
    assert f"responses live continuation match=visible-prefix ids=0 cached={len(live)}" in (
        caplog.text
    )
    # a stateless replay with the sealed item renders the exact sampled reasoning: after a
    # restart (nothing in RAM), its prompt starts with every token the first turn evaluated
    engine.reset()
    exact = [*inp, *replay(first.output), ask("again")]
    raw = await oai.responses.with_raw_response.create(input=exact, max_output_tokens=1,
                                                       extra_body=force("x"), **kw)  # fmt: skip
    assert raw.http_response.status_code == 200
    assert engine.live.tokens[: len(live)] == live
    # a forged seal is ignored with a warning: the item's plain text stands in
    forged = replay(first.output)
    forged[0]["encrypted_content"] = forged[0]["encrypted_content"][:-4] + "AAAA"
    forged[0]["content"] = [{"type": "reasoning_text", "text": "Forged."}]
    engine.reset()
    with caplog.at_level(logging.WARNING, logger="ds4jax.serve"):
        await oai.responses.create(input=[*inp, *forged, ask("again")], max_output_tokens=1,
                                   extra_body=force("x"), **kw)  # fmt: skip
    assert "encrypted_content does not authenticate; ignored" in caplog.text
    assert engine.live.tokens[: len(live)] != live


async def test_responses_errors_have_ds4_messages(
    oai: openai.AsyncOpenAI, engine: Engine, worker: EngineWorker, gate: Gate
) -> None:
    base = {"model": MODEL, "tools": [FN], "store": False}
    for key, value in (("previous_response_id", "resp_1"), ("conversation", "conv_1")):
        with pytest.raises(openai.BadRequestError) as info:
            await oai.responses.create(input=[ask("hi")], **base, extra_body={key: value})
        assert info.value.body["message"] == f"{key} is not supported; replay full input instead"
    orphan = {"type": "function_call_output", "call_id": "call_nope", "output": "x"}
    with pytest.raises(openai.BadRequestError) as info:
        await oai.responses.create(input=[ask("hi"), orphan], **base)
    assert info.value.body["message"] == unknown_call("call_nope")
    with pytest.raises(openai.BadRequestError):
        await oai.responses.create(input=[{"type": "item_reference", "id": "x"}], **base)

    # the stale-live-state race: an output-only request validated against the live call,
    # queued behind a request that moves the live state first → 409
    gate.open()
    first = await oai.responses.create(input=[ask("list")], extra_body=force(CALL), **base)
    cid = first.output[-1].call_id
    gate.close()
    b = asyncio.ensure_future(oai.responses.create(input=[ask("other")], max_output_tokens=2,
                                                   extra_body=force("x"), **base))  # fmt: skip
    await wait_until(lambda: worker.running is not None)
    only = [{"type": "function_call_output", "call_id": cid, "output": "a.txt"}]
    c = asyncio.ensure_future(oai.responses.create(input=only, **base))
    await wait_until(lambda: worker.depth == 2)
    gate.open()
    await b
    with pytest.raises(openai.ConflictError) as conflict:
        await c
    assert conflict.value.body["message"] == (
        "Responses continuation state is not available; retry by replaying the full input history"
    )


async def test_chat_completions_tool_loop_stream_and_usage(
    oai: openai.AsyncOpenAI, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    msgs: list = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ls"}]
    first = await oai.chat.completions.create(model=MODEL, messages=msgs, tools=CHAT_TOOLS,
                                              extra_body=force(CALL))  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and first.id.startswith("chatcmpl-")
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "bash"
    assert call.function.arguments == '{"command":"ls"}'
    assert choice.message.model_extra["reasoning_content"] == "I should list them."
    # an agent that does not replay reasoning_content: the tool path needs only the ids
    msgs += [choice.message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
             {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        stream = await oai.chat.completions.create(
            model=MODEL, messages=msgs, tools=CHAT_TOOLS, stream=True,
            stream_options={"include_usage": True}, extra_body=force("Done.</think>One file."),
        )  # fmt: skip
        chunks = [c async for c in stream]
    reused = first.usage.prompt_tokens + first.usage.completion_tokens
    assert f"chat live continuation match=tool-output-ids ids=1 cached={reused}" in caplog.text
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                      for c in chunks if c.choices)  # fmt: skip
    assert (text, thought) == ("One file.", "Done.")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens_details.cached_tokens == reused
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])
    assert usage.prompt_tokens == reused + (usage.prompt_tokens - reused)  # cached + uncached
    assert_cold_equivalent(engine)

    # a streamed tool call: header chunk, then argument fragments
    stream = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ls"}], tools=CHAT_TOOLS,
        stream=True, extra_body=force(CALL),
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in [c async for c in stream] if c.choices]
    heads = [t for d in deltas for t in d.tool_calls or [] if t.id]
    args = "".join(t.function.arguments or "" for d in deltas for t in d.tool_calls or [])
    assert len(heads) == 1 and heads[0].id.startswith("call_") and args == '{"command":"ls"}'

    # a chat agent's next question after a final answer, reasoning_content not replayed:
    # the visible transcript the turn left matches (ds4's chat thinking-visible path)
    answer = [{"role": "user", "content": "hi"}]
    done = await oai.chat.completions.create(model=MODEL, messages=answer, tools=CHAT_TOOLS,
                                             extra_body=force("Greet.</think>Hello."))  # fmt: skip
    answer += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "and?"}]
    with caplog.at_level(logging.INFO, logger="ds4jax.engine"):
        again = await oai.chat.completions.create(model=MODEL, messages=answer, tools=CHAT_TOOLS,
                                                  max_tokens=1, extra_body=force("x"))  # fmt: skip
    reused = done.usage.prompt_tokens + done.usage.completion_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == reused
    assert f"chat live continuation match=visible-prefix ids=0 cached={reused}" in caplog.text

    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "x"},
            {"role": "tool", "tool_call_id": "call_zz", "content": "y"}])  # fmt: skip
    assert "tool_call_id call_zz" in info.value.body["message"]


async def test_chat_logprobs_whole_and_streamed(oai: openai.AsyncOpenAI, engine: Engine) -> None:
    """`logprobs` + `top_logprobs`: one entry per output token, its bytes the reply's; the
    stream carries the same entries, each on a chunk after its token."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
           "top_logprobs": 3, "extra_body": {"think": False, **force("Hello there.")}}  # fmt: skip
    whole = await oai.chat.completions.create(**ask)
    choice = whole.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == whole.usage.completion_tokens > 0
    assert bytes(b for e in entries for b in e.bytes).decode().startswith("Hello there.")
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= tops[0]
    none = await oai.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
    assert none.choices[0].logprobs is None
    stream = await oai.chat.completions.create(**ask, stream=True)
    streamed = [e for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, entries, strict=True))


async def test_openai_paths_answer_errors_in_the_openai_shape(worker: EngineWorker) -> None:
    app = make_app(worker, ServerConfig(api_key="secret"))
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE)
    async with openai.AsyncOpenAI(base_url=BASE + "/v1", api_key="wrong", http_client=http,
                                  max_retries=0) as c:  # fmt: skip
        with pytest.raises(openai.AuthenticationError) as info:
            await c.responses.create(model=MODEL, input="hi")
        assert info.value.body["message"] == "invalid x-api-key"
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=BASE) as raw:
        resp = await raw.post("/v1/responses", content=b"{", headers={"x-api-key": "secret"})
        assert resp.status_code == 400 and set(resp.json()["error"]) == {
            "message", "type", "param", "code"}  # fmt: skip


# ---------------------------------------------------------------------- fuzz

R_FIELDS = ["input", "instructions", "tools", "tool_choice", "reasoning", "max_output_tokens",
            "temperature", "top_p", "parallel_tool_calls", "prompt_cache_key", "include",
            "previous_response_id", "stream", "model", "text", "metadata"]  # fmt: skip
item_types = ["message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
              "local_shell_call", "web_search_call", "item_reference", None]  # fmt: skip
items = st.fixed_dictionaries(
    {"type": st.sampled_from(item_types)},
    optional={"role": st.sampled_from(["user", "assistant", "developer", "system", "tool"]),
              "content": json_values, "call_id": json_values, "name": json_values,
              "arguments": json_values, "output": json_values, "summary": json_values,
              "encrypted_content": json_values, "namespace": json_values},
)  # fmt: skip
VALID_INPUT = [DEV, ask("hi"),
               {"type": "function_call", "call_id": "call_1", "name": "bash",
                "arguments": '{"command":"ls"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]  # fmt: skip
responses_bodies = st.one_of(
    st.fixed_dictionaries(
        {"model": st.just(MODEL), "max_output_tokens": st.integers(1, 2),
         "input": st.sampled_from(["hi", VALID_INPUT[:2], VALID_INPUT])},
        optional={"stream": st.booleans(), "tools": st.just([FN, {"type": "web_search"}]),
                  "reasoning": st.sampled_from([{"summary": "auto"}, {"effort": "none"}])},
    ).flatmap(lambda base: st.one_of(st.just(base), st.dictionaries(
        st.sampled_from(R_FIELDS), json_values, min_size=1, max_size=1
    ).map(lambda bad: {**base, **bad}))),
    st.fixed_dictionaries({"max_output_tokens": st.just(1)},
                          optional={"input": st.one_of(st.lists(items, max_size=4), json_values),
                                    "tools": json_values, "stream": st.booleans()}),
)  # fmt: skip


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=responses_bodies)
async def test_fuzzed_responses_and_chat_bodies_never_yield_5xx(
    raw: httpx2.AsyncClient, payload: dict[str, Any]
) -> None:  # fmt: skip
    if isinstance(payload.get("max_output_tokens"), int):
        payload["max_output_tokens"] = max(1, min(payload["max_output_tokens"], 2))
    chat = {"messages": payload.get("input"), "max_tokens": 1, "tools": payload.get("tools"),
            "stream": payload.get("stream")}  # fmt: skip
    for path, body in (("/v1/responses", payload), ("/v1/chat/completions", chat)):
        resp = await raw.post(path, content=json.dumps(body))
        event(f"{path} {resp.status_code}")
        assert resp.status_code < 500, resp.text
        if resp.status_code >= 400:
            err = resp.json()["error"]
            assert isinstance(err["message"], str) and err["type"], resp.text
        elif bool(body.get("stream")) and path == "/v1/responses":
            last = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")][-1]
            assert json.loads(last[6:])["type"] in ("response.completed", "response.incomplete")
        elif bool(body.get("stream")):
            assert resp.text.rstrip().endswith("data: [DONE]")
        else:
            assert resp.json()["object"] in ("response", "chat.completion")


async def test_models_in_openais_shape_too(oai: openai.AsyncOpenAI) -> None:
    """`/v1/models` answers both SDKs: OpenAI's `object`, `created` (unix seconds) and
    `owned_by` beside Anthropic's `type`, `display_name` and `created_at`."""
    page = await oai.models.list()
    assert [(m.id, m.object, m.owned_by) for m in page.data] == [(MODEL, "model", "ds4jax")]
    assert isinstance(page.data[0].created, int) and page.data[0].created > 1.7e9
    got = await oai.models.retrieve(MODEL)
    assert got.id == MODEL and got.object == "model" and got.created == page.data[0].created


async def test_a_call_cut_by_max_output_tokens_is_an_incomplete_item(
    oai: openai.AsyncOpenAI, engine: Engine
) -> None:
    """`max_output_tokens` ending inside a call: the response is `incomplete` and so is the
    call's item (its arguments closed so they parse, but not a call to run), streamed or not."""
    command = "echo one two three four five six seven eight nine ten eleven twelve"
    text = "Plan.</think>" + DSML.replace(">ls<", f">{command}<")
    cut = text.index("five")
    limit = len(engine.tokenizer.encode_segments(template(text[:cut])))
    kw = dict(model=MODEL, input=[ask("count")], tools=[FN], max_output_tokens=limit,
              extra_body=force(text))  # fmt: skip
    whole = await oai.responses.create(**kw)
    events = [e async for e in await oai.responses.create(**kw, stream=True)]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete"  # the SDK's stream helper wants `completed`
    for response in (whole, events[-1].response):
        assert response.status == "incomplete", response
        call = response.output[-1]
        assert call.type == "function_call" and call.status == "incomplete", call
        assert json.loads(call.arguments)["command"].startswith("echo one two")
    assert done[-1].type == "function_call" and done[-1].status == "incomplete"
    full = await oai.responses.create(**{**kw, "max_output_tokens": 200})
    assert full.status == "completed" and full.output[-1].status == "completed"


async def test_usage_counts_the_reasoning_tokens(oai: openai.AsyncOpenAI, engine: Engine) -> None:
    """Of the output tokens, those of the reasoning through `</think>`: Responses'
    `output_tokens_details.reasoning_tokens`, Chat's `completion_tokens_details`."""
    text = "Two short words.</think>The answer."
    reasoning = len(engine.tokenizer.encode_segments(template("Two short words.</think>")))
    got = await oai.responses.create(model=MODEL, input=[ask("q")], extra_body=force(text))
    assert got.usage.output_tokens_details.reasoning_tokens == reasoning
    assert got.usage.output_tokens > reasoning
    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], extra_body=force(text)
    )
    assert chat.usage.completion_tokens_details.reasoning_tokens == reasoning
    plain = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}],
        extra_body={"think": False, **force("The answer.")},
    )  # fmt: skip
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


async def test_a_turn_cut_in_its_reasoning_has_the_same_items_streamed_or_not(
    oai: openai.AsyncOpenAI,
) -> None:
    """Cut inside the reasoning: the reasoning item alone, in the created object and in the
    stream's `response.incomplete` alike (the object had an empty message the stream had not)."""
    kw = dict(model=MODEL, input=[ask("q")], max_output_tokens=3,
              extra_body=force("one two three four five six</think>Answer."))  # fmt: skip
    whole = await oai.responses.create(**kw)
    events = [e async for e in await oai.responses.create(**kw, stream=True)]
    assert events[-1].type == "response.incomplete"
    assert (
        [i.type for i in whole.output]
        == ["reasoning"]
        == [i.type for i in events[-1].response.output]
    )
