"""Whole-output parsing: `parse_output(text) -> ParsedOutput` (reasoning, content, tool calls).

The rules (the streaming parser implements the same rules as a state machine; the property
tests check that the two agree for every chunking):

1. Markers are cut out first (`markers.split_markers`); a marker is never part of reasoning or
   content. Stray markers that mean nothing where they stand are dropped.
2. Reasoning (only when `thinking`): from the start up to the first `</think>`,
   `<|tool_calls_section_begin|>` (K2-Thinking opens tool sections inside thinking without
   `</think>`) or `<|tool_call_begin|>`. No opening `<think>` is required; `<think>` markers are
   dropped. Without any end, everything is reasoning. With `thinking=False` there is no
   reasoning and all text is content (tool calls are still parsed).
3. Tool calls: each `<|tool_call_begin|>` opens a call (a section marker around it is not
   required). The id runs to `<|tool_call_argument_begin|>`, the arguments to `<|tool_call_end|>`.
   A call is also ended by the next `<|tool_call_begin|>` or a section begin/end (a model that
   forgot `<|tool_call_end|>`), and by the end of the output unless the output was truncated.
   Arguments keep `<think>`/`</think>` as text (they may be JSON string data). Per-call rules
   (ids, names, argument checks, undeclared tools): see `tool_calls`.
4. Output cut inside a call (`truncated=True`, finish_reason "length"): the unfinished call is
   DROPPED, its text too (a half call is neither a call nor useful content), and
   `dropped_partial_call` is set. Complete calls before it are kept. An unfinished marker at the
   very end is dropped when truncated or when it starts with `<|` (`markers.drop_partial_marker`).
5. Content is the remaining text outside tool-call sections: before and after sections, and
   around calls written without a section. Text between a section's markers but outside its
   calls (`<|tool_calls_section_begin|> noise <|tool_call_begin|>...`) is dropped: it is never
   content. A section left open runs to the end of the output. Reasoning and content are each
   stripped of leading and trailing whitespace; empty -> None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from k2serve.parsers.markers import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    THINK_START,
    Token,
    drop_partial_marker,
    partial_marker_start,
    split_markers,
)
from k2serve.parsers.tool_calls import ParsedOutput, ToolCall, make_tool_call, normalize_tools

_CALL_TERMINATORS = (CALL_END, SECTION_BEGIN, SECTION_END)


def _literal(tokens: list[Token]) -> str:
    return "".join(s for is_marker, s in tokens if not is_marker)


def _content(tokens: list[Token], in_section: bool, parts: list[str]) -> bool:
    """Append the text of `tokens` that lies outside sections; return whether a section is open
    at the end."""
    for is_marker, s in tokens:
        if is_marker:
            if s == SECTION_BEGIN:
                in_section = True
            elif s == SECTION_END:
                in_section = False
        elif not in_section:
            parts.append(s)
    return in_section


def parse_output(
    text: str, thinking: bool = True, tools: Iterable[Any] | None = None, truncated: bool = False
) -> ParsedOutput:
    """Parse a complete model output (special-flagged tokens already stripped)."""
    if not isinstance(text, str):
        raise TypeError(f"parse_output: text must be str, got {type(text).__name__}")
    specs = normalize_tools(tools)
    tokens = split_markers(text)
    if tokens and not tokens[-1][0]:
        last = tokens[-1][1]
        cut = partial_marker_start(last)
        if drop_partial_marker(last[cut:], truncated):
            tokens[-1] = (False, last[:cut])

    i = 0
    reasoning_parts: list[str] = []
    if thinking:
        while i < len(tokens):
            is_marker, s = tokens[i]
            if not is_marker:
                reasoning_parts.append(s)
            elif s == THINK_END:
                i += 1
                break
            elif s in (SECTION_BEGIN, CALL_BEGIN):  # the section marker opens the section below
                break
            i += 1

    # segments[0] is content; each later segment starts right after a <|tool_call_begin|>.
    segments: list[list[Token]] = [[]]
    for tok in tokens[i:]:
        if tok == (True, CALL_BEGIN):
            segments.append([])
        else:
            segments[-1].append(tok)

    content_parts: list[str] = []
    in_section = _content(segments[0], False, content_parts)
    calls: list[ToolCall] = []
    dropped = False
    for k, seg in enumerate(segments[1:], start=1):
        end = next((j for j, (m, s) in enumerate(seg) if m and s in _CALL_TERMINATORS), None)
        body = seg if end is None else seg[:end]
        closed = end is not None or k < len(segments) - 1
        if not closed and truncated:
            dropped = True
            continue
        a = next((j for j, (m, s) in enumerate(body) if m and s == ARG_BEGIN), None)
        raw_id = _literal(body if a is None else body[:a])
        raw_args = ""
        if a is not None:
            raw_args = "".join(
                s for m, s in body[a + 1 :] if not m or s in (THINK_START, THINK_END)
            )
        call = make_tool_call(raw_id, raw_args, len(calls), specs)
        if call is not None:
            calls.append(call)
        if end is not None:
            # after <|tool_call_end|> the section (if any) goes on; a section marker that ended
            # the call acts as usual
            tail = seg[end + 1 :] if seg[end] == (True, CALL_END) else seg[end:]
            in_section = _content(tail, in_section, content_parts)

    reasoning = "".join(reasoning_parts).strip()
    content = "".join(content_parts).strip()
    return ParsedOutput(
        reasoning_content=reasoning or None,
        content=content or None,
        tool_calls=calls,
        dropped_partial_call=dropped,
    )
