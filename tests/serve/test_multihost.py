"""`ds4jax serve` as a group of two processes × 4 CPU devices on this machine (issue 16):
JAX's own multi-controller runtime, the leader serving HTTP and the follower replaying each
engine operation; sessions' pages split along a data axis whose shards lie in both
processes (issue 28). The demo's tool loop comes out token for token as from one process on one
device, continues live, and a dead follower ends the group: health fails, the leader exits
non-zero within a bounded time, saying which process stopped."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import jax
import pytest

from ds4jax.demo.corpus import TOOLS, run_tool
from tests.serve.conftest import GROUP_MESH, ServeGroup, ServeProcess, serving
from tests.serve.metrics_scrape import scrape

LIVE_LINE = "anthropic live continuation match=tool-output-ids ids=1"


@pytest.fixture(scope="module")
def served_group() -> Iterator[ServeGroup]:
    yield from serving("served_group")


def tool_loop(url: str, question: str) -> list[dict[str, Any]]:
    """One greedy tool loop (call turn, tool-result turn): each turn's content and usage."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kw = {
        "model": "deepseek-v4-flash",
        "max_tokens": 200,
        "tools": TOOLS,
        "extra_body": {"temperature": 0.0},
    }
    messages: list = [{"role": "user", "content": question}]
    first = client.messages.create(messages=messages, **kw)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1, first.content
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                      "content": run_tool(calls[0].name, calls[0].input)}]},
    ]  # fmt: skip
    second = client.messages.create(messages=messages, **kw)
    turns = []
    for reply in (first, second):
        blocks = [b.model_dump(exclude={"id"}, exclude_none=True) for b in reply.content]
        usage = reply.usage
        # (prompt, output): which part of the prompt was cached depends on what the server
        # saw before (the one-device server is shared with other tests)
        prompt = usage.input_tokens + usage.cache_read_input_tokens
        counts = (prompt, usage.output_tokens, usage.cache_read_input_tokens)
        turns.append({"content": blocks, "stop": reply.stop_reason, "usage": counts})
    return turns


def test_the_group_serves_the_tool_loop_as_one_device_does(
    served_group: ServeGroup, demo_served: ServeProcess
) -> None:
    leader = served_group.leader
    assert "process 0 of 2; mesh {'data': 4, 'expert': 2, 'tensor': 1}" in leader.stderr
    assert "split over data=4" in leader.stderr
    assert "following process 0" in served_group.followers[0].stderr
    question = "What is 123 plus 456?"  # (get_weather: the disk test's question)
    got = tool_loop(leader.url, question)
    want = tool_loop(demo_served.url, question)
    assert [{**t, "usage": t["usage"][:2]} for t in got] == [
        {**t, "usage": t["usage"][:2]} for t in want
    ]
    call, answer = got
    assert call["stop"] == "tool_use" and answer["stop"] == "end_turn"
    # the tool-result turn continued the live state: the call turn's whole input + output
    assert answer["usage"][2] == call["usage"][0] + call["usage"][1]
    assert leader.stderr.count(LIVE_LINE) == 1
    # the one conversation's pages lie on one data shard's devices (two are process 1's)
    m = scrape(leader.url)
    shards = {ls for n, ls in m.samples if n == "ds4jax:page_shard_bytes"}
    assert {dict(ls)["shard"] for ls in shards} == {"0", "1", "2", "3"}
    held = [m.get("ds4jax:page_shard_bytes", shard=str(k)) for k in range(4)]
    assert sum(b > 0 for b in held) == 1, held


#: a system prompt long enough (with the tools) for the store's cold checkpoint (>= 512)
SYSTEM = "You are the demo calculator and weather assistant of this project. " * 20


def ask(url: str, question: str) -> Any:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    return client.messages.create(
        model="deepseek-v4-flash", max_tokens=40, tools=TOOLS, system=SYSTEM,
        messages=[{"role": "user", "content": question}], extra_body={"temperature": 0.0},
    )  # fmt: skip


def wait_for(server: ServeProcess, line: str, count: int = 1, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while server.stderr.count(line) < count:
        assert time.monotonic() < deadline, f"no {line!r} in:\n{server.stderr[-3000:]}"
        time.sleep(0.1)


def test_disk_checkpoints_of_the_group_serve_it_and_one_process(
    served_group: ServeGroup, demo_served: ServeProcess
) -> None:
    """Process 0 alone writes and reads the disk; a hit's state reaches the follower by
    broadcast; and what the group wrote restores in one process on one device."""
    leader = served_group.leader
    before = scrape(leader.url)
    ask(leader.url, "What is 17 plus 25?")  # cold: the system + tools are saved
    wait_for(leader, "kv cache stored tokens=")
    got = ask(leader.url, "What's the weather in Lima?")  # continues from the disk
    wait_for(leader, "cache source=disk-text cached=")
    # process 0 serves the group's figures: its disk store's saves and loads among them
    after = scrape(leader.url)
    d = lambda name, **kw: after.delta(before, "ds4jax:" + name, **kw)  # noqa: E731
    assert d("disk_checkpoint_saves_total") >= 1 and d("disk_checkpoint_restores_total") == 1
    assert d("continuation_total", source="disk") == 1 and d("continuation_total") == 2
    assert after.get("ds4jax:disk_checkpoint_bytes") > 0
    assert after.get("ds4jax:model_config_info", processes="2", mesh=GROUP_MESH + ",tensor=1") == 1
    want = ask(demo_served.url, "What's the weather in Lima?")  # one device, cold
    strip = lambda m: [b.model_dump(exclude={"id"}, exclude_none=True) for b in m.content]  # noqa: E731
    assert strip(got) == strip(want)
    assert got.usage.cache_read_input_tokens > 512

    from ds4jax.chat.anthropic import parse_messages_request
    from ds4jax.chat.render import render
    from ds4jax.chat.tokenizer import load_tokenizer
    from ds4jax.engine import Engine
    from ds4jax.kvstore.disk import DiskStore
    from ds4jax.weights.checkpoint import load_model
    from serve.main import default_state_dtype

    cfg, params, tok, _ = load_model("demo", load_tokenizer=load_tokenizer)
    cfg = cfg.replace(state_dtype=default_state_dtype())  # as the group serves it
    # a copy: the group's leader holds its directory (one server per --kv-disk-dir)
    import shutil
    import tempfile

    copy = shutil.copytree(served_group.kv_dir, tempfile.mkdtemp() + "/kv")
    store = DiskStore.for_model(copy, cfg, params, tok, max_len=2048)
    body = {"system": SYSTEM, "tools": TOOLS,
            "messages": [{"role": "user", "content": "What's the weather in Lima?"}]}  # fmt: skip
    hit = store.lookup(tuple(render(parse_messages_request(body).conversation)))
    assert hit is not None and len(hit.tokens) == got.usage.cache_read_input_tokens
    restored = hit.load()  # the group's checkpoint, same model fingerprint, one device
    cold = Engine(cfg, params, tok, max_len=2048, chunk_sizes=(256,)).logits_for(hit.tokens)
    got_logits = jax.device_get(restored.logits)
    # f32 states agree to rounding; rounded rows (bf16, fp8) also agree up to the odd
    # rounding flip between the group's chunking and this one (tests/model/test_state_dtype)
    tol = 1e-5 if cfg.state_dtype == "f32" else 1e-2
    assert abs(cold - got_logits).max() <= tol and cold.argmax() == got_logits.argmax()


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0  # refused: the server is gone


def test_a_dead_follower_ends_the_group(served_group: ServeGroup) -> None:
    leader, follower = served_group.leader, served_group.followers[0]
    assert health(leader.url) == 200
    follower.proc.kill()
    codes = []
    deadline = time.monotonic() + 60  # the heartbeat timeout (15 s here), then the watchdog
    while leader.proc.poll() is None and time.monotonic() < deadline:
        codes.append(health(leader.url))
        time.sleep(0.5)
    assert leader.proc.poll() not in (None, 0), "the leader did not exit non-zero in 60 s"
    assert 503 in codes or 0 in codes, codes
    assert "process 1 of the group stopped" in leader.stderr


def test_a_group_started_with_different_flags_refuses_to_serve() -> None:
    """A follower replays the leader's operations against its own settings: one started
    with other --sessions served until the first request the two routed differently, then
    both processes aborted in a collective (another --ctx: hung for good, health still
    "ready"). Now each process compares the group's flags before the weights load, and
    every process exits non-zero naming the difference."""
    from tests.serve.conftest import free_port

    group = ("--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
             "--mesh", "data=2")  # fmt: skip
    env = {"JAX_NUM_CPU_DEVICES": "1", "DS4JAX_HEARTBEAT_TIMEOUT_S": "15"}
    follower = ServeProcess(*group, "--process-id", "1", "--sessions", "1", model=(), env=env)
    leader = ServeProcess(*group, "--process-id", "0", "--sessions", "2", model=(), env=env)
    try:
        for p in (leader, follower):
            p.proc.wait(180)
    finally:
        codes = [leader.stop(), follower.stop()]
    assert leader.drained.wait(10) and follower.drained.wait(10)
    assert all(c not in (None, 0) for c in codes), (codes, leader.stderr, follower.stderr)
    assert "--sessions: 2 here, 1 on process 1" in leader.stderr, leader.stderr
    assert "--sessions: 1 here, 2 on process 0" in follower.stderr, follower.stderr
    assert not leader.ready.is_set() and "ds4jax: model" not in leader.stderr


def test_a_process_whose_group_never_gathers_says_so_and_exits() -> None:
    """Process 0 with no process 1: it said nothing for 5 minutes, then the runtime
    aborted it from C++ (status 134, a stack dump, "another task died"). Now it says what
    it waits for, and after `DS4JAX_JOIN_TIMEOUT_S` exits 2 in one line."""
    from tests.serve.conftest import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    env = {"JAX_NUM_CPU_DEVICES": "1", "DS4JAX_JOIN_TIMEOUT_S": "3"}
    alone = ServeProcess("--coordinator", coordinator, "--num-processes", "2", "--process-id",
                         "0", model=(), env=env)  # fmt: skip
    try:
        code = alone.proc.wait(120)
    finally:
        alone.stop()
    assert alone.drained.wait(10)
    assert code == 2, alone.stderr
    assert f"joining the group at {coordinator} as process 0 of 2" in alone.stderr
    assert f"not every process of the group joined {coordinator} within 3 s" in alone.stderr
