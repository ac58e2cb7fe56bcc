"""Incremental tool-call argument streaming (`stream_arguments=True`): the deltas of vLLM's
kimi_k2 parser (id + name first, then argument fragments as generated), and the property that
any chunking yields the whole-text parser's calls and content."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2serve.parsers import StreamingOutputParser, parse_output

from .helpers import WEATHER_TOOLS, accumulate, stream_bytes, summary
from .test_properties import free_text, kimi_output

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CALL = (
    "I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "unit": "celsius"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)


def _feed_chars(text, **kw):
    p = StreamingOutputParser(stream_arguments=True, **kw)
    deltas = [p.feed(c) for c in text]
    deltas.append(p.finish())
    return p, deltas


def test_name_first_then_fragments():
    p, deltas = _feed_chars(CALL, thinking=False, tools=WEATHER_TOOLS)
    calls = [tc for d in deltas for tc in d.tool_calls]
    assert calls[0].id == "functions.get_weather:0" and calls[0].name == "get_weather"
    assert calls[0].arguments is None  # the name comes before any argument text
    frags = [tc.arguments for tc in calls[1:]]
    assert all(tc.id is None and tc.name is None and tc.index == 0 for tc in calls[1:])
    assert len(frags) > 10  # fed per character: many fragments, not one
    assert "".join(frags) == '{"city": "Paris", "unit": "celsius"}'
    # the name delta went out before the arguments were complete
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert first < len(CALL) - len('"celsius"}<|tool_call_end|><|tool_calls_section_end|>')
    assert p.tool_calls[0].arguments == "".join(frags)


def test_held_back_cases_are_whole():
    # a client-style id: the tool must be inferred from the complete arguments
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>call_3<|tool_call_argument_begin|>"
        '{"tz": "UTC"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    _, deltas = _feed_chars(text, thinking=False, tools=WEATHER_TOOLS)
    calls = [tc for d in deltas for tc in d.tool_calls]
    assert len(calls) == 1 and calls[0].name == "get_time" and calls[0].arguments == '{"tz": "UTC"}'
    # arguments written as a JSON string are unwrapped at the end
    text = (
        "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '"{\\"a\\": 1}"<|tool_call_end|>'
    )
    _, deltas = _feed_chars(text, thinking=False)
    calls = [tc for d in deltas for tc in d.tool_calls]
    assert [c.arguments for c in calls] == [None, '{"a": 1}']
    # empty arguments end as {}
    _, deltas = _feed_chars(
        "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>  <|tool_call_end|>",
        thinking=False,
    )
    assert accumulate(deltas)["tool_calls"][0]["arguments"] == "{}"


def test_cut_streamed_call_is_reported():
    text = CALL[: CALL.index("celsius")]
    p = StreamingOutputParser(thinking=False, tools=WEATHER_TOOLS, stream_arguments=True)
    d = p.feed(text)
    assert d.tool_calls and d.tool_calls[0].name == "get_weather"
    p.finish(truncated=True)
    assert p.tool_calls == [] and p.dropped_partial_call and p.cut_streamed_call
    # held mode: nothing of the cut call was ever shown
    p = StreamingOutputParser(thinking=False, tools=WEATHER_TOOLS)
    assert not p.feed(text).tool_calls
    p.finish(truncated=True)
    assert p.dropped_partial_call and not p.cut_streamed_call


def test_mode_is_chosen_per_call():
    two = CALL.replace("<|tool_calls_section_end|>", "") + (
        '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "UTC"}'
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    p = StreamingOutputParser(thinking=False, tools=WEATHER_TOOLS, stream_arguments=True)
    cut = two.index("functions.get_time")
    per_call = []
    for i, ch in enumerate(two):
        if i == cut:
            p.stream_arguments = False  # e.g. the token budget got short
        per_call += p.feed(ch).tool_calls
    per_call += p.finish().tool_calls
    second = [tc for tc in per_call if tc.index == 1]
    assert len(second) == 1 and second[0].arguments == '{"tz": "UTC"}'
    assert len([tc for tc in per_call if tc.index == 0]) > 2


_tools = st.sampled_from([None, WEATHER_TOOLS, ["get_weather", "search"]])


def _check(text, cuts, thinking, tools):
    whole = parse_output(text, thinking=thinking, tools=tools)
    parser, deltas = stream_bytes(text, cuts, thinking=thinking, tools=tools, stream_arguments=True)
    assert accumulate(deltas) == summary(whole)
    assert parser.tool_calls == whole.tool_calls


def _check_truncated(text, cuts, thinking, tools):
    whole = parse_output(text, thinking=thinking, tools=tools, truncated=True)
    parser, deltas = stream_bytes(
        text, cuts, thinking=thinking, tools=tools, truncated=True, stream_arguments=True
    )
    got, want = accumulate(deltas), summary(whole)
    assert (got["reasoning"], got["content"]) == (want["reasoning"], want["content"])
    assert parser.tool_calls == whole.tool_calls
    n = len(want["tool_calls"])
    assert got["tool_calls"][:n] == want["tool_calls"]
    # at most one more: the streamed call the cut interrupted, flagged as such
    assert len(got["tool_calls"]) - n == int(parser.cut_streamed_call)


@SETTINGS
@given(data=st.data(), text=free_text, thinking=st.booleans(), tools=_tools)
def test_any_chunking_free_text(data, text, thinking, tools):
    n = len(text.encode())
    _check(text, data.draw(st.lists(st.integers(0, n), max_size=40)), thinking, tools)
    cut = text[: data.draw(st.integers(0, len(text)))]
    m = len(cut.encode())
    _check_truncated(cut, data.draw(st.lists(st.integers(0, m), max_size=40)), thinking, tools)


@SETTINGS
@given(data=st.data(), text=kimi_output(), thinking=st.booleans(), tools=_tools)
def test_any_chunking_kimi_outputs(data, text, thinking, tools):
    n = len(text.encode())
    _check(text, data.draw(st.lists(st.integers(0, n), max_size=40)), thinking, tools)
    cut = text[: data.draw(st.integers(0, len(text)))]
    m = len(cut.encode())
    _check_truncated(cut, data.draw(st.lists(st.integers(0, m), max_size=40)), thinking, tools)


def test_json_fragments_reassemble_for_any_split():
    args = {"city": "São Paulo", "days": [1, 2, 3], "nested": {"q": "a<b"}}
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        f"<|tool_call_argument_begin|>{json.dumps(args, ensure_ascii=False, indent=2)}"
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    for step in (1, 2, 5, 13):
        p = StreamingOutputParser(thinking=False, tools=WEATHER_TOOLS, stream_arguments=True)
        deltas = [p.feed(text[i : i + step]) for i in range(0, len(text), step)]
        deltas.append(p.finish())
        assert json.loads(accumulate(deltas)["tool_calls"][0]["arguments"]) == args
