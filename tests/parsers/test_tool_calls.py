"""Per-call decisions (ids, names, arguments, declared tools), `tool_call_prefix` and the
streaming parser's API contract."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from k2serve.parsers import StreamingOutputParser, parse_output, tool_call_prefix
from k2serve.parsers.tool_calls import normalize_arguments, normalize_tools, resolve_name

from .helpers import WEATHER_TOOLS, accumulate, stream_chunks

END = "<|tool_call_end|><|tool_calls_section_end|>"


@pytest.mark.parametrize(
    "raw, text, valid",
    [
        ('{"a": 1}', '{"a": 1}', True),
        ('  \n{"a": [1, 2]}\n ', '{"a": [1, 2]}', True),
        ("", "{}", True),
        ("   ", "{}", True),
        ('"{\\"a\\": 1}"', '{"a": 1}', True),  # a JSON string holding an object: unwrapped
        ('"not json"', '"not json"', False),
        ('"[1, 2]"', '"[1, 2]"', False),
        ("[1, 2]", "[1, 2]", False),
        ("42", "42", False),
        ('{"a": 1', '{"a": 1', False),
        ("{'a': 1}", "{'a': 1}", False),
    ],
)
def test_normalize_arguments(raw, text, valid):
    got, obj, problem = normalize_arguments(raw)
    assert got == text
    assert (problem is None) == valid
    if valid:
        assert json.loads(got) == obj


@pytest.mark.parametrize(
    "call_id, args, tools, name, warned",
    [
        ("functions.get_weather:0", {}, None, "get_weather", False),
        ("get_weather:12", {}, None, "get_weather", False),
        ("functions.get_weather", {}, None, "get_weather", False),
        ("ns.functions.get_time:3", {}, None, "get_time", False),
        ("call00003", {"city": "X"}, "W", "get_weather", True),  # inferred from the schema
        ("call00003", {"tz": "UTC"}, "W", "get_time", True),
        ("call00003", {"nope": 1}, "W", "call00003", True),  # no unique fit: kept as written
        ("call00003", {"q": 1}, None, "call00003", True),
        ("get_time", {}, "W", "get_time", False),  # a bare declared name
        ("toolu_01abc", {"anything": 1}, ["only_tool"], "only_tool", True),  # single tool
        ("", {"city": "X"}, "W", "get_weather", True),
        ("functions.ns.get_time:0", {}, ["ns.get_time"], "ns.get_time", False),  # issue 31
    ],
)
def test_resolve_name(call_id, args, tools, name, warned):
    specs = normalize_tools(WEATHER_TOOLS if tools == "W" else tools)
    got, warning = resolve_name(call_id, args, specs)
    assert got == name
    assert (warning is not None) == warned


def test_tools_accept_names_dicts_and_pydantic_models():
    class Fn(BaseModel):
        name: str
        parameters: dict

    class Tool(BaseModel):
        type: str = "function"
        function: Fn

    specs = normalize_tools(
        ["a", {"name": "b"}, Tool(function=Fn(name="c", parameters={"properties": {"x": {}}}))]
    )
    assert set(specs) == {"a", "b", "c"}
    assert specs["c"].properties == frozenset({"x"})


@pytest.mark.parametrize("bad", ["get_weather", 3, [{"function": {}}], [None]])
def test_bad_tools_raise_clear_errors(bad):
    with pytest.raises((TypeError, ValueError), match="tool"):
        normalize_tools(bad)


def test_undeclared_and_invalid_calls_carry_warnings():
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.rm_rf:0"
        '<|tool_call_argument_begin|>{"path": "/",}' + END
    )
    (call,) = parse_output(text, thinking=False, tools=WEATHER_TOOLS).tool_calls
    assert (call.name, call.declared, call.valid_arguments) == ("rm_rf", False, False)
    assert any("not among the declared" in w for w in call.warnings)
    assert any("not valid JSON" in w for w in call.warnings)
    # without declared tools there is nothing to be undeclared against
    (call,) = parse_output(text, thinking=False).tool_calls
    assert call.declared is None


def test_tool_call_prefix_named_round_trip():
    prefix = tool_call_prefix("get_weather", 2)
    assert prefix == (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:2"
        "<|tool_call_argument_begin|>"
    )
    generated = '{"city": "Nairobi"}' + END
    (call,) = parse_output(prefix + generated, tools=WEATHER_TOOLS).tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == (
        "functions.get_weather:2",
        "get_weather",
        {"city": "Nairobi"},
    )
    # streaming: the prefix is fed first and produces nothing by itself
    parser = StreamingOutputParser(tools=WEATHER_TOOLS)
    assert parser.feed(prefix).is_empty()
    deltas = [parser.feed(c) for c in generated] + [parser.finish()]
    assert accumulate(deltas)["tool_calls"] == [
        {"id": "functions.get_weather:2", "name": "get_weather", "arguments": '{"city": "Nairobi"}'}
    ]


def test_tool_call_prefix_required():
    prefix = tool_call_prefix(None)
    assert prefix == "<|tool_calls_section_begin|><|tool_call_begin|>functions."
    out = parse_output(prefix + 'get_time:0<|tool_call_argument_begin|>{"tz": "UTC"}' + END)
    assert [(c.id, c.name) for c in out.tool_calls] == [("functions.get_time:0", "get_time")]
    assert out.content is None and out.reasoning_content is None


@pytest.mark.parametrize("name, index", [("", 0), ("a:b", 0), ("a<b", 0), ("ok", -1)])
def test_tool_call_prefix_rejects_bad_input(name, index):
    with pytest.raises(ValueError, match="tool_call_prefix"):
        tool_call_prefix(name, index)


def test_streaming_api_contract():
    parser = StreamingOutputParser()
    with pytest.raises(TypeError, match="delta_text"):
        parser.feed(b"bytes")
    assert parser.feed("<think>a").reasoning_content == "a"
    assert parser.finish().is_empty()
    assert parser.finish().is_empty()  # idempotent
    with pytest.raises(RuntimeError, match="after finish"):
        parser.feed("more")


def test_streaming_holds_back_only_possible_markers():
    parser = StreamingOutputParser(thinking=False)
    assert parser.feed("Hello <|tool_call").content == "Hello"  # marker prefix held back
    d = parser.feed("_x|> world <b")  # it was not a marker; "<b" cannot start one
    assert d.content == " <|tool_call_x|> world <b"
    assert parser.feed(" and </th").content == " and"  # "</th" may become </think>
    assert parser.finish().content == " </th"  # it did not: kept as text at the end


def test_call_is_emitted_once_complete_with_id_and_name_first():
    text = (
        "<think>go</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
        '<|tool_call_argument_begin|>{"tz": "UTC"}' + END
    )
    parser, deltas = stream_chunks(list(text))
    with_calls = [d for d in deltas if d.tool_calls]
    assert len(with_calls) == 1
    (tc,) = with_calls[0].tool_calls
    assert (tc.index, tc.id, tc.name, tc.arguments) == (
        0,
        "functions.get_time:0",
        "get_time",
        '{"tz": "UTC"}',
    )
    # it arrives with the chunk that completes <|tool_call_end|>, not before
    assert (
        deltas.index(with_calls[0])
        == text.index("<|tool_call_end|>") + len("<|tool_call_end|>") - 1
    )


def test_parse_output_rejects_non_text():
    with pytest.raises(TypeError, match="text must be str"):
        parse_output(b"<think>")
