"""The Responses stream assembly (`responses._Items`) for ANY chunking of a model output: the
items the events describe, the items `response.output_item.done` carries and the final output
all agree with the non-streamed parse (reasoning text, answer text, calls in order)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2serve.parsers import StreamingOutputParser, parse_output
from k2serve.server.responses import _Events, _Items
from parsers.helpers import WEATHER_TOOLS
from parsers.test_properties import kimi_output

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(text: str, cuts: list[int], tools, parallel: bool, stream_arguments: bool):
    bounds = [0, *sorted(set(cuts)), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    items = _Items(_Events(), parallel)
    parser = StreamingOutputParser(thinking=True, tools=tools, stream_arguments=stream_arguments)
    raw: list[str] = []
    for i, ch in enumerate(chunks):
        parser.stream_arguments = stream_arguments and i % 3 != 2  # the mode changes mid-way
        raw += items.delta(parser.feed(ch), parser.tool_calls)
    raw += items.delta(parser.finish(), parser.tool_calls)
    raw += items.close_all(parser.tool_calls)
    events = [json.loads(e.split("\ndata: ", 1)[1]) for e in raw]
    return events, items.output


@SETTINGS
@given(data=st.data(), text=kimi_output(), parallel=st.booleans(), mode=st.booleans())
def test_stream_items_match_the_whole_parse(data, text, parallel, mode):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    events, output = _run(text, cuts, WEATHER_TOOLS, parallel, mode)
    whole = parse_output(text, thinking=True, tools=WEATHER_TOOLS)
    calls = whole.tool_calls if parallel else whole.tool_calls[:1]
    # the final items
    reasoning = [it for it in output if it["type"] == "reasoning"]
    messages = [it for it in output if it["type"] == "message"]
    fcs = [it for it in output if it["type"] == "function_call"]
    assert "".join(c["text"] for it in reasoning for c in it["content"]) == (
        whole.reasoning_content or ""
    )
    assert "".join(c["text"] for it in messages for c in it["content"]) == (whole.content or "")
    assert [(f["call_id"], f["name"], f["arguments"]) for f in fcs] == [
        (c.id, c.name, c.arguments) for c in calls
    ]
    assert all(f["status"] == "completed" for f in fcs)
    # the events describe the same items: deltas join to the done texts, done items = output
    done = {
        e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"
    }
    assert [done[i] for i in range(len(output))] == output
    for i, it in enumerate(output):
        kind = {"reasoning": "response.reasoning_text.delta",
                "message": "response.output_text.delta",
                "function_call": "response.function_call_arguments.delta"}[it["type"]]  # fmt: skip
        joined = "".join(e["delta"] for e in events if e["type"] == kind and e["output_index"] == i)
        want = it["arguments"] if it["type"] == "function_call" else it["content"][0]["text"]
        assert joined == want
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(output)))  # each item opened once, in order
