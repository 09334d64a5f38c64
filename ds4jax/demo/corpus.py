"""The demo model's synthetic tool-use corpus: Anthropic request bodies, rendered exactly as
the server renders them.

Why bodies and not strings: every training sequence goes through
`parse_messages_request` → `render` → the tokenizer, the path a `/v1/messages` request
takes, so what the model learns is byte for byte what it is served (the tools block, the
thinking / non-thinking openers, DSML calls, tool results after EOS). Each example is one
round of the agent loop: a user asks, the assistant calls one tool with arguments taken from
the user turn, the client returns a result, the assistant answers from it. A few examples
are plain chat with no call.

Everything is drawn from `random.Random(seed)`, so the corpus (and the held-out prompts,
drawn from another seed and checked disjoint from training) is reproducible.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "name": "add",
        "description": "Add two integers and return their sum.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
    {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
]

CITIES = (
    "Paris", "London", "Tokyo", "New York", "Berlin", "Madrid", "Rome", "Sydney",
    "Cairo", "Moscow", "Toronto", "Chicago", "Mumbai", "Beijing", "Seoul", "Lisbon",
    "Dublin", "Oslo", "Vienna", "Prague", "Athens", "Lima", "Nairobi", "Bangkok",
)  # fmt: skip
CONDITIONS = ("Sunny", "Cloudy", "Rainy", "Snowy", "Windy", "Foggy", "Clear", "Stormy")

ADD_PROMPTS = (
    "What is {a} plus {b}?",
    "Add {a} and {b}.",
    "Please compute {a} + {b}.",
    "What's the sum of {a} and {b}?",
    "Can you add {a} to {b}?",
    "{a} + {b} = ?",
    "I need the total of {a} and {b}.",
    "How much is {a} plus {b}?",
)
WEATHER_PROMPTS = (
    "What's the weather in {city}?",
    "How is the weather in {city} today?",
    "Is it raining in {city}?",
    "Tell me the weather for {city}.",
    "weather {city}",
    "What's it like outside in {city} right now?",
    "Check the weather in {city}, please.",
    "Do I need an umbrella in {city}?",
)
CHAT = (
    ("Hello!", "Hello! I can add two numbers or look up the weather in a city."),
    ("Hi", "Hi! Ask me to add two numbers or to check the weather in a city."),
    ("What can you do?", "I can add two integers and look up the current weather in a city."),
    ("Who are you?", "I am a tiny demo model. I can add numbers and check the weather."),
    ("Thanks!", "You're welcome!"),
)
SYSTEMS = (
    None,
    None,
    "You are a helpful assistant.",
    "You are a concise assistant. Use the tools when they help.",
)


def weather_report(city: str) -> str:
    """The demo `get_weather` implementation clients use: deterministic per city, so a
    README loop and the tests agree on what the tool returns."""
    h = int.from_bytes(hashlib.sha256(city.encode()).digest()[:4], "big")
    return f"{CONDITIONS[h % len(CONDITIONS)]}, {h // 8 % 36 - 5}°C"


def run_tool(name: str, args: dict[str, Any]) -> str:
    """Execute a demo tool call as a client would (the value of its tool_result)."""
    if name == "add":
        return str(int(args["a"]) + int(args["b"]))
    if name == "get_weather":
        return weather_report(str(args["city"]))
    raise ValueError(f"unknown demo tool {name!r}")


@dataclass(frozen=True)
class Task:
    """One user request of the demo: the prompt and the call the model should make
    (None for plain chat, which has a fixed `reply`)."""

    prompt: str
    tool: str | None
    args: dict[str, Any]
    reply: str = ""


def held_out_pair(template: str, city: str) -> bool:
    """A fifth of the (weather prompt, city) pairs never occur in training: the held-out
    weather prompts are drawn from them, so they are new sentences, not memorised ones."""
    return hashlib.sha256(f"{template}|{city}".encode()).digest()[0] % 5 == 0


def draw_task(rng: random.Random, *, held_out: bool = False) -> Task:
    r = rng.random()
    if r < 0.08:
        prompt, reply = rng.choice(CHAT)
        return Task(prompt, None, {}, reply)
    if r < 0.54:
        # 1 to 4 digits each, so sums of every length occur (not only 3-4 digit ones)
        a, b = (rng.randrange(10 ** rng.randint(1, 4)) for _ in range(2))
        return Task(rng.choice(ADD_PROMPTS).format(a=a, b=b), "add", {"a": a, "b": b})
    while True:
        city, template = rng.choice(CITIES), rng.choice(WEATHER_PROMPTS)
        if held_out_pair(template, city) == held_out:
            return Task(template.format(city=city), "get_weather", {"city": city})


def _reasoning(task: Task) -> str:
    if task.tool == "add":
        return f"The user wants the sum of {task.args['a']} and {task.args['b']}. I will call add."
    return f"The user asks about the weather in {task.args['city']}. I will call get_weather."


def _answer(task: Task, result: str) -> str:
    if task.tool == "add":
        return f"{task.args['a']} plus {task.args['b']} is {result}."
    return f"The weather in {task.args['city']}: {result}."


def request_body(task: Task, *, thinking: bool, system: str | None) -> dict[str, Any]:
    """The first request of the loop, as a client sends it."""
    body: dict[str, Any] = {
        "model": "deepseek-v4-flash",
        "max_tokens": 256,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": task.prompt}],
    }
    if not thinking:
        body["thinking"] = {"type": "disabled"}
    if system is not None:
        body["system"] = system
    return body


def conversation_turns(task: Task, *, thinking: bool, tool_id: str) -> list[dict[str, Any]]:
    """The assistant and user messages that follow the first user turn, in Anthropic form:
    (assistant call, tool result, assistant answer), or the one chat reply."""

    def turn(block: dict[str, Any], thought: str) -> dict[str, Any]:
        blocks = [block]
        if thinking:
            blocks.insert(0, {"type": "thinking", "thinking": thought, "signature": ""})
        return {"role": "assistant", "content": blocks}

    if task.tool is None:
        text = {"type": "text", "text": task.reply}
        return [turn(text, "The user is chatting; no tool is needed.")]
    result = run_tool(task.tool, task.args)
    call = {"type": "tool_use", "id": tool_id, "name": task.tool, "input": task.args}
    answer = {"type": "text", "text": _answer(task, result)}
    back = {"type": "tool_result", "tool_use_id": tool_id, "content": result}
    return [
        turn(call, _reasoning(task)),
        {"role": "user", "content": [back]},
        turn(answer, f"The tool returned {result}."),
    ]


def training_bodies(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` whole conversations (request bodies whose messages end with the final answer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = draw_task(rng)
        thinking = rng.random() < 0.5
        body = request_body(task, thinking=thinking, system=rng.choice(SYSTEMS))
        tool_id = f"toolu_{rng.getrandbits(128):032x}"
        body["messages"] += conversation_turns(task, thinking=thinking, tool_id=tool_id)
        out.append(body)
    return out


def held_out_tasks(n: int, seed: int, exclude: set[str]) -> list[Task]:
    """`n` tool-call tasks, half of each tool, whose prompt text never occurs in `exclude`
    (the training prompts); weather prompts come from the held-out pairs."""
    rng = random.Random(seed)
    out: list[Task] = []
    seen = set(exclude)
    while len(out) < n:
        task = draw_task(rng, held_out=True)
        want = "add" if len(out) % 2 == 0 else "get_weather"
        if task.tool != want or task.prompt in seen:
            continue
        seen.add(task.prompt)
        out.append(task)
    return out
