"""Tool checks the chat handler runs in the CPU pool (never on the event loop): each tool's
`parameters` against the JSON Schema meta-schema, and the names of tools the server must force.

Why here and not in the pydantic models: validation runs on the event loop, and checking 40k
tool schemas there blocked /health for 27 s. Each distinct schema is checked once (cached by
its JSON text), so 40k copies of one schema cost one check.
"""

from __future__ import annotations

import functools
import json

from k2serve.server import protocol

# what the Kimi tool-call dialect cannot write in `functions.NAME:IDX` (the name ends at ':',
# '<' / '>' would spell markers, control characters break the line); anything else is allowed
_BAD_TOOL_NAME_CHARS = frozenset("<>:") | {chr(c) for c in range(32)} | {"\x7f"}


_CACHED_SCHEMA_CHARS = 64 * 1024  # larger schemas are checked every time (memory bound)


def _check_schema_text(text: str) -> str | None:
    return _check_cached(text) if len(text) <= _CACHED_SCHEMA_CHARS else _check(text)


def _check(text: str) -> str | None:
    try:
        protocol.check_json_schema(json.loads(text))
    except ValueError as e:
        return str(e)
    return None


_check_cached = functools.lru_cache(maxsize=1024)(_check)


def check_tool_schemas(tools: list | None) -> None:
    """ValueError naming `tools.I.function.parameters` for the first tool whose parameters are
    not a valid JSON Schema. Each distinct schema is checked once (cached by its JSON text)."""
    for i, t in enumerate(tools or []):
        params = t.function.parameters
        if params is None:
            continue
        why = _check_schema_text(json.dumps(params, sort_keys=True))
        if why is not None:
            raise ToolSchemaError(f"tools.{i}.function.parameters", why)


class ToolSchemaError(ValueError):
    def __init__(self, param: str, why: str):
        super().__init__(f"{param}: {why}")
        self.param = param


def check_forced_tool_names(tools: list | None, names: list[str]) -> None:
    """ValueError naming `tools.I.function.name` when a tool the server must make the model
    call (tool_choice required / named) has a name the Kimi tool-call format cannot write.

    Under tool_choice auto such a name is only text in the prompt (it is rendered safely) and
    is left alone; OpenAI itself allows only [a-zA-Z0-9_-]{1,64}."""
    for i, t in enumerate(tools or []):
        name = t.function.name
        if name not in names:
            continue
        bad = sorted({c for c in name if c in _BAD_TOOL_NAME_CHARS})
        if bad:
            raise ToolSchemaError(
                f"tools.{i}.function.name",
                f"the function name {name!r} cannot be forced with tool_choice: the Kimi "
                f"tool-call format cannot write {', '.join(repr(c) for c in bad)} in a name "
                "(OpenAI allows [a-zA-Z0-9_-]{1,64})",
            )
