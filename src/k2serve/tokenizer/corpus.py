"""A small built-in text corpus for training a BPE vocabulary without any download.

Owns: `builtin_corpus()`: deterministic English prose, questions and answers, JSON tool
arguments, code, numbers and a little Chinese, in the style the demo model sees.
"""

from __future__ import annotations

import json
import random

CITIES = [
    "Paris", "London", "Tokyo", "Beijing", "New York", "Sydney", "Berlin", "Madrid", "Rome",
    "Cairo", "Moscow", "Toronto", "Mumbai", "Seoul", "Lima", "Nairobi", "Istanbul", "Bangkok",
    "Dubai", "Singapore", "Shanghai", "Mexico City", "Buenos Aires", "Lagos", "Jakarta", "Oslo",
]  # fmt: skip

_SUBJECTS = ["The model", "A user", "The assistant", "Kimi", "The server", "This tool", "We"]
_VERBS = ["reads", "writes", "answers", "calls", "checks", "explains", "returns", "thinks about"]
_OBJECTS = [
    "the weather", "a question", "the answer", "the function", "a short reply", "the result",
    "the forecast", "a greeting", "the tool call", "the temperature", "the user's request",
]  # fmt: skip
_HAN = ["你好", "天气", "北京", "上海", "谢谢", "今天", "明天", "模型", "助手", "问题"]
_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    'import json\nprint(json.dumps({"ok": True}))\n',
    "if x > 0:\n    y = x * 2\nelse:\n    y = -x\n",
]


def builtin_corpus(num_lines: int = 4000, seed: int = 0) -> str:
    """Deterministic mixed text (about 60 characters per line on average)."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        kind = i % 8
        if kind == 0:
            lines.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}.")
        elif kind == 1:
            city, temp = rng.choice(CITIES), rng.randint(-9, 39)
            lines.append(f"What's the weather in {city}? It's {temp}°C.")
        elif kind == 2:
            args = {"city": rng.choice(CITIES), "unit": rng.choice(["celsius", "fahrenheit"])}
            lines.append(json.dumps(args))
        elif kind == 3:
            lines.append(rng.choice(_CODE))
        elif kind == 4:
            lines.append(" ".join(rng.choice(_HAN) for _ in range(rng.randint(1, 4))) + "。")
        elif kind == 5:
            lines.append(f"I don't know, but I'll check: {rng.randint(0, 99999)} items, {i}.")
        elif kind == 6:
            lines.append("Hello! How can I help you today?   Thanks, you're welcome.")
        else:
            lines.append(f"functions.get_weather:{i % 5} The user asks about {rng.choice(CITIES)}.")
    return "\n".join(lines) + "\n"
