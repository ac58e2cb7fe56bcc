"""Property tests: for ANY chunking of an output (cut points anywhere, inside markers and inside
multi-byte characters), streaming gives exactly the whole-output result, truncated or not."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2serve.parsers import parse_output
from k2serve.parsers.markers import MARKERS

from .helpers import WEATHER_TOOLS, accumulate, stream_bytes, summary

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPELLINGS = sorted(MARKERS)
SPELLINGS_BEGIN = "<|tool_calls_section_begin|>"

# Free-form: markers, pieces of markers and text (with multi-byte characters) in any order.
_marker_piece = st.sampled_from(SPELLINGS).flatmap(
    lambda m: st.tuples(st.integers(0, len(m)), st.integers(0, len(m))).map(
        lambda ij: m[min(ij) : max(ij)]
    )
)
_text_piece = st.text(
    alphabet=st.sampled_from(list('ab :.,{}"\\\n\t<>|/_') + ["中", "文", "😀", "é"]),
    max_size=12,
)
_json_piece = st.sampled_from(
    ['{"city": "Paris"}', '{"tz": "UTC"}', '"{\\"a\\": 1}"', "[1]", "{bad", "", '{"x": 1}']
)
_id_piece = st.sampled_from(
    ["functions.get_weather:0", "get_time:1", "call00003", "", "functions.get_time", "x.y:2"]
)
free_text = st.lists(
    st.one_of(st.sampled_from(SPELLINGS), _marker_piece, _text_piece, _json_piece, _id_piece),
    max_size=25,
).map("".join)


@st.composite
def kimi_output(draw) -> str:
    """A plausible Kimi output: optional thought, content, a tool section, trailing content."""
    alphabet = st.sampled_from(list("abc xyz,.!?\n") + ["天", "気", "🌤"])
    words = st.text(alphabet=alphabet, max_size=30)
    out = ""
    if draw(st.booleans()):
        out += draw(st.sampled_from(["<think>", ""])) + draw(words)
        if draw(st.integers(0, 3)):  # mostly closed; sometimes the section ends it implicitly
            out += "</think>"
    out += draw(words)
    n_calls = draw(st.integers(0, 3))
    if n_calls:
        out += draw(st.sampled_from([SPELLINGS_BEGIN, "<|tool_call_section_begin|>"]))
        for i in range(n_calls):
            name = draw(st.sampled_from(["get_weather", "get_time", "search"]))
            call_id = draw(
                st.sampled_from([f"functions.{name}:{i}", f"{name}:{i}", f"call{i:05d}", ""])
            )
            args = json.dumps(
                draw(st.dictionaries(st.sampled_from(["city", "tz", "q"]), words, max_size=2)),
                ensure_ascii=draw(st.booleans()),
                indent=draw(st.sampled_from([None, 2])),
            )
            if draw(st.integers(0, 5)) == 0:
                args = json.dumps(args)  # arguments given as a JSON string
            end = "<|tool_call_end|>" if draw(st.integers(0, 5)) else ""
            out += f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{args}{end}"
        if draw(st.integers(0, 4)):
            out += "<|tool_calls_section_end|>" + draw(words)
    return out


def _cuts(draw_text: str):
    n = len(draw_text.encode())
    return st.lists(st.integers(0, n), max_size=min(n, 40))


def _check_same(text: str, cuts, thinking: bool, tools, truncated: bool) -> dict:
    whole = parse_output(text, thinking=thinking, tools=tools, truncated=truncated)
    parser, deltas = stream_bytes(text, cuts, thinking=thinking, tools=tools, truncated=truncated)
    assert accumulate(deltas) == summary(whole)
    assert parser.tool_calls == whole.tool_calls  # flags and warnings too
    assert parser.dropped_partial_call == whole.dropped_partial_call
    return summary(whole)


_tools = st.sampled_from([None, WEATHER_TOOLS, ["get_weather", "search"]])


@SETTINGS
@given(data=st.data(), text=free_text, thinking=st.booleans(), tools=_tools)
def test_any_chunking_free_text(data, text, thinking, tools):
    cuts = data.draw(_cuts(text))
    _check_same(text, cuts, thinking, tools, truncated=False)
    cut_at = data.draw(st.integers(0, len(text)))
    _check_same(text[:cut_at], data.draw(_cuts(text[:cut_at])), thinking, tools, truncated=True)


@SETTINGS
@given(data=st.data(), text=kimi_output(), thinking=st.booleans(), tools=_tools)
def test_any_chunking_kimi_outputs(data, text, thinking, tools):
    got = _check_same(text, data.draw(_cuts(text)), thinking, tools, truncated=False)
    for field in ("reasoning", "content"):
        assert not any(m in (got[field] or "") for m in MARKERS), (field, got)
    # every well-delimited call in the text is reported (none merged, none lost)
    assert len(got["tool_calls"]) == text.count("<|tool_call_begin|>")
    cut_at = data.draw(st.integers(0, len(text)))
    cut = _check_same(text[:cut_at], data.draw(_cuts(text[:cut_at])), thinking, tools, True)
    # truncation never reports a call that the full output does not have
    for partial, full in zip(cut["tool_calls"], got["tool_calls"], strict=False):
        assert partial == full
    assert len(cut["tool_calls"]) <= len(got["tool_calls"])
