"""The hand-written corpus (corpus.yaml): whole-output and streaming, several chunkings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k2serve.parsers import parse_output
from k2serve.parsers.markers import MARKER_RE, MARKERS

from .helpers import WEATHER_TOOLS, accumulate, stream_bytes, stream_chunks, summary

CASES = yaml.safe_load((Path(__file__).parent / "corpus.yaml").read_text(encoding="utf-8"))


def _tools(case):
    tools = case.get("tools")
    return WEATHER_TOOLS if tools == "WEATHER" else tools


def _check(case, got: dict, calls_full=None):
    exp = case["expect"]
    assert got["reasoning"] == exp.get("reasoning"), "reasoning"
    assert got["content"] == exp.get("content"), "content"
    want = exp.get("tool_calls", [])
    assert len(got["tool_calls"]) == len(want), got["tool_calls"]
    for g, w in zip(got["tool_calls"], want, strict=True):
        assert g["id"] == w["id"]
        assert g["name"] == w["name"]
        assert g["arguments"] == w["arguments"]
    if calls_full is not None:
        for c, w in zip(calls_full, want, strict=True):
            assert c.valid_arguments == w.get("valid", True), c.warnings
            default_declared = True if case.get("tools") else None
            assert c.declared == w.get("declared", default_declared), c.warnings
            # a flagged call always says why
            assert bool(c.warnings) >= (not c.valid_arguments or c.declared is False)


def _no_marker_text(got: dict):
    for field in ("reasoning", "content"):
        for m in MARKERS:
            assert m not in (got[field] or ""), f"marker {m} leaked into {field}"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_corpus_whole(case):
    parsed = parse_output(
        case["text"],
        thinking=case.get("thinking", True),
        tools=_tools(case),
        truncated=case.get("truncated", False),
    )
    got = summary(parsed)
    _check(case, got, parsed.tool_calls)
    _no_marker_text(got)
    assert parsed.dropped_partial_call == case["expect"].get("dropped_partial_call", False)


def _chunkings(text: str):
    """Whole, per character, in threes, at marker bounds, and with every marker cut in half."""
    spans = [m.span() for m in MARKER_RE.finditer(text)]
    bounds = sorted({0, len(text), *(b for span in spans for b in span)})
    halves = sorted({*bounds, *((a + b) // 2 for a, b in spans)})
    yield [text]
    yield list(text)
    yield [text[i : i + 3] for i in range(0, len(text), 3)]
    yield [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    yield [text[a:b] for a, b in zip(halves, halves[1:], strict=False)]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_corpus_streaming(case):
    kw = dict(
        thinking=case.get("thinking", True),
        tools=_tools(case),
        truncated=case.get("truncated", False),
    )
    for chunks in _chunkings(case["text"]):
        assert "".join(chunks) == case["text"]
        parser, deltas = stream_chunks(chunks, **kw)
        got = accumulate(deltas)
        _check(case, got, parser.tool_calls)
        for d in deltas:
            for m in MARKERS:
                assert m not in (d.reasoning_content or "") and m not in (d.content or "")
        assert parser.dropped_partial_call == case["expect"].get("dropped_partial_call", False)
    data = case["text"].encode()
    parser, deltas = stream_bytes(case["text"], range(1, len(data)), **kw)
    _check(case, accumulate(deltas), parser.tool_calls)
