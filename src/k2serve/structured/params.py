"""What a request asks its output to match (vLLM's `StructuredOutputsParams`, same field names).

Owns: the request-side description of a constraint and its shape checks. Compiling it into a
grammar is `GrammarBackend.compile`.

Invariants:
- Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag` is set;
  anything else raises `ValueError` naming the fields.
- `key()` is a canonical string of the constraint (the compile cache key): equal constraints
  have equal keys whatever the dict order of a schema.
- `after_reasoning` / `open_on_tool_section` say where the constraint starts in the output (see
  `GrammarState`); they are set by the server from the chat template's thinking mode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | bool | None = None  # a JSON schema (dict, bool or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar and vLLM accept)
    json_object: bool | None = None  # any JSON object (OpenAI response_format json_object)
    structural_tag: str | dict | None = None  # an xgrammar structural tag (JSON text or dict)
    # Where the constraint starts. after_reasoning: after the model's `</think>` (thinking on);
    # open_on_tool_section: also at a `<|tool_calls_section_begin|>` written while reasoning.
    after_reasoning: bool = False
    open_on_tool_section: bool = False
    # the request field it came from (for error messages); not part of the constraint
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if self._is_set(k)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(
                f"the JSON schema must be an object or a boolean, got {type(self.json).__name__}"
            )
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = json.loads(self.structural_tag)
            except json.JSONDecodeError as e:
                raise ValueError(f"structural_tag is not valid JSON: {e}") from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise ValueError("structural_tag must be a JSON object")

    def _is_set(self, k: str) -> bool:
        v = getattr(self, k)
        return bool(v) if k == "json_object" else v is not None

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if self._is_set(k))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def key(self) -> str:
        return json.dumps([self.kind, self.value], sort_keys=True, ensure_ascii=False)
