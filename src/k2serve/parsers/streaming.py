"""Streaming parsing: `StreamingOutputParser.feed(delta_text) -> DeltaMessage`, `.finish()`.

Same rules as `whole.parse_output` (see its docstring), applied incrementally, so that the
concatenation of all deltas equals the whole-output result for ANY chunking of the text.

Invariants:
- No delta ever holds a marker or a piece of one: a tail that could still grow into a marker is
  held back until it is decided (at most `MAX_MARKER_LEN - 1` characters).
- Leading whitespace of reasoning/content is dropped and trailing whitespace is held back until
  more non-space text of the same kind follows (so streamed text equals the stripped whole).
- Text inside a tool-call section but outside its calls is never content (whole-output rule 5).
- Tool calls, two modes (`stream_arguments`, read when a call's arguments begin, so a caller may
  change it between feeds):
  - False (default): a call is emitted once it is COMPLETE, as one `ToolCallDelta(index, id,
    name, arguments)`. A call cut by max_tokens is then never shown, and the arguments are
    checked and unwrapped exactly as the whole-output parser does.
  - True: the deltas of vLLM's kimi_k2 parser: first `ToolCallDelta(index, id, name)` as soon as
    `<|tool_call_argument_begin|>` arrives, then argument fragments as they are generated. Only
    calls whose id names the function (`functions.NAME:IDX`, `NAME:IDX`, a declared bare name)
    stream; a call whose tool must be inferred from its arguments, and arguments written as a
    JSON string (unwrapped at the end), are held back until complete. The fragments of a
    complete call join to exactly the whole parser's `arguments` (empty arguments end as `{}`).
    A streamed call that the output's end cuts off is NOT in `.tool_calls` and sets
    `cut_streamed_call` (its fragments were already sent; the caller reports the cut).
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
    resolve_name,
)


class _State(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    SECTION = "section"  # inside a tool-call section, between calls: text is dropped
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

    def __init__(
        self,
        thinking: bool = True,
        tools: Iterable[Any] | None = None,
        stream_arguments: bool = False,
    ) -> None:
        self._tools = normalize_tools(tools)
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._in_section = False
        self._buf = ""  # held-back text that may still become a marker
        self._reasoning = _Stripped()
        self._content = _Stripped()
        self._call_id: list[str] = []
        self._call_args: list[str] = []
        self._finished = False
        self.stream_arguments = stream_arguments
        # the open call when it streams: (index, arguments emitted so far, argument mode)
        self._streaming: _OpenCall | None = None
        self.tool_calls: list[ToolCall] = []
        self.dropped_partial_call = False
        self.cut_streamed_call = False

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
                self.cut_streamed_call = self._streaming is not None
                self._streaming = None
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
        elif st is _State.CALL_ARGS:
            self._call_args.append(s)
            if self._streaming is not None:
                self._streaming.push(s, out)
        # _State.SECTION: noise between a section's markers is never content

    def _marker(self, mk: str, out: _Delta) -> None:
        st = self._state
        if st in (_State.REASONING, _State.CONTENT, _State.SECTION):
            if mk == CALL_BEGIN:
                self._open_call()
            elif mk == SECTION_BEGIN:
                self._in_section = True
                self._state = _State.SECTION
            elif mk == SECTION_END and st is _State.SECTION:
                self._in_section = False
                self._state = _State.CONTENT
            elif mk == THINK_END and st is _State.REASONING:
                self._state = _State.CONTENT
        elif st is _State.CALL_ID and mk == ARG_BEGIN:
            self._state = _State.CALL_ARGS
            self._maybe_stream(out)
        elif st is _State.CALL_ARGS and mk in (THINK_START, THINK_END):
            self._text(mk, out)
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

    def _maybe_stream(self, out: _Delta) -> None:
        """At <|tool_call_argument_begin|>: start streaming the call if its id names it."""
        if not self.stream_arguments:
            return
        raw_id = "".join(self._call_id).strip()
        if ":" not in raw_id and (
            self._tools is None or raw_id.rsplit(".", 1)[-1] not in self._tools
        ):
            return  # the tool must be inferred from the complete arguments
        name, _ = resolve_name(raw_id, None, self._tools)
        if not name:
            return
        index = len(self.tool_calls)
        self._streaming = _OpenCall(index)
        out.tool_calls.append(ToolCallDelta(index, raw_id, name, None))

    def _complete_call(self, out: _Delta) -> None:
        self._state = _State.SECTION if self._in_section else _State.CONTENT
        index = len(self.tool_calls)
        streaming, self._streaming = self._streaming, None
        call = make_tool_call("".join(self._call_id), "".join(self._call_args), index, self._tools)
        if call is None:
            return
        self.tool_calls.append(call)
        if streaming is None:
            out.tool_calls.append(ToolCallDelta(index, call.id, call.name, call.arguments))
            return
        # the emitted fragments are a prefix of the final text (raw mode: the stripped text;
        # held mode: nothing yet); send the rest
        rest = call.arguments[len(streaming.sent) :]
        if not call.arguments.startswith(streaming.sent):  # NOTE: cannot happen (see _OpenCall)
            rest = call.arguments
        if rest:
            out.tool_calls.append(ToolCallDelta(index, None, None, rest))


class _OpenCall:
    """A streaming call's arguments: leading whitespace dropped, trailing whitespace held back
    (the final text is stripped), and arguments that start with `"` (a JSON string holding the
    object, unwrapped at the end) held back entirely."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.sent = ""
        self.mode: str | None = None  # None: only whitespace so far; "raw" or "held"
        self.pending = ""

    def push(self, s: str, out: _Delta) -> None:
        if self.mode is None:
            s = s.lstrip()
            if not s:
                return
            self.mode = "held" if s.startswith('"') else "raw"
        if self.mode == "held":
            return
        s = self.pending + s
        body = s.rstrip()
        self.pending = s[len(body) :]
        if body:
            self.sent += body
            out.tool_calls.append(ToolCallDelta(self.index, None, None, body))


class _Delta:
    """Accumulates one feed()'s output."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[ToolCallDelta] = []

    def message(self) -> DeltaMessage:
        calls: list[ToolCallDelta] = []
        for d in self.tool_calls:  # one delta per call and feed: fragments joined
            last = calls[-1] if calls else None
            if last is not None and last.index == d.index and d.id is None and d.name is None:
                last.arguments = (last.arguments or "") + (d.arguments or "")
            else:
                calls.append(ToolCallDelta(d.index, d.id, d.name, d.arguments))
        return DeltaMessage(
            reasoning_content="".join(self.reasoning) or None,
            content="".join(self.content) or None,
            tool_calls=calls,
        )
