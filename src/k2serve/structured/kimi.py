"""The Kimi tool-call section as a grammar (xgrammar structural tag), for tool_choice.

Owns: `tool_call_constraint(tools, mode, ...)` -> `StructuredOutputsParams`.

The section the model must write (spec: the chat template and parsers/markers.py):
`<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX`
`<|tool_call_argument_begin|>` JSON arguments `<|tool_call_end|>`, then
`<|tool_calls_section_end|>`; the markers are single special tokens (`TokenFormat`), never
spelled out in text, and the JSON arguments follow the tool's parameter schema and never
contain marker text.

Modes:
- "named": exactly one call of the named tool, then the section ends (then EOS).
- "required": one call (or, with parallel tool calls, one or more) of any of the tools.
- "auto": free output; once the model opens a section, the calls must follow the tools'
  schemas (`strict` tools their own schema, the others any JSON object). Used when some tool
  has `strict: true`.
With thinking on, "named" / "required" start after `</think>` (or where the model opens a section
while still reasoning); "auto" covers the whole output, reasoning included.
"""

from __future__ import annotations

from typing import Any

from k2serve.parsers.markers import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
)
from k2serve.structured.backend import MAX_JSON_WHITESPACE
from k2serve.structured.params import StructuredOutputsParams
from k2serve.structured.schema import prepare_json_schema

# marker text never allowed inside a JSON string of the arguments (the parser would cut there)
_ARG_EXCLUDES = ["<|tool_call", "<|tool_calls_section"]
_INDEX_RE = r"(0|[1-9][0-9]{0,2})"


def _tok(marker: str) -> dict:
    return {"type": "token", "token": marker}


def _call(name: str, schema: Any) -> dict:
    return {
        "type": "sequence",
        "elements": [
            _tok(CALL_BEGIN),
            {"type": "const_string", "value": f"functions.{name}:"},
            {"type": "regex", "pattern": _INDEX_RE},
            _tok(ARG_BEGIN),
            {
                "type": "json_schema",
                "json_schema": prepare_json_schema(schema),
                "excludes": _ARG_EXCLUDES,
                "max_whitespace_cnt": MAX_JSON_WHITESPACE,
            },
            _tok(CALL_END),
        ],
    }


def _schema(tool: dict, strict_only: bool) -> Any:
    fn = tool["function"]
    params = fn.get("parameters")
    if params is None or (strict_only and not fn.get("strict")):
        return {"type": "object"}
    return params


def _calls(tools: list[dict], strict_only: bool, parallel: bool) -> dict:
    calls = [_call(t["function"]["name"], _schema(t, strict_only)) for t in tools]
    one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    return {"type": "plus", "content": one} if parallel else one


def tool_call_constraint(
    tools: list[dict],
    mode: str,
    *,
    name: str | None = None,
    parallel: bool = True,
    thinking: bool = False,
) -> StructuredOutputsParams:
    """`tools` in the OpenAI chat format ({"type": "function", "function": {...}})."""
    if not tools:
        raise ValueError("a tool-call constraint needs tools")
    if mode == "named":
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        fmt: dict[str, Any] = {
            "type": "sequence",
            "elements": [
                _tok(SECTION_BEGIN),
                _calls(chosen[:1], False, False),
                _tok(SECTION_END),
            ],
        }
    elif mode == "required":
        fmt = {
            "type": "sequence",
            "elements": [_tok(SECTION_BEGIN), _calls(tools, False, parallel), _tok(SECTION_END)],
        }
    elif mode == "auto":
        section = {
            "type": "tag",
            "begin": _tok(SECTION_BEGIN),
            "content": _calls(tools, True, parallel),
            "end": _tok(SECTION_END),
        }
        fmt = {
            "type": "token_triggered_tags",
            "trigger_tokens": [SECTION_BEGIN],
            "tags": [section],
            # the parser opens a call at either marker: a bare call marker outside the section
            # would escape the constraint
            "exclude_tokens": [CALL_BEGIN],
            "stop_after_first": True,  # one section per reply, then EOS
        }
        thinking = False  # the trigger works anywhere, reasoning included
    else:
        raise ValueError(f"unknown tool-call constraint mode {mode!r}")
    return StructuredOutputsParams(
        structural_tag={"type": "structural_tag", "format": fmt},
        after_reasoning=thinking,
        open_on_tool_section=thinking,
    )
