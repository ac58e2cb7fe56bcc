"""Kimi-K2 reasoning and tool-call parsing, whole-output and streaming.

Parsers work on TEXT: the tool-call markers and `<think>`/`</think>` reach them as text (they are
not flagged special); special-flagged tokens such as `<|im_end|>` are already stripped.

- `parse_output(text, thinking=True, tools=None, truncated=False) -> ParsedOutput`
- `StreamingOutputParser(thinking=True, tools=None)`: `.feed(delta_text) -> DeltaMessage`,
  `.finish(truncated=False) -> DeltaMessage`; `.tool_calls` holds the full `ToolCall` records.
- `tool_call_prefix(name, index)`: the text that opens a call, to force tool_choice.

The rules and every decision (undeclared tools, invalid JSON, odd ids, truncation) are in the
docstrings of `whole` and `tool_calls`.
"""

from k2serve.parsers.markers import tool_call_prefix
from k2serve.parsers.streaming import StreamingOutputParser
from k2serve.parsers.tool_calls import DeltaMessage, ParsedOutput, ToolCall, ToolCallDelta
from k2serve.parsers.whole import parse_output

__all__ = [
    "DeltaMessage",
    "ParsedOutput",
    "StreamingOutputParser",
    "ToolCall",
    "ToolCallDelta",
    "parse_output",
    "tool_call_prefix",
]
