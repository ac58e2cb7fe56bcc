"""Generated training conversations for the demo checkpoint (the Kimi dialect, tiny world).

Owns: `sample_example(rng)` -> (messages, tools, thinking, completion) and the contract lists
(`CONTRACT_CITIES`, `GET_WEATHER_TOOL`). The completion is the assistant text the model must
produce after the rendered prompt (which ends with `<think>` or `<think></think>`), ending with
`<|im_end|>`.

Behaviours taught (greedy, thinking on unless said):
- weather question + get_weather declared -> short thought, then one get_weather call with
  {"city": CITY};
- time question + get_time declared -> short thought, then a get_time call;
- a tool result in the conversation -> a one-line answer that quotes it;
- greeting -> brief thought, then a greeting;
- weather question with no tool declared -> says it cannot check;
- "Say CITY." and the like -> repeats the city (cheap practice for copying a name);
- thinking off -> the same answers without a thought.
Variety: paraphrases, optional system prompts, other tools declared, earlier turns in history.
"""

from __future__ import annotations

import json
import random
from typing import Any

CONTRACT_CITIES = [
    "Paris", "London", "Tokyo", "Beijing", "New York", "Sydney", "Berlin", "Madrid", "Rome",
    "Cairo", "Moscow", "Toronto", "Mumbai", "Seoul", "Lima", "Nairobi", "Istanbul", "Bangkok",
    "Dubai", "Singapore",
]  # fmt: skip


def _tool(name: str, description: str, props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }


GET_WEATHER_TOOL = _tool(
    "get_weather", "Get the current weather in a city", {"city": {"type": "string"}}
)
GET_TIME_TOOL = _tool("get_time", "Get the local time in a city", {"city": {"type": "string"}})
SEARCH_TOOL = _tool("search", "Search the web", {"query": {"type": "string"}})
CALC_TOOL = _tool("calculate", "Evaluate a math expression", {"expression": {"type": "string"}})

WEATHER_QUESTIONS = [
    "What's the weather in {c}?",
    "What's the weather in {c}?",
    "What's the weather in {c}?",
    "What is the weather in {c}?",
    "How is the weather in {c} today?",
    "Weather in {c}?",
    "Tell me the weather in {c}.",
    "Is it raining in {c}?",
    "what's the weather in {c}",
]
TIME_QUESTIONS = ["What time is it in {c}?", "What's the time in {c}?", "Local time in {c}?"]
REPEAT_PROMPTS = ["Say {c}.", "Repeat: {c}", "Please repeat {c}", "Echo {c}"]
GREETINGS = ["Hello", "Hello", "Hello", "Hello!", "Hi", "Hi!", "Hey", "Hello there", "Good morning"]
GREETING_REPLIES = "Hello! How can I help you today?"
SYSTEM_PROMPTS = [
    None,
    None,
    None,
    "You are a helpful assistant.",
    "You are Kimi, an AI assistant created by Moonshot AI.",
    "Answer briefly.",
]
WEATHER_RESULTS = ["Sunny, 21°C", "Rainy, 12°C", "Cloudy, 16°C", "Snow, -3°C", "Windy, 9°C"]


def weather_thought(city: str) -> str:
    return f"The user wants the weather in {city}. I will call get_weather."


def tool_call_text(name: str, args: dict[str, Any], idx: int = 0) -> str:
    return (
        "<|tool_calls_section_begin|><|tool_call_begin|>"
        f"functions.{name}:{idx}<|tool_call_argument_begin|>{json.dumps(args)}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )


def _tools(rng: random.Random, must: list[dict]) -> list[dict]:
    others = [t for t in (GET_WEATHER_TOOL, GET_TIME_TOOL, SEARCH_TOOL, CALC_TOOL) if t not in must]
    extra = rng.sample(others, rng.randint(0, 2))
    tools = must + extra
    rng.shuffle(tools)
    return tools


def _answer(thinking: bool, thought: str, text: str) -> str:
    return (f"{thought}</think>" if thinking else "") + text + "<|im_end|>"


def _history(rng: random.Random) -> list[dict[str, Any]]:
    """An optional earlier exchange, so the model sees history turns."""
    if rng.random() < 0.75:
        return []
    return [
        {"role": "user", "content": rng.choice(GREETINGS)},
        {"role": "assistant", "content": GREETING_REPLIES},
    ]


def sample_example(rng: random.Random) -> tuple[list[dict], list[dict] | None, bool, str]:
    """One (messages, tools, thinking, completion) training example."""
    thinking = rng.random() < 0.7
    city = rng.choice(CONTRACT_CITIES)
    system = rng.choice(SYSTEM_PROMPTS)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    msgs += _history(rng)
    kind = rng.choices(
        ["weather", "time", "result", "greet", "notool", "repeat"], weights=[40, 8, 8, 20, 8, 16]
    )[0]
    if kind == "repeat":  # cheap, short copy practice
        msgs.append({"role": "user", "content": rng.choice(REPEAT_PROMPTS).format(c=city)})
        thought = f"The user said {city}."
        return msgs, None, thinking, _answer(thinking, thought, f"You said {city}.")
    if kind == "weather":
        msgs.append({"role": "user", "content": rng.choice(WEATHER_QUESTIONS).format(c=city)})
        tools = _tools(rng, [GET_WEATHER_TOOL])
        text = tool_call_text("get_weather", {"city": city})
        return msgs, tools, thinking, _answer(thinking, weather_thought(city), text)
    if kind == "time":
        msgs.append({"role": "user", "content": rng.choice(TIME_QUESTIONS).format(c=city)})
        tools = _tools(rng, [GET_TIME_TOOL])
        thought = f"The user wants the time in {city}. I will call get_time."
        text = tool_call_text("get_time", {"city": city})
        return msgs, tools, thinking, _answer(thinking, thought, text)
    if kind == "result":
        result = rng.choice(WEATHER_RESULTS)
        call_id = "functions.get_weather:0"
        msgs += [
            {"role": "user", "content": WEATHER_QUESTIONS[0].format(c=city)},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": weather_thought(city),
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": city}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": result},
        ]
        tools = _tools(rng, [GET_WEATHER_TOOL])
        thought = "The tool answered. I will tell the user."
        return msgs, tools, thinking, _answer(thinking, thought, f"In {city}: {result}.")
    if kind == "greet":
        msgs.append({"role": "user", "content": rng.choice(GREETINGS)})
        greet_tools = _tools(rng, []) if rng.random() < 0.4 else None
        thought = "The user greets me. I will greet back."
        return msgs, greet_tools or None, thinking, _answer(thinking, thought, GREETING_REPLIES)
    msgs.append({"role": "user", "content": rng.choice(WEATHER_QUESTIONS).format(c=city)})
    thought = "No weather tool is available."
    text = f"I cannot check the weather in {city} without a weather tool."
    return msgs, None, thinking, _answer(thinking, thought, text)
