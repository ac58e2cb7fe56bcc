"""Streaming parsing: `StreamingOutputParser.feed(delta_text) -> DeltaMessage`, `.finish()`.

Same rules as `whole.parse_output` (see its docstring), applied incrementally, so that the
concatenation of all deltas equals the whole-output result for ANY chunking of the text.

Invariants:
- No delta ever holds a marker or a piece of one: a tail that could still grow into a marker is
  held back until it is decided (at most `MAX_MARKER_LEN - 1` characters).
- Leading whitespace of reasoning/content is dropped and trailing whitespace is held back until
  more non-space text of the same kind follows (so streamed text equals the stripped whole).
- A tool call is emitted once it is COMPLETE, as one `ToolCallDelta(index, id, name,
  arguments)` carrying the whole argument text. Holding the call back is what lets the parser
  guarantee that a call cut by max_tokens is never shown to the client, and lets the argument
  text be checked and unwrapped (JSON-string arguments) identically to the whole-output parser.
  The full `ToolCall` records (with `valid_arguments`, `declared`, `warnings`) are in
  `.tool_calls`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

from k2serve.parsers.markers import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    MARKER_RE,
    MARKERS,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    THINK_START,
    drop_partial_marker,
    partial_marker_start,
)
from k2serve.parsers.tool_calls import (
    DeltaMessage,
    ToolCall,
    ToolCallDelta,
    make_tool_call,
    normalize_tools,
)


class _State(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL_ID = "call_id"
    CALL_ARGS = "call_args"


class _Stripped:
    """Emits text with leading whitespace dropped and trailing whitespace held back."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def push(self, s: str) -> str:
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        s = self.pending + s
        body = s.rstrip()
        self.pending = s[len(body) :]
        return body


class StreamingOutputParser:
    """Incremental reasoning + tool-call parser for one generated sequence."""

    def __init__(self, thinking: bool = True, tools: Iterable[Any] | None = None) -> None:
        self._tools = normalize_tools(tools)
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._buf = ""  # held-back text that may still become a marker
        self._reasoning = _Stripped()
        self._content = _Stripped()
        self._call_id: list[str] = []
        self._call_args: list[str] = []
        self._finished = False
        self.tool_calls: list[ToolCall] = []
        self.dropped_partial_call = False

    # -- public -----------------------------------------------------------------------------
    def feed(self, delta_text: str) -> DeltaMessage:
        if self._finished:
            raise RuntimeError("StreamingOutputParser.feed() called after finish()")
        if not isinstance(delta_text, str):
            raise TypeError(f"feed: delta_text must be str, got {type(delta_text).__name__}")
        out = _Delta()
        buf = self._buf + delta_text
        pos = 0
        for m in MARKER_RE.finditer(buf):
            if m.start() > pos:
                self._text(buf[pos : m.start()], out)
            self._marker(MARKERS[m.group()], out)
            pos = m.end()
        rest = buf[pos:]
        cut = partial_marker_start(rest)
        if cut:
            self._text(rest[:cut], out)
        self._buf = rest[cut:]
        return out.message()

    def finish(self, truncated: bool = False) -> DeltaMessage:
        """Flush what is held back. `truncated`: the output was cut (finish_reason "length")."""
        out = _Delta()
        if self._finished:
            return out.message()
        self._finished = True
        tail, self._buf = self._buf, ""
        if tail and not drop_partial_marker(tail, truncated):
            self._text(tail, out)
        if self._state in (_State.CALL_ID, _State.CALL_ARGS):
            if truncated:
                self.dropped_partial_call = True
            else:
                self._complete_call(out)
        return out.message()

    # -- state machine ----------------------------------------------------------------------
    def _text(self, s: str, out: _Delta) -> None:
        st = self._state
        if st is _State.REASONING:
            out.reasoning.append(self._reasoning.push(s))
        elif st is _State.CONTENT:
            out.content.append(self._content.push(s))
        elif st is _State.CALL_ID:
            self._call_id.append(s)
        else:
            self._call_args.append(s)

    def _marker(self, mk: str, out: _Delta) -> None:
        st = self._state
        if st is _State.REASONING:
            if mk in (THINK_END, SECTION_BEGIN):
                self._state = _State.CONTENT
            elif mk == CALL_BEGIN:
                self._open_call()
        elif st is _State.CONTENT:
            if mk == CALL_BEGIN:
                self._open_call()
        elif st is _State.CALL_ID and mk == ARG_BEGIN:
            self._state = _State.CALL_ARGS
        elif st is _State.CALL_ARGS and mk in (THINK_START, THINK_END):
            self._call_args.append(mk)
        elif mk == CALL_END:
            self._complete_call(out)
        elif mk in (CALL_BEGIN, SECTION_BEGIN, SECTION_END):
            # A call ended without <|tool_call_end|>: close it, then the marker acts as usual.
            self._complete_call(out)
            self._marker(mk, out)

    def _open_call(self) -> None:
        self._state = _State.CALL_ID
        self._call_id = []
        self._call_args = []

    def _complete_call(self, out: _Delta) -> None:
        self._state = _State.CONTENT
        index = len(self.tool_calls)
        call = make_tool_call("".join(self._call_id), "".join(self._call_args), index, self._tools)
        if call is None:
            return
        self.tool_calls.append(call)
        out.tool_calls.append(ToolCallDelta(index, call.id, call.name, call.arguments))


class _Delta:
    """Accumulates one feed()'s output."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[ToolCallDelta] = []

    def message(self) -> DeltaMessage:
        return DeltaMessage(
            reasoning_content="".join(self.reasoning) or None,
            content="".join(self.content) or None,
            tool_calls=self.tool_calls,
        )
