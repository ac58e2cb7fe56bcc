"""The Kimi dialect's markers as TEXT, and how text is cut into literal runs and markers.

Owns: the marker spellings (including the singular `<|tool_call_section_begin|>` /
`<|tool_call_section_end|>` variants, folded onto the canonical plural ones),
`split_markers` (whole text -> tokens), `partial_marker_start` (where a text's tail could still
become a marker, which the streaming parser must hold back) and `tool_call_prefix`.

Invariants:
- Every marker starts with `<` and contains no other `<`, and no marker is a prefix of another,
  so leftmost matching is unambiguous and cutting a text anywhere, then matching each piece with
  the held-back tail carried over, finds exactly the markers that matching the whole text finds.
- A token is `(True, canonical_marker)` or `(False, literal_text)`; literals are never empty.
"""

from __future__ import annotations

import re

THINK_START = "<think>"
THINK_END = "</think>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# spelling -> canonical marker. The singular section spellings appear in the wild (vLLM and
# llama.cpp accept them); they are not tokens of the real vocabulary, so they arrive as text too.
MARKERS: dict[str, str] = {
    THINK_START: THINK_START,
    THINK_END: THINK_END,
    SECTION_BEGIN: SECTION_BEGIN,
    "<|tool_call_section_begin|>": SECTION_BEGIN,
    SECTION_END: SECTION_END,
    "<|tool_call_section_end|>": SECTION_END,
    CALL_BEGIN: CALL_BEGIN,
    ARG_BEGIN: ARG_BEGIN,
    CALL_END: CALL_END,
}
MAX_MARKER_LEN = max(len(m) for m in MARKERS)
MARKER_RE = re.compile("|".join(re.escape(m) for m in sorted(MARKERS, key=len, reverse=True)))

Token = tuple[bool, str]


def partial_marker_start(text: str) -> int:
    """Index of the earliest `i` such that `text[i:]` is a proper prefix of some marker.

    Returns `len(text)` when no tail of `text` could grow into a marker. The caller is expected to
    have removed complete markers already (see `split_markers`).
    """
    for i in range(max(0, len(text) - MAX_MARKER_LEN + 1), len(text)):
        if text[i] == "<":
            tail = text[i:]
            if any(m.startswith(tail) and m != tail for m in MARKERS):
                return i
    return len(text)


def drop_partial_marker(tail: str, truncated: bool) -> bool:
    """Whether an unfinished marker left at the very end of the output is dropped.

    It is dropped when the output was cut (`truncated`: the model was most likely in the middle of
    writing the marker) or when it has the `<|` shape of a Kimi special token, which natural text
    does not end with; otherwise (e.g. a final `<` or `</thi`) it is kept as text.
    """
    return bool(tail) and (truncated or tail.startswith("<|"))


def split_markers(text: str) -> list[Token]:
    """Cut `text` into literal runs and canonical markers, in order."""
    tokens: list[Token] = []
    pos = 0
    for m in MARKER_RE.finditer(text):
        if m.start() > pos:
            tokens.append((False, text[pos : m.start()]))
        tokens.append((True, MARKERS[m.group()]))
        pos = m.end()
    if pos < len(text):
        tokens.append((False, text[pos:]))
    return tokens


def tool_call_prefix(name: str | None, index: int = 0) -> str:
    """The text that opens a tool call, for forcing `tool_choice` ("required" or a named tool).

    With a name: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>` (no space), after which the model writes the JSON arguments.
    With `name=None`: up to `functions.`, after which the model picks the tool and writes
    `NAME:IDX<|tool_call_argument_begin|>{...}`.

    The prefix is part of the prompt, not of the generated text: parse `prefix + generated`
    (or feed the prefix to a `StreamingOutputParser` first; it emits nothing for it).
    """
    if index < 0:
        raise ValueError(f"tool_call_prefix: index must be >= 0, got {index}")
    head = SECTION_BEGIN + CALL_BEGIN + "functions."
    if name is None:
        return head
    if not name or any(c in name for c in "<>:\n"):
        raise ValueError(f"tool_call_prefix: invalid tool name {name!r}")
    return f"{head}{name}:{index}{ARG_BEGIN}"
