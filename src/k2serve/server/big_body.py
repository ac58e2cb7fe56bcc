"""Large request bodies parsed and validated in pieces, so the event loop keeps answering.

Owns: `loads_in_pieces(body)` (json.loads that parses each element of the top-level object's
arrays in its own call) and `validate_in_pieces(model, data)` (pydantic validation with each
model item of a long list field validated in its own call).

Why: the handlers run this work in the CPU pool, but json.loads and pydantic-core hold the GIL
for a whole call: a 30 MiB body of small tools cost one ~1 s parse and a ~3 s validation during
which the event loop (/health, streaming tokens) could not run. In pieces, the interpreter
switches threads between pieces (every few ms), so the loop waits at most about one piece.

Invariants:
- Same result as `json.loads` / `model.model_validate` (errors included: a JSONDecodeError
  with its position, a `pydantic.ValidationError` whose locations start at the body); when the
  piecewise parse meets anything unusual it falls back to `json.loads` on the whole body.
- A single huge element (one message with a million content parts) is still one call: the
  pieces are the elements of the top-level arrays (messages, tools, input items, prompts),
  which is where a large body's size is.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from fastapi.exceptions import HTTPException
from pydantic import BaseModel, ValidationError

_WS = " \t\n\r"
_DECODER = json.JSONDecoder()
_scanstring: Any = getattr(json.decoder, "scanstring")  # noqa: B009 (untyped in typeshed)
_MIN_PIECES = 64  # a list shorter than this is validated in one call


class _Fallback(Exception):
    pass


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def _expect(text: str, i: int, char: str) -> int:
    i = _skip(text, i)
    if i >= len(text) or text[i] != char:
        raise _Fallback()
    return i + 1


def _array(text: str, i: int) -> tuple[list, int]:
    out: list = []
    i = _skip(text, i + 1)
    if i < len(text) and text[i] == "]":
        return out, i + 1
    while True:
        value, i = _DECODER.raw_decode(text, _skip(text, i))
        out.append(value)
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] == "]":
            return out, i + 1
        else:
            raise _Fallback()


def _object(text: str, i: int) -> tuple[dict, int]:
    out: dict = {}
    i = _skip(text, i + 1)
    if i < len(text) and text[i] == "}":
        return out, i + 1
    while True:
        i = _skip(text, i)
        if i >= len(text) or text[i] != '"':
            raise _Fallback()
        key, i = _scanstring(text, i + 1)
        i = _skip(text, _expect(text, i, ":"))
        if i < len(text) and text[i] == "[":
            out[key], i = _array(text, i)
        else:
            out[key], i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
        elif i < len(text) and text[i] == "}":
            return out, i + 1
        else:
            raise _Fallback()


def loads_in_pieces(body: bytes) -> Any:
    """json.loads(body), each element of the top-level object's arrays parsed separately."""
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        i = _skip(text, 0)
        if i < len(text) and text[i] == "{":
            value, i = _object(text, i)
            if _skip(text, i) == len(text):
                return value
    except (_Fallback, ValueError, IndexError, UnicodeDecodeError):
        pass  # json.loads says what is wrong (or parses what this did not expect)
    return json.loads(body)


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """X for a field annotated `list[X]` (or `list[X] | None`) with X a pydantic model."""
    args = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = list(typing.get_args(annotation))
    for a in args:
        if typing.get_origin(a) is list:
            (item,) = typing.get_args(a) or (None,)
            if isinstance(item, type) and issubclass(item, BaseModel):
                return item
    return None


class BodyInvalid(HTTPException):
    """The body failed validation in the CPU pool: FastAPI passes an HTTPException through
    unchanged, and the app's handler words `errors` as a RequestValidationError's."""

    def __init__(self, errors: list[dict]):
        super().__init__(400, "invalid request body")
        self.errors = errors


def _at_body(errors: list, *prefix: Any) -> list[dict]:
    return [{**e, "loc": ("body", *prefix, *e["loc"])} for e in errors]


def validate_in_pieces(model: type[BaseModel], data: Any) -> BaseModel:
    """model.model_validate(data), the items of long model-list fields validated one by one;
    BodyInvalid (located errors, as FastAPI's) if it fails."""
    if isinstance(data, dict):
        data = dict(data)
        for name, field in model.model_fields.items():
            key = field.alias or name
            value = data.get(key)
            item = _list_item_model(field.annotation)
            if item is None or not isinstance(value, list) or len(value) < _MIN_PIECES:
                continue
            done = []
            for i, x in enumerate(value):
                try:
                    done.append(item.model_validate(x))
                except ValidationError as e:
                    raise BodyInvalid(_at_body(e.errors(), key, i)) from None
            data[key] = done
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BodyInvalid(_at_body(e.errors())) from None
