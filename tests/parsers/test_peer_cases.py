"""vLLM's (tests/tool_parsers/test_kimi_k2_tool_parser.py) and sglang's
(test/registered/function_call/test_kimik2_detector.py) Kimi-K2 parser cases, run against
k2serve's whole and streaming parsers (both argument modes, several chunkings).

The inputs are theirs; the expectations are theirs except where k2serve's documented policy
differs (see parsers/tool_calls.py), marked `POLICY`:
- content is stripped (vLLM returns "text " with the trailing space);
- a well-delimited call whose tool cannot be resolved is KEPT, flagged `declared=False` (both
  drop it: a silent drop ends an agent turn with no call and no text).
"""

from __future__ import annotations

import json

import pytest

from k2serve.parsers import parse_output

from .helpers import accumulate, stream_chunks

S, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
B, A, X = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _t(name, params=None):
    params = params if params is not None else {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
    }  # fmt: skip
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _obj(props, required=()):
    return {"type": "object", "properties": props, "required": list(required)}


STR, NUM = {"type": "string"}, {"type": "number"}
SG = [_t("ReadFile"), _t("get_weather", _obj({"city": STR, "unit": STR}, ["city"]))]
AGENT = [
    _t("Read", _obj({"file_path": STR, "offset": NUM, "limit": NUM}, ["file_path"])),
    _t("Write", _obj({"file_path": STR, "content": STR}, ["file_path", "content"])),
    _t("Edit", _obj({"file_path": STR, "old_string": STR, "new_string": STR},
                    ["file_path", "old_string", "new_string"])),
    _t("Glob", _obj({"pattern": STR, "path": STR}, ["pattern"])),
    _t("Grep", _obj({"pattern": STR, "path": STR, "output_mode": STR}, ["pattern"])),
    _t("LS", _obj({"path": STR, "ignore": {"type": "array"}}, ["path"])),
    _t("Ping", {"type": "object", "properties": {}}),
]  # fmt: skip
CLIENT_IDS = [
    "call_3",
    "call_7f3a9c2b1e4d5f6a7b8c9d0e",
    "toolu_01AkmjoowNgNx2qNfJzc8z2F",
    "0b3d1c2e-4f5a-6b7c-8d9e-0f1a2b3c4d5e",
    "tooltoolu_01KPuJ9wUyn6EMNvM6D3vSWE",
]


def call(fid, args):
    return f"{B}{fid}{A}{args}{X}"


def sec(*calls):
    return S + "".join(calls) + E


# (id, text, tools, expected content, expected [(name, args JSON or None=any, declared)])
CASES = [
    # ---- vLLM ----
    ("vllm_no_tools", "This is a test", None, "This is a test", []),
    ("vllm_content_before",
     "I'll help you check the weather. " + S + " " + B + "\nfunctions.get_weather:0 " + A
     + ' {"city": "Beijing"} ' + X + " " + E,
     None, "I'll help you check the weather.", [("get_weather", {"city": "Beijing"}, None)]),
    ("vllm_multi_call",
     "I'll help you check the weather. " + S + " " + B + "\nfunctions.get_weather:0 " + A
     + ' {"city": "Beijing"} ' + X + " " + B + "\nfunctions.get_weather:1 " + A
     + ' {"city": "Shanghai"} ' + X + " " + E,
     None, "I'll help you check the weather.",
     [("get_weather", {"city": "Beijing"}, None), ("get_weather", {"city": "Shanghai"}, None)]),
    ("vllm_concatenated_bug_fix",
     "First, the weather. " + sec(
         call("functions.get_weather:0", '{"latitude": 34.0522, "longitude": -118.2437}'),
         call("functions.get_news:1", '{"content": "Los Angeles today"}')),
     None, "First, the weather.",
     [("get_weather", {"latitude": 34.0522, "longitude": -118.2437}, None),
      ("get_news", {"content": "Los Angeles today"}, None)]),
    ("vllm_three_concatenated",
     "I'll help you with multiple tasks. " + sec(
         call("functions.get_weather:0", '{"city": "New York"}'),
         call("functions.get_news:1", '{"topic": "technology"}'),
         call("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}')),
     None, "I'll help you with multiple tasks.",
     [("get_weather", {"city": "New York"}, None), ("get_news", {"topic": "technology"}, None),
      ("send_email", {"to": "user@example.com", "subject": "Daily Update"}, None)]),
    ("vllm_mixed_spacing",
     "Mixed spacing test. " + S + " " + B + " functions.test:0 " + A + " {} " + X
     + call("functions.test2:1", "{}") + " " + E,
     None, "Mixed spacing test.", [("test", {}, None), ("test2", {}, None)]),
    ("vllm_angle_brackets_in_json",
     "I need to process HTML content. " + sec(call(
         "functions.process_html:0", '{"html": "<div>content</div>", "text": "normal text"}')),
     None, "I need to process HTML content.",
     [("process_html", {"html": "<div>content</div>", "text": "normal text"}, None)]),
    ("vllm_newlines_in_json",
     "I need to process formatted JSON. " + sec(call("functions.process_data:0", json.dumps(
         {"name": "test", "value": 123, "nested": {"key": "value"}}, indent=2))),
     None, "I need to process formatted JSON.",
     [("process_data", {"name": "test", "value": 123, "nested": {"key": "value"}}, None)]),
    ("vllm_invalid_json_every_call_returned",
     "Check. " + S + " " + B + "\nfunctions.invalid_get_weather:0 " + A + ' {"city": "Beijing" '
     + X + " " + B + "\nfunctions.valid_get_weather:1 " + A + ' {"city": "Shanghai"} ' + X + E,
     None, "Check.",
     [("invalid_get_weather", None, None), ("valid_get_weather", {"city": "Shanghai"}, None)]),
    # POLICY: vLLM drops the call with the malformed id `functions.invalid_get_weather.0`
    ("vllm_invalid_funcall_kept",
     "Check. " + S + B + "functions.invalid_get_weather.0 " + A + ' {"city": "Beijing"} ' + X
     + B + "functions.valid_get_weather:1" + A + '{"city": "Shanghai"}' + X + E,
     None, "Check.", [("0", {"city": "Beijing"}, None),
                      ("valid_get_weather", {"city": "Shanghai"}, None)]),
    ("vllm_token_leak_between_section_and_call_begin",
     "I'll help you with that. " + S + " spurious text " + call(
         "functions.get_weather:0", '{"city": "Paris"}') + E,
     None, "I'll help you with that.", [("get_weather", {"city": "Paris"}, None)]),
    ("vllm_noise_after_call_inside_section",
     "Hi " + S + call("functions.get_weather:0", '{"city": "Paris"}') + " leaked " + E + " bye",
     None, "Hi  bye", [("get_weather", {"city": "Paris"}, None)]),
    ("vllm_reentry_after_section", S + E + " More reasoning", None, "More reasoning", []),
    ("vllm_empty_section", "Reasoning " + S + E, None, "Reasoning", []),
    ("vllm_same_chunk_begin_noise_end", "Reasoning " + S + "   " + E + " Done", None,
     "Reasoning  Done", []),
    ("vllm_section_begin_noise_call_begin_same_chunk",
     "Reasoning " + S + " noise text " + call("functions.f:0", "{}") + E, None, "Reasoning",
     [("f", {}, None)]),
    ("vllm_call_end_and_section_end_same_chunk",
     "Let me help. " + S + B + "get_weather:0 " + A + ' {"city": "Paris"} ' + X + E + " Done",
     None, "Let me help.  Done", [("get_weather", {"city": "Paris"}, None)]),
    ("vllm_stream_ends_inside_section", S + " partial content", None, None, []),
    # POLICY: vLLM force-exits a section after 8192 characters and returns them as content;
    # k2serve's rule is positional (text inside a section is never content)
    ("vllm_unclosed_section_text_is_not_content", S + "x" * 10000, None, None, []),
    ("vllm_singular_section_markers",
     "Reasoning <|tool_call_section_begin|>" + call("functions.f:0", '{"a": 1}')
     + "<|tool_call_section_end|> after", None, "Reasoning  after", [("f", {"a": 1}, None)]),
    # ---- sglang ----
    ("sgl_single", sec(call("functions.ReadFile:0", '{"path": "/test.py"}')), SG, None,
     [("ReadFile", {"path": "/test.py"}, True)]),
    ("sgl_multiple",
     sec(call("functions.ReadFile:0", '{"path": "/a.py"}'),
         call("functions.get_weather:1", '{"city": "Tokyo"}')), SG, None,
     [("ReadFile", {"path": "/a.py"}, True), ("get_weather", {"city": "Tokyo"}, True)]),
    ("sgl_local_index_from_model_counter",
     sec(call("functions.ReadFile:5", '{"path": "/a.py"}'),
         call("functions.get_weather:6", '{"city": "Tokyo"}')), SG, None,
     [("ReadFile", {"path": "/a.py"}, True), ("get_weather", {"city": "Tokyo"}, True)]),
    ("sgl_text_before", "Let me check the file." + sec(
        call("functions.ReadFile:0", '{"path": "/test.py"}')), SG, "Let me check the file.",
     [("ReadFile", {"path": "/test.py"}, True)]),
    ("sgl_no_call", "Just a normal response.", SG, "Just a normal response.", []),
    ("sgl_hyphenated_name",
     sec(call("functions.mcp__portal__search-documents:0", '{"path": "/docs"}')),
     [_t("mcp__portal__search-documents"), _t("list-files")], None,
     [("mcp__portal__search-documents", {"path": "/docs"}, True)]),
    ("sgl_end_marker_without_start_never_leaks", "normal text" + E, SG, "normal text", []),
    ("sgl_argument_begin_without_call_never_leaks", "text" + A + "more", SG, "textmore", []),
    ("sgl_tool_call_inside_think_without_close",
     "<think>Let me read this file..." + sec(call("functions.ReadFile:0", '{"path": "/t.py"}')),
     SG, None, [("ReadFile", {"path": "/t.py"}, True)]),
    ("sgl_two_sections_dense_indices",
     sec(call("functions.get_weather:7", '{"city": "London"}'))
     + sec(call("functions.get_weather:8", '{"city": "Berlin"}')), SG, None,
     [("get_weather", {"city": "London"}, True), ("get_weather", {"city": "Berlin"}, True)]),
    ("sgl_bad_payload_passthrough",
     sec(call("functions.get_weather:0", '{"city": "A"}'))
     + sec(call("functions.get_weather:1", '{"city": "Bad", "valid": fasle}'))
     + sec(call("functions.get_weather:2", '{"city": "C"}')), SG, None,
     [("get_weather", {"city": "A"}, True), ("get_weather", None, True),
      ("get_weather", {"city": "C"}, True)]),
    ("sgl_bare_counter_infers", sec(call("0", '{"city": "Tokyo"}')), SG, None,
     [("get_weather", {"city": "Tokyo"}, True)]),
    ("sgl_bare_counter_single_tool", sec(call("5", '{"query": "test"}')), [_t("search")], None,
     [("search", {"query": "test"}, True)]),
    # POLICY: sglang skips the unresolvable call
    ("sgl_bare_counter_unknown_kept", sec(call("0", '{"unknown_key": "value"}')), SG, None,
     [("0", {"unknown_key": "value"}, False)]),
    *[(f"sgl_client_id_{i}", "Let me check.\n" + sec(call(fid, '{"path": "/a.py"}')), SG,
       "Let me check.", [("ReadFile", {"path": "/a.py"}, True)])
      for i, fid in enumerate(CLIENT_IDS)],
    *[(f"sgl_client_id_weather_{i}", sec(call(fid, '{"city": "Tokyo"}')), SG, None,
       [("get_weather", {"city": "Tokyo"}, True)]) for i, fid in enumerate(CLIENT_IDS)],
    ("sgl_client_ids_multiple",
     sec(call("call_3", '{"path": "/a.py"}'), call("call_4", '{"city": "Tokyo"}')), SG, None,
     [("ReadFile", {"path": "/a.py"}, True), ("get_weather", {"city": "Tokyo"}, True)]),
    ("sgl_client_id_mixed_with_standard",
     sec(call("toolu_01AkmjoowNgNx2qNfJzc8z2F", '{"city": "Tokyo"}'),
         call("functions.ReadFile:7", '{"path": "/a.py"}')), SG, None,
     [("get_weather", {"city": "Tokyo"}, True), ("ReadFile", {"path": "/a.py"}, True)]),
    # POLICY: sglang drops the first call
    ("sgl_client_id_unresolvable_kept",
     sec(call("call_3", '{"unknown_key": 1}'), call("call_4", '{"city": "Paris"}')), SG, None,
     [("call_3", {"unknown_key": 1}, False), ("get_weather", {"city": "Paris"}, True)]),
    ("sgl_client_id_single_tool", sec(call("toolu_01Akm", '{"path": "/x"}')), [_t("search")],
     None, [("search", {"path": "/x"}, True)]),
    ("sgl_strict_read", sec(call("call_1", '{"file_path": "/x"}')), AGENT, None,
     [("Read", {"file_path": "/x"}, True)]),
    ("sgl_strict_write", sec(call("call_1", '{"file_path": "/x", "content": "c"}')), AGENT, None,
     [("Write", {"file_path": "/x", "content": "c"}, True)]),
    ("sgl_strict_edit",
     sec(call("call_1", '{"file_path": "/x", "old_string": "a", "new_string": "b"}')), AGENT,
     None, [("Edit", {"file_path": "/x", "old_string": "a", "new_string": "b"}, True)]),
    ("sgl_strict_ls", sec(call("0", '{"path": "/x"}')), AGENT, None,
     [("LS", {"path": "/x"}, True)]),
    ("sgl_strict_ls_reversed", sec(call("0", '{"path": "/x"}')), AGENT[::-1], None,
     [("LS", {"path": "/x"}, True)]),
    ("sgl_strict_grep", sec(call("toolu_1", '{"pattern": "a", "output_mode": "c"}')), AGENT,
     None, [("Grep", {"pattern": "a", "output_mode": "c"}, True)]),
    # POLICY for the rest of this block: no inference -> kept as written, flagged
    ("sgl_ambiguous_glob_grep", sec(call("call_1", '{"pattern": "a", "path": "/x"}')), AGENT,
     None, [("call_1", {"pattern": "a", "path": "/x"}, False)]),
    ("sgl_ambiguous_pattern_only", sec(call("call_1", '{"pattern": "a"}')), AGENT, None,
     [("call_1", {"pattern": "a"}, False)]),
    ("sgl_missing_required", sec(call("call_1", '{"old_string": "a", "new_string": "b"}')),
     AGENT, None, [("call_1", None, False)]),
    ("sgl_unknown_key", sec(call("call_1", '{"file_path": "/x", "bogus": 1}')), AGENT, None,
     [("call_1", {"file_path": "/x", "bogus": 1}, False)]),
    ("sgl_empty_object_is_the_no_argument_tool", sec(call("call_1", "{}")), AGENT, None,
     [("Ping", {}, True)]),
    ("sgl_two_no_argument_tools_ambiguous", sec(call("call_1", "{}")),
     [*AGENT, _t("Pong", {"type": "object"})], None, [("call_1", {}, False)]),
    ("sgl_non_object_json", sec(call("call_1", "[1, 2]")), AGENT, None,
     [("call_1", None, False)]),
    ("sgl_single_tool_without_argument_check", sec(call("call_1", '{"bogus": 1}')), AGENT[:1],
     None, [("Read", {"bogus": 1}, True)]),
]  # fmt: skip


def _chunkings(text):
    yield [text]
    yield list(text)
    for step in (2, 7):
        yield [text[i : i + step] for i in range(0, len(text), step)]


def _check(got_calls, got_content, expect_content, expect_calls, tools):
    assert got_content == expect_content
    assert len(got_calls) == len(expect_calls), got_calls
    for (name, args, declared), c in zip(expect_calls, got_calls, strict=True):
        assert c["name"] == name
        if args is not None:
            assert json.loads(c["arguments"]) == args
        if tools is not None:
            assert c["declared"] == declared


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_peer_case(case):
    _, text, tools, content, calls = case
    thinking = text.startswith("<think>")
    whole = parse_output(text, thinking=thinking, tools=tools)
    got = [{"name": c.name, "arguments": c.arguments, "declared": c.declared}
           for c in whole.tool_calls]  # fmt: skip
    _check(got, whole.content, content, calls, tools)
    for stream_arguments in (False, True):
        for chunks in _chunkings(text):
            parser, deltas = stream_chunks(
                chunks, thinking=thinking, tools=tools, stream_arguments=stream_arguments
            )
            acc = accumulate(deltas)
            streamed = [
                {**c, "declared": full.declared}
                for c, full in zip(acc["tool_calls"], parser.tool_calls, strict=True)
            ]
            _check(streamed, acc["content"], content, calls, tools)
            assert parser.tool_calls == whole.tool_calls
