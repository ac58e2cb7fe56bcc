"""Turning one delimited tool call (raw id text, raw argument text) into a `ToolCall`.

Owns the output dataclasses and every per-call decision, shared by the whole-output and the
streaming parser so both report identical calls:

- **id**: returned as the model wrote it (stripped), e.g. `functions.get_weather:0`; an empty id
  becomes `functions.{name}:{index}`.
- **name**: the part before the first `:`, after the last `.` (`functions.x:0` and `x:0` -> `x`),
  unless the part after `functions.` is a declared tool's name (`functions.ns.x:0` -> `ns.x`).
  An id without `:` (`call00003`, `call_3`, `0`, `toolu_...`, or a bare `functions.x`) is
  resolved, in order: (1) the part after the last `.` if it is a declared tool; (2) with declared
  tools, the ONE tool whose parameter schema accepts the argument object, or the only declared
  tool - a warning says it was inferred (as sglang's Kimi-K2 detector does for client-style ids);
  (3) otherwise the part after the last `.` itself, with a warning (and `declared=False`). A
  well-delimited call is never dropped for its id: the client gets it, flagged, and can answer
  "unknown tool" (sglang drops it; a silent drop ends an agent turn with no call and no text).
  "Accepts" is full JSON Schema validation (the `jsonschema` library: required, types, enum,
  const, anyOf/oneOf/allOf, $ref/$defs, additionalProperties, boolean schemas...) plus one rule
  for inference only: every argument key must be a declared property, so a tool that declares
  no properties matches only `{}` (a permissive schema must not swallow every call). Ambiguity
  (two tools accept) resolves to no inference, never to the first tool listed.
- **arguments**: the JSON text as written (stripped). Empty arguments mean `{}`. Arguments given
  as a JSON *string* holding an object (`"{\\"a\\": 1}"`) are unwrapped to the inner JSON text.
  Arguments that are not a JSON object are **passed through unchanged** (as vLLM does, so the
  client sees what the model wrote) with `valid_arguments=False` and a warning; the server may
  turn that into an error or a retry. Nothing here raises on model output.
- **undeclared tools**: when `tools` is given and the name is not among them the call is kept
  with `declared=False` and a warning (the server chooses whether to reject it). `declared` is
  None when no tools were given.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object when valid_arguments
    valid_arguments: bool = True
    declared: bool | None = None  # None: no tools were declared
    warnings: list[str] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ParsedOutput:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    dropped_partial_call: bool = False  # truncated inside a call; that call was not reported


@dataclass
class DeltaMessage:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.reasoning_content and not self.content and not self.tool_calls


@dataclass(frozen=True)
class ToolSpec:
    name: str
    properties: frozenset[str] | None  # None: schema unknown (a bare name was given)
    required: frozenset[str]
    schema: Any = None  # the parameters JSON Schema (dict or bool); None: unknown
    validator: Any = field(default=None, compare=False, repr=False)


def normalize_tools(tools: Iterable[Any] | None) -> dict[str, ToolSpec] | None:
    """Declared tools by name, from names, OpenAI tool dicts or objects with `model_dump()`."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Iterable):
        raise TypeError(f"tools must be a list of tools or names, got {type(tools).__name__}")
    specs: dict[str, ToolSpec] = {}
    for tool in tools:
        if isinstance(tool, str):
            specs[tool] = ToolSpec(tool, None, frozenset())
            continue
        if isinstance(tool, ToolSpec):
            specs[tool.name] = tool
            continue
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        if not isinstance(tool, dict):
            raise TypeError(f"tools: expected a name or a tool dict, got {type(tool).__name__}")
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools: tool without a function name: {tool!r:.200}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        props = params.get("properties") if isinstance(params, dict) else None
        req = params.get("required") if isinstance(params, dict) else None
        req = req if isinstance(req, list) else []
        specs[name] = ToolSpec(
            name,
            frozenset(props) if isinstance(props, dict) else frozenset(),
            frozenset(r for r in req if isinstance(r, str)),
            params,
            _validator(params),
        )
    return specs


def _validator(schema: Any):
    """A jsonschema validator for a tool's parameters, or None when the schema is unusable
    (the tool then matches by keys only; a bad schema is the client's problem, not a crash)."""
    if not isinstance(schema, (dict, bool)):
        return None
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a declared dependency
        return None
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        return cls(schema)
    except Exception:  # SchemaError, unknown $schema...: no validation, keys only
        return None


def normalize_arguments(raw: str) -> tuple[str, Any, str | None]:
    """(arguments text, parsed object or None, problem or None) for raw argument text."""
    text = raw.strip()
    if not text:
        return "{}", {}, None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return text, None, f"arguments are not valid JSON ({e.msg} at char {e.pos})"
    if isinstance(obj, str):
        inner = obj.strip()
        try:
            inner_obj = json.loads(inner)
        except ValueError:
            inner_obj = None
        if isinstance(inner_obj, dict):
            return inner, inner_obj, None
        return text, None, "arguments are a JSON string that does not hold a JSON object"
    if not isinstance(obj, dict):
        return text, None, f"arguments are a JSON {type(obj).__name__}, not an object"
    return text, obj, None


def schema_accepts(spec: ToolSpec, args: Any) -> bool:
    """Whether `args` is a valid argument object for `spec` (JSON Schema validation)."""
    if not isinstance(args, dict):
        return False
    if spec.validator is not None:
        try:
            return spec.validator.is_valid(args)
        except Exception:  # an unresolvable $ref and the like: fall back to the keys
            pass
    return spec.required <= set(args)


def _accepts(spec: ToolSpec, args: Any) -> bool:
    """Inference: the schema accepts AND every key is a declared property (see the docstring)."""
    if not isinstance(args, dict) or spec.properties is None:
        return False
    return set(args) <= spec.properties and schema_accepts(spec, args)


def resolve_name(
    raw_id: str, args: Any, tools: dict[str, ToolSpec] | None
) -> tuple[str, str | None]:
    """(function name, warning or None) for a call id (see the module docstring)."""
    if ":" in raw_id:
        head = raw_id.split(":", 1)[0].strip()
        full = head.removeprefix("functions.")
        if tools is not None and full in tools:  # a declared name with dots (`ns.tool`)
            return full, None
        return head.rsplit(".", 1)[-1].strip(), None
    bare = raw_id.rsplit(".", 1)[-1].strip()
    if tools is not None and bare in tools:
        return bare, None
    if tools:
        fits = [s.name for s in tools.values() if _accepts(s, args)]
        if len(tools) == 1:
            fits = list(tools)
        if len(fits) == 1:
            return fits[0], f"id {raw_id!r} names no function; inferred {fits[0]!r} from the tools"
    if not bare:
        return "", f"id {raw_id!r} names no function"
    if raw_id.startswith("functions."):
        return bare, None
    return bare, f"id {raw_id!r} has no 'functions.NAME:IDX' form; using {bare!r} as the name"


def make_tool_call(
    raw_id: str, raw_args: str, index: int, tools: dict[str, ToolSpec] | None
) -> ToolCall | None:
    """The call for one delimited call, or None when it holds nothing at all (no id, no args)."""
    call_id = raw_id.strip()
    if not call_id and not raw_args.strip():
        return None
    arguments, obj, problem = normalize_arguments(raw_args)
    name, warning = resolve_name(call_id, obj, tools)
    warnings = [w for w in (warning, problem) if w]
    if not call_id:
        call_id = f"functions.{name}:{index}"
    declared = None if tools is None else name in tools
    if declared is False:
        warnings.append(f"tool {name!r} is not among the declared tools")
    return ToolCall(call_id, name, arguments, problem is None, declared, warnings)
