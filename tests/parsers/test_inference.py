"""Inferring the tool of a call whose id does not name it (`call_3`, `0`, `toolu_...`) from its
arguments, by full JSON Schema validation (the `jsonschema` library)."""

from __future__ import annotations

import pytest

from k2serve.parsers import parse_output
from k2serve.parsers.tool_calls import normalize_tools, resolve_name, schema_accepts


def _tool(name, params):
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _infer(tools, args, call_id="call_3"):
    name, warning = resolve_name(call_id, args, normalize_tools(tools))
    return name if warning and "inferred" in warning else None


TYPED = [
    _tool("set_count", {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    _tool("set_label", {
        "type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}),
]  # fmt: skip


@pytest.mark.parametrize(
    "args, name",
    [({"n": 3}, "set_count"), ({"n": "three"}, "set_label"), ({"n": 3.5}, None), ({}, None)],
)
def test_types_decide(args, name):
    assert _infer(TYPED, args) == name


def test_required_and_declared_keys():
    tools = [
        _tool("read", {"type": "object", "properties": {"file_path": {"type": "string"},
              "limit": {"type": "number"}}, "required": ["file_path"]}),
        _tool("write", {"type": "object", "properties": {"file_path": {"type": "string"},
              "content": {"type": "string"}}, "required": ["file_path", "content"]}),
    ]  # fmt: skip
    assert _infer(tools, {"file_path": "/x"}) == "read"
    assert _infer(tools, {"file_path": "/x", "content": "c"}) == "write"
    assert _infer(tools, {"file_path": "/x", "bogus": 1}) is None  # undeclared key
    assert _infer(tools, {"content": "c"}) is None  # required missing
    assert _infer(list(reversed(tools)), {"file_path": "/x"}) == "read"  # order-independent


def test_ambiguity_is_no_inference():
    glob = _tool("glob", {"type": "object", "properties": {"pattern": {"type": "string"},
                 "path": {"type": "string"}}, "required": ["pattern"]})  # fmt: skip
    grep = _tool("grep", {"type": "object", "properties": {"pattern": {"type": "string"},
                 "path": {"type": "string"}, "mode": {"type": "string"}},
                 "required": ["pattern"]})  # fmt: skip
    assert _infer([glob, grep], {"pattern": "a"}) is None
    assert _infer([glob, grep], {"pattern": "a", "mode": "c"}) == "grep"


def test_any_of_all_of_ref_const_enum():
    tools = [
        _tool("move", {
            "type": "object",
            "$defs": {"dir": {"enum": ["up", "down"]}},
            "properties": {"direction": {"$ref": "#/$defs/dir"}, "steps": {"type": "integer"}},
            "required": ["direction"],
        }),
        _tool("turn", {
            "type": "object",
            "properties": {"direction": {"anyOf": [{"const": "left"}, {"const": "right"}]}},
            "allOf": [{"required": ["direction"]}],
        }),
    ]  # fmt: skip
    assert _infer(tools, {"direction": "up"}) == "move"
    assert _infer(tools, {"direction": "left"}) == "turn"
    assert _infer(tools, {"direction": "sideways"}) is None
    assert _infer(tools, {"direction": "up", "steps": "two"}) is None  # steps must be an integer


def test_additional_properties_and_boolean_schemas():
    tools = [
        _tool("strict", {"type": "object", "properties": {"a": {"type": "integer"},
              "b": False}, "additionalProperties": False}),
        _tool("loose", {"type": "object", "properties": {"c": True}, "required": ["c"]}),
    ]  # fmt: skip
    assert _infer(tools, {"a": 1}) == "strict"
    assert _infer(tools, {"b": 1}) is None  # b: false accepts no value
    assert _infer(tools, {"c": [1, {"x": None}]}) == "loose"  # c: true accepts anything
    specs = normalize_tools([_tool("never", False), _tool("always", True)])
    assert not schema_accepts(specs["never"], {})
    assert schema_accepts(specs["always"], {"q": 1})


def test_empty_properties_tool_matches_only_no_arguments():
    tools = [
        _tool("ping", {"type": "object", "properties": {}}),
        _tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}),
    ]  # fmt: skip
    assert _infer(tools, {}) == "ping"
    assert _infer(tools, {"x": 1}) is None
    assert _infer(tools, {"city": "Oslo"}) == "get_weather"
    # two no-argument tools (one without any properties key): {} is ambiguous
    two = [*tools, _tool("pong", {"type": "object"})]
    assert _infer(two, {}) is None
    # no parameters at all is a no-argument tool too
    assert _infer([*tools[1:], {"type": "function", "function": {"name": "now"}}], {}) == "now"


def test_single_tool_is_inferred_without_argument_check():
    assert _infer([TYPED[0]], {"bogus": 1}) == "set_count"


def test_broken_schema_falls_back_to_keys():
    odd = {"type": "object", "properties": {"a": {"type": "no-such-type"}}, "required": ["a"]}
    other = {"type": "object", "properties": {"b": {}}, "required": ["b"]}
    tools = [_tool("odd", odd), _tool("other", other)]
    assert _infer(tools, {"a": 1}) == "odd"


@pytest.mark.parametrize("call_id", ["0", "call_3", "call00003", "toolu_01AkmjoowNgNx2qNfJzc8z2F",
                                     "0b3d1c2e-4f5a-6b7c-8d9e-0f1a2b3c4d5e"])  # fmt: skip
def test_client_style_ids_in_output(call_id):
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>" + call_id +
        '<|tool_call_argument_begin|>{"n": 7}<|tool_call_end|><|tool_calls_section_end|>'
    )  # fmt: skip
    parsed = parse_output(text, thinking=False, tools=TYPED)
    assert [(c.id, c.name, c.declared) for c in parsed.tool_calls] == [(call_id, "set_count", True)]
    assert parsed.content is None
