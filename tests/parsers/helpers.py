"""Helpers for the parser tests: the WEATHER tools and streaming a text in chunks."""

from __future__ import annotations

import codecs
import json

from k2serve.parsers import ParsedOutput, StreamingOutputParser

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string"}},
                "required": ["tz"],
            },
        },
    },
]


def stream_chunks(chunks, thinking=True, tools=None, truncated=False, **kw):
    """Feed `chunks` (str) to a streaming parser; return (parser, all deltas)."""
    parser = StreamingOutputParser(thinking=thinking, tools=tools, **kw)
    deltas = [parser.feed(c) for c in chunks]
    deltas.append(parser.finish(truncated=truncated))
    return parser, deltas


def stream_bytes(text: str, cuts, **kw):
    """Cut the UTF-8 bytes of `text` at `cuts` (possibly inside a character), decode them
    incrementally as the detokenizer would, and stream the pieces."""
    data = text.encode()
    dec = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *sorted(set(cuts)), len(data)]
    chunks = [dec.decode(data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    chunks.append(dec.decode(b"", final=True))
    assert "".join(chunks) == text
    return stream_chunks(chunks, **kw)


def accumulate(deltas) -> dict:
    """What an OpenAI client reconstructs from the deltas."""
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index not in calls:
                assert tc.id is not None and tc.name is not None, "first delta must carry id/name"
                calls[tc.index] = {"id": tc.id, "name": tc.name, "arguments": ""}
            else:
                assert tc.id is None and tc.name is None, "id/name only in the first delta"
            calls[tc.index]["arguments"] += tc.arguments or ""
    assert sorted(calls) == list(range(len(calls))), "tool indices must be 0..n-1"
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
    }


def summary(parsed: ParsedOutput) -> dict:
    return {
        "reasoning": parsed.reasoning_content,
        "content": parsed.content,
        "tool_calls": [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in parsed.tool_calls
        ],
    }


def json_equal(a: str, b: str) -> bool:
    return json.loads(a) == json.loads(b)
