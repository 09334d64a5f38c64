"""The demo model's synthetic tool-use corpus: Anthropic request bodies, rendered exactly as
the server renders them.

Why bodies and not strings: every training sequence goes through
`parse_messages_request` → `render` → the tokenizer, the path a `/v1/messages` request
takes, so what the model learns is byte for byte what it is served (the tools block, the
thinking / non-thinking openers, DSML calls, tool results after EOS).

A conversation is one or two rounds of the agent loop. A round is a user message and
either the assistant's calls (one, or two or three in one turn, each answered by its own
`tool_result`), then its answer from the results — or a reply without a call: chat, an
answer from the history, or a refusal that says what the demo can do.

Phrasings are composed from parts (issue 18): an opener, a core sentence, a closer and
punctuation, with casing changes and the occasional typo; numbers of one to five digits,
sometimes with thousands separators. A *template* is the composed sentence before its
numbers and cities are filled in; a fifth of all templates (by hash) never occur in
training, and the held-out prompts are drawn from those only — so what is measured is
new sentences built from known parts, not known sentences with new operands. Arguments
are the operands in the order the sentence mentions them.

Everything is drawn from `random.Random(seed)`, so the corpus and the held-out prompts are
reproducible.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
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
    "Boston", "Denver", "Miami", "Seattle", "Vancouver", "Montreal", "Mexico City", "Bogota",
    "Santiago", "Buenos Aires", "Lagos", "Accra", "Istanbul", "Dubai", "Delhi", "Jakarta",
    "Manila", "Hanoi", "Osaka", "Helsinki", "Warsaw", "Zurich", "Amsterdam", "Brussels",
)  # fmt: skip
CONDITIONS = ("Sunny", "Cloudy", "Rainy", "Snowy", "Windy", "Foggy", "Clear", "Stormy")

#: what the demo says it can do, in every refusal and in chat
CAN_DO = "I can add two integers or look up the current weather in a city."
REFUSAL = f"Sorry, I can't help with that. {CAN_DO}"

OPENERS = ("", "", "Hey, ", "Hi! ", "Hello, ", "Quick question: ", "OK, ", "So, ", "Um, ",
           "Hey there. ", "Question: ", "Right, ")  # fmt: skip
CLOSERS = ("", "", "", " for me", " please", ", thanks", " right now", " quickly")
PUNCTUATION = ("?", "?", ".", "!", "", " ?")

ADD_CORES = (
    "what is {x} plus {y}", "what's {x} + {y}", "add {x} and {y}", "add {x} to {y}",
    "sum {x} and {y}", "the sum of {x} and {y}", "compute {x} + {y}", "calculate {x} plus {y}",
    "work out {x}+{y}", "how much is {x} plus {y}", "what do {x} and {y} add up to",
    "{x} + {y}", "{x} plus {y}", "the total of {x} and {y}", "what does {x} plus {y} make",
    "what does {x} + {y} come to", "find the sum of {x} and {y}", "give me {x} + {y}",
    "{x} and {y} added together", "could you add {x} and {y}", "can you sum {x} and {y}",
    "would you add up {x} and {y}", "please add {x} and {y}", "I need {x} plus {y}",
    "tell me what {x} + {y} is", "what's the sum of {x} and {y}", "{x}+{y}",
    "add up {x} and {y}", "what do you get when you add {x} and {y}",
    "could you tell me what {x} + {y} makes",
)  # fmt: skip
WEATHER_CORES = (
    "what's the weather in {c}", "what is the weather like in {c}", "weather in {c}",
    "weather {c}", "how's the weather in {c}", "how is the weather in {c} today",
    "is it raining in {c}", "is it cold in {c}", "what's the forecast for {c}",
    "forecast for {c}", "tell me the weather for {c}", "check the weather in {c}",
    "do I need an umbrella in {c}", "what's it like outside in {c}", "how hot is it in {c}",
    "what's the temperature in {c}", "get the weather for {c}",
    "could you check the weather in {c}", "can you look up the weather in {c}",
    "any idea what the weather is in {c}", "{c} weather", "what's the weather doing in {c}",
    "is it sunny in {c}", "weather report for {c}", "should I bring a coat in {c}",
)  # fmt: skip
PARALLEL_CORES = (
    # (core, calls: "w" weather, "a" add, in mention order)
    ("what's the weather in {c} and in {c}", "ww"), ("weather in {c} and {c}", "ww"),
    ("compare the weather in {c} and {c}", "ww"), ("how's the weather in {c} and {c}", "ww"),
    ("check the weather in {c}, {c} and {c}", "www"), ("weather in {c}, {c} and {c}", "www"),
    ("is it raining in {c} or in {c}", "ww"), ("tell me the weather for {c} and for {c}", "ww"),
    ("add {x} and {y}, and also {x} and {y}", "aa"), ("what's {x}+{y} and {x}+{y}", "aa"),
    ("compute {x} plus {y} and {x} plus {y}", "aa"), ("sum {x} and {y}, then {x} and {y}", "aa"),
    ("what's {x} plus {y}, and the weather in {c}", "aw"),
    ("add {x} and {y} and tell me the weather in {c}", "aw"),
    ("weather in {c} and {x} + {y}", "wa"), ("check {c}'s weather and add {x} and {y}", "wa"),
    ("what are {x} + {y}, {x} + {y} and {x} + {y}", "aaa"),
)  # fmt: skip
FOLLOW_WEATHER = ("and in {c}", "what about {c}", "how about {c}", "and {c}", "same for {c}",
                  "now {c}", "and what about {c}", "ok and {c}")  # fmt: skip
FOLLOW_ADD_RESULT = ("now add {y} to that", "add {y} to the result", "plus {y}",
                     "and if you add {y}", "what's that plus {y}", "add {y} more",
                     "then add {y}")  # fmt: skip
FOLLOW_NEW_ADD = ("and {x} plus {y}", "now {x} + {y}", "what about {x} and {y}")
FOLLOW_HISTORY = ("what was the answer again", "can you repeat that", "say that again",
                  "what did you say", "sorry, what was it")  # fmt: skip
REFUSAL_CORES = (
    "write me a poem", "what's the capital of France", "multiply {x} by {y}",
    "what is {x} times {y}", "subtract {y} from {x}", "what's {x} minus {y}",
    "divide {x} by {y}", "translate hello into French", "tell me a joke",
    "what time is it in {c}", "book a flight to {c}", "what's the population of {c}",
    "who won the world cup", "set a timer for {x} minutes", "send an email to my boss",
    "play some music", "what's in the news today", "recommend a movie",
    "how do I bake bread", "write some python code", "what's your favorite color",
    "convert {x} dollars to euros", "what's the square root of {x}", "summarize this article",
    "order a pizza", "how far is {c} from {c}", "what's {x} squared", "spell {c} backwards",
    "remind me to call mom", "what day is it", "what's the exchange rate in {c}",
    "find me a hotel in {c}", "is {x} a prime number",
)  # fmt: skip
CHAT = (
    ("hello", f"Hello! {CAN_DO}"), ("hi", f"Hi! {CAN_DO}"),
    ("what can you do", CAN_DO), ("who are you", f"I am a tiny demo model. {CAN_DO}"),
    ("help", CAN_DO), ("thanks", "You're welcome!"), ("thank you", "You're welcome!"),
    ("good morning", f"Good morning! {CAN_DO}"),
)  # fmt: skip
SYSTEMS = (
    None,
    None,
    "You are a helpful assistant.",
    "You are a concise assistant. Use the tools when they help.",
)


def weather_report(city: str) -> str:
    """The demo `get_weather` implementation clients use: deterministic per city (in any
    casing), so the docs' loop (docs/demo-model.md) and the tests agree on what it returns."""
    city = {c.lower(): c for c in CITIES}.get(city.lower(), city)
    h = int.from_bytes(hashlib.sha256(city.encode()).digest()[:4], "big")
    return f"{CONDITIONS[h % len(CONDITIONS)]}, {h // 8 % 36 - 5}°C"


def city_symbols() -> list[str]:
    """The cities in the three casings prompts use, as the demo vocabulary's word symbols
    (`train_spm(symbols=...)`): each is one token wherever it is written, so the model
    copies the token the user wrote into its call instead of respelling ` Denver` as `D`,
    `enver` after `">` (which run 2 of issue 18 confused with `Dublin`)."""
    return [v for c in CITIES for v in (c, c.lower(), c.upper())]


def run_tool(name: str, args: dict[str, Any]) -> str:
    """Execute a demo tool call as a client would (the value of its tool_result)."""
    if name == "add":
        return str(int(args["a"]) + int(args["b"]))
    if name == "get_weather":
        return weather_report(str(args["city"]))
    raise ValueError(f"unknown demo tool {name!r}")


@dataclass(frozen=True)
class Call:
    tool: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Round:
    """A user message and what the assistant should do: `calls` (then answer from their
    results), or, with no calls, `reply`."""

    prompt: str
    calls: tuple[Call, ...] = ()
    reply: str = ""


@dataclass(frozen=True)
class Task:
    """One conversation of the demo: its rounds, its kind (`single`, `parallel`,
    `followup`, `refusal`, `chat`) and the template its last round was composed from."""

    rounds: tuple[Round, ...]
    kind: str
    template: str = field(default="", compare=False)

    @property
    def prompt(self) -> str:
        return self.rounds[0].prompt


def held_out(template: str) -> bool:
    """A fifth of the templates never occur in training."""
    return hashlib.sha256(template.encode()).digest()[0] % 5 == 0


def answer(calls: tuple[Call, ...], results: list[str]) -> str:
    """The assistant's answer from its calls' results: it quotes every result."""
    parts = []
    for c, r in zip(calls, results, strict=True):
        if c.tool == "add":
            parts.append(f"{c.args['a']} plus {c.args['b']} is {r}.")
        else:
            parts.append(f"The weather in {c.args['city']}: {r}.")
    return " ".join(parts)


def _number(rng: random.Random) -> int:
    return rng.randrange(10 ** rng.choice((1, 1, 2, 2, 3, 3, 4, 5)))


def _show(n: int, rng: random.Random) -> str:
    return f"{n:,}" if n >= 1000 and rng.random() < 0.2 else str(n)


def _typo(text: str, rng: random.Random) -> str:
    """Swap two adjacent letters of one word that is not a placeholder."""
    words = text.split(" ")
    spots = [i for i, w in enumerate(words) if w.isalpha() and len(w) > 3]
    if not spots:
        return text
    i = rng.choice(spots)
    w, j = words[i], rng.randrange(len(words[i]) - 1)
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def _compose(core: str, rng: random.Random, *, closer: bool = True) -> str:
    """A template: opener + core + closer + punctuation, in one of three casings."""
    opener = rng.choice(OPENERS)
    body = core + (rng.choice(CLOSERS) if closer else "") + rng.choice(PUNCTUATION)
    body = (
        body[:1].upper() + body[1:] if not opener or opener.endswith((". ", "! ", ": ")) else body
    )
    text = opener + body
    style = rng.random()
    if style < 0.12:
        text = text.lower()
    elif style < 0.16:
        text = text.upper()
    return text


def _draw_template(rng: random.Random, cores: tuple[str, ...], want_held_out: bool) -> str:
    while True:
        template = _compose(rng.choice(cores), rng)
        if held_out(template) == want_held_out:
            return template


def _fill(template: str, rng: random.Random, *, typo: bool = True):
    """Fill {x}/{y}/{c} slots in order (an occasional typo goes into the words around
    them first); returns (text, numbers, cities as written) in mention order."""
    if typo and rng.random() < 0.08:
        template = _typo(template, rng)
    numbers: list[int] = []
    cities: list[str] = []
    out, i = [], 0
    while i < len(template):
        slot = template[i : i + 3]
        if slot in ("{x}", "{y}", "{X}", "{Y}"):
            n = _number(rng)
            numbers.append(n)
            out.append(_show(n, rng))
            i += 3
        elif slot in ("{c}", "{C}"):
            c = rng.choice([c for c in CITIES if c not in cities])
            c = c.upper() if slot == "{C}" else c.lower() if template.islower() else c
            cities.append(c)
            out.append(c)
            i += 3
        else:
            out.append(template[i])
            i += 1
    return "".join(out), numbers, cities


def _calls(pattern: str, numbers: list[int], cities: list[str]) -> tuple[Call, ...]:
    nums, cits = iter(numbers), iter(cities)
    calls = []
    for kind in pattern:
        if kind == "a":
            calls.append(Call("add", {"a": next(nums), "b": next(nums)}))
        else:
            calls.append(Call("get_weather", {"city": next(cits)}))
    return tuple(calls)


def _single(rng: random.Random, held: bool) -> Task:
    tool = "add" if rng.random() < 0.55 else "get_weather"
    template = _draw_template(rng, ADD_CORES if tool == "add" else WEATHER_CORES, held)
    text, numbers, cities = _fill(template, rng)
    calls = _calls("a" if tool == "add" else "w", numbers, cities)
    return Task((Round(text, calls),), "single", template)


def _parallel(rng: random.Random, held: bool) -> Task:
    while True:
        core, pattern = rng.choice(PARALLEL_CORES)
        template = _compose(core, rng)
        if held_out(template) == held:
            break
    text, numbers, cities = _fill(template, rng)
    return Task((Round(text, _calls(pattern, numbers, cities)),), "parallel", template)


def _followup(rng: random.Random, held: bool) -> Task:
    first = _single(rng, False).rounds[0]
    (call,) = first.calls
    r = rng.random()
    if r < 0.2:
        cores, kind = FOLLOW_HISTORY, "history"
    elif call.tool == "get_weather":
        cores, kind = (FOLLOW_WEATHER, "w") if r < 0.85 else (FOLLOW_NEW_ADD, "a")
    else:
        cores, kind = (FOLLOW_ADD_RESULT, "+") if r < 0.75 else (FOLLOW_NEW_ADD, "a")
    template = _draw_template(rng, cores, held)
    text, numbers, cities = _fill(template, rng, typo=False)
    if kind == "history":
        second = Round(text, (), answer(first.calls, [run_tool(call.tool, call.args)]))
    elif kind == "+":
        prev = int(run_tool(call.tool, call.args))
        second = Round(text, (Call("add", {"a": prev, "b": numbers[0]}),))
    else:
        second = Round(text, _calls(kind, numbers, cities))
    return Task((first, second), "followup", template)


def _refusal(rng: random.Random, held: bool) -> Task:
    template = _draw_template(rng, REFUSAL_CORES, held)
    text, _, _ = _fill(template, rng)
    return Task((Round(text, (), REFUSAL),), "refusal", template)


def _chat(rng: random.Random) -> Task:
    prompt, reply = rng.choice(CHAT)
    text = _compose(prompt, rng, closer=False)
    return Task((Round(text, (), reply),), "chat", text)


#: training mix: kind → (share, drawer)
KINDS: dict[str, tuple[float, Callable[[random.Random, bool], Task]]] = {
    "single": (0.26, _single),
    "parallel": (0.34, _parallel),
    "followup": (0.25, _followup),
    "refusal": (0.10, _refusal),
    "chat": (0.05, lambda rng, _held: _chat(rng)),
}


def draw_task(rng: random.Random, *, kind: str | None = None, held: bool = False) -> Task:
    """A task of `kind` (by default drawn by the training mix) from training templates, or
    from held-out ones (`held`)."""
    if kind is None:
        r, acc = rng.random(), 0.0
        kind = "chat"
        for name, (share, _) in KINDS.items():
            acc += share
            if r < acc:
                kind = name
                break
    return KINDS[kind][1](rng, held)


def _reasoning(calls: tuple[Call, ...]) -> str:
    """The thought before calls names the tools, not their arguments: the arguments are
    copied from the prompt once, in the calls, by the same skill with thinking on or off
    (run 3 of issue 18, where the thought spelled the calls out: parallel calls 19/50 right
    with thinking on, 29/50 with it off)."""
    tools = list(dict.fromkeys(c.tool for c in calls))
    return f"I will call {' and '.join(tools)}."


def request_body(task: Task, *, thinking: bool, system: str | None) -> dict[str, Any]:
    """The first request of the conversation, as a client sends it."""
    body: dict[str, Any] = {
        "model": "deepseek-v4-flash",
        "max_tokens": 256,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": task.rounds[0].prompt}],
    }
    if not thinking:
        body["thinking"] = {"type": "disabled"}
    if system is not None:
        body["system"] = system
    return body


def round_turns(rnd: Round, *, thinking: bool, tool_ids: list[str]) -> list[dict[str, Any]]:
    """The messages after a round's user message, in Anthropic form: (assistant calls,
    tool results, assistant answer), or the one reply."""

    def turn(blocks: list[dict[str, Any]], thought: str) -> dict[str, Any]:
        if thinking:
            blocks = [{"type": "thinking", "thinking": thought, "signature": ""}, *blocks]
        return {"role": "assistant", "content": blocks}

    if not rnd.calls:
        thought = "I can answer without a tool." if rnd.reply != REFUSAL else "No tool does this."
        return [turn([{"type": "text", "text": rnd.reply}], thought)]
    results = [run_tool(c.tool, c.args) for c in rnd.calls]
    uses = [{"type": "tool_use", "id": i, "name": c.tool, "input": c.args}
            for c, i in zip(rnd.calls, tool_ids, strict=True)]  # fmt: skip
    backs = [{"type": "tool_result", "tool_use_id": i, "content": r}
             for i, r in zip(tool_ids, results, strict=True)]  # fmt: skip
    return [
        turn(uses, _reasoning(rnd.calls)),
        {"role": "user", "content": backs},
        turn([{"type": "text", "text": answer(rnd.calls, results)}], "I have the results."),
    ]


def training_bodies(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` whole conversations (request bodies whose messages end with the last answer),
    from training templates only."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = draw_task(rng)
        thinking = rng.random() < 0.5
        body = request_body(task, thinking=thinking, system=rng.choice(SYSTEMS))
        for k, rnd in enumerate(task.rounds):
            if k:
                body["messages"].append({"role": "user", "content": rnd.prompt})
            ids = [f"toolu_{rng.getrandbits(128):032x}" for _ in rnd.calls]
            body["messages"] += round_turns(rnd, thinking=thinking, tool_ids=ids)
        out.append(body)
    return out


def held_out_tasks(n: int, seed: int, kind: str) -> list[Task]:
    """`n` tasks of `kind` whose (last) round comes from a held-out template: sentences
    composed in a way training never saw."""
    rng = random.Random(seed)
    return [draw_task(rng, kind=kind, held=True) for _ in range(n)]
