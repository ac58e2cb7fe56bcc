"""Structured-output request fields -> `StructuredOutputsParams`, for chat and completions.

Owns: reading OpenAI `response_format` (json_object, json_schema), vLLM's `structured_outputs`
({"json" | "regex" | "choice" | "grammar" | "structural_tag": ...}) and the legacy
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields; the tool_choice
constraint (required, named, `strict` tools under auto); compiling up front so that a bad
schema is a 400 naming the field.

Invariants:
- At most one constraint per request: two different ones (say `response_format` and
  `guided_regex`) are a 400, as is a forced tool choice together with an output constraint.
- With thinking on, output constraints start after `</think>` (the reasoning stays free).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from k2serve.server.errors import bad_request
from k2serve.structured.kimi import tool_call_constraint
from k2serve.structured.params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _make(param: str, thinking: bool, **kw) -> tuple[StructuredOutputsParams, str]:
    try:
        return StructuredOutputsParams(after_reasoning=thinking, source=param, **kw), param
    except ValueError as e:
        msg = str(e)
        raise bad_request(
            msg if msg.startswith(param) else f"{param}: {msg}", param=param
        ) from None


def _tgi_schema(value):
    """TGI's `value`: a schema object (or bool), or the schema as a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise bad_request(
                "response_format.value must be a JSON schema (an object, or one as a string)",
                param="response_format.value",
            ) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request("response_format.value must be a JSON schema object",
                          param="response_format.value")  # fmt: skip
    return value


def output_constraint(req, thinking: bool) -> tuple[StructuredOutputsParams, str] | None:
    """The request's output constraint and the field it came from, or None."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        tgi = (rf.model_extra or {}).get("value")  # TGI's grammar: {"type": ..., "value": ...}
        if rf.type in ("json", "json_object") and tgi is not None:
            found.append(_make("response_format", thinking, json=_tgi_schema(tgi)))
        elif rf.type == "json":
            raise bad_request(
                "response_format type 'json' (TGI's grammar) needs 'value': a JSON schema",
                param="response_format.value",
            )
        elif rf.type == "regex":  # TGI's grammar
            if not isinstance(tgi, str):
                raise bad_request(
                    "response_format type 'regex' (TGI's grammar) needs 'value': a regex string",
                    param="response_format.value",
                )
            found.append(_make("response_format", thinking, regex=tgi))
        elif rf.type == "json_object":
            found.append(_make("response_format", thinking, json_object=True))
        elif rf.type == "json_schema":
            js = rf.json_schema
            if js is None or js.schema_ is None:
                raise bad_request(
                    "response_format.json_schema.schema is required for type 'json_schema'",
                    param="response_format",
                )
            found.append(_make("response_format", thinking, json=js.schema_))
        elif rf.type == "structural_tag":  # vLLM's extension: xgrammar's structural tag
            tag = {k: v for k, v in (rf.model_extra or {}).items() if k != "type"}
            found.append(_make("response_format", thinking, structural_tag=tag))
        else:
            raise bad_request(
                f"response_format.type={rf.type!r} is not supported "
                "(use 'text', 'json_object', 'json_schema' or 'structural_tag'; TGI's 'json' "
                "and 'regex' with 'value')",
                param="response_format.type",
            )
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        kw = {k: so[k] for k in _SO_KEYS if so.get(k) is not None and so[k] is not False}
        if so.get("json") is False:
            kw["json"] = False  # the schema `false`: compiled, and refused with its reason
        # exactly one kind: StructuredOutputsParams checks it (and names what was given)
        param = f"structured_outputs.{next(iter(kw))}" if len(kw) == 1 else "structured_outputs"
        found.append(_make(param, thinking, **kw))
    extra: dict[str, Any] = getattr(req, "model_extra", None) or {}
    for field, kind in _GUIDED.items():
        val = getattr(req, field, None) if field in type(req).model_fields else extra.get(field)
        if val is not None:
            found.append(_make(field, thinking, **{kind: val}))
    if len(found) > 1:
        raise bad_request(
            f"give one output constraint, not {len(found)} ({', '.join(p for _, p in found)})",
            param=found[1][1],
        )
    return found[0] if found else None


def tool_constraint(
    tools: list[dict], tool_choice, parallel: bool, thinking: bool
) -> StructuredOutputsParams | None:
    """The tool-call section constraint for tool_choice required / named / auto with a
    `strict: true` tool; None when the output is free."""
    try:
        so = _tool_constraint(tools, tool_choice, parallel, thinking)
    except ValueError as e:  # a tool schema the grammar engine cannot enforce
        raise bad_request(f"tools: {e}", param="tools") from None
    if so is not None:
        so.source = "tools"
    return so


def _tool_constraint(tools, tool_choice, parallel: bool, thinking: bool):
    so = None
    if tool_choice == "required":
        so = tool_call_constraint(tools, "required", parallel=parallel, thinking=thinking)
    elif not isinstance(tool_choice, str):  # NamedToolChoice
        so = tool_call_constraint(tools, "named", name=tool_choice.function.name, thinking=thinking)
    elif tool_choice == "auto" and any(t["function"].get("strict") for t in tools):
        so = tool_call_constraint(tools, "auto", parallel=parallel, thinking=thinking)
    return so


def _compile(engine, so: StructuredOutputsParams) -> None:
    try:
        engine.check_structured_outputs(so)
    except ValueError as e:
        raise bad_request(str(e), param=so.source) from None


async def check_compiles(state, params) -> None:
    """Compile the request's constraint, if any, on a worker thread (a large schema takes tens
    of ms; the event loop keeps streaming meanwhile) and cache it for the engine, so a bad
    schema is a 400 that names its field."""
    so = getattr(params, "structured_outputs", None)
    if so is not None:
        await asyncio.to_thread(_compile, state.engine, so)
