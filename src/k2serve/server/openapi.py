"""The OpenAPI document at /openapi.json, made true to what the server sends.

Owns: `install_openapi(app, api_key_required)`, which post-processes FastAPI's generated
document once (then caches it):
- validation errors are 400 with OpenAI error JSON (FastAPI documents 422, which the server
  never sends); the other error statuses a route can answer are listed with the same schema;
- /health answers 200 with an empty body, /metrics answers text/plain;
- chat and text completions answer JSON, or `text/event-stream` when `stream` is true;
- the JSON routes name their response schema (the models in protocol.py), so a client (or a
  schema-driven fuzzer) can check every response against the document.

Invariants:
- Routes this module does not know still lose the 422 and gain the 400 / 401 / 500 entries.
- Only documentation changes here; no route behaves differently.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from k2serve.server.auth import OPEN_PATHS
from k2serve.server.protocol import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)

_REASONS = {
    400: "Invalid request (OpenAI error JSON; `param` names the field)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    408: "The request body did not arrive in time",
    413: "Request body over the size limit",
    429: "The server is at capacity",
    500: "Internal error (no details are leaked)",
    503: "Shutting down, or the engine has stopped",
}
# One server-sent event: `data:` is a chunk's JSON (or an error's), the last one `[DONE]`.
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "description": "with `stream: true`: `data: <chunk JSON>` events, then `data: [DONE]`",
            "properties": {"data": {"type": "string"}},
            "required": ["data"],
        },
    }
}
# path -> (response model of a 200, extra statuses the route can answer)
_ROUTES: dict[str, tuple[type[BaseModel] | None, tuple[int, ...]]] = {
    "/v1/chat/completions": (ChatCompletionResponse, (404, 429)),
    "/v1/completions": (CompletionResponse, (404, 429)),
    "/v1/models": (ModelList, ()),
    "/v1/models/{model_id}": (ModelCard, (404,)),
    "/tokenize": (TokenizeResponse, (404,)),
    "/detokenize": (DetokenizeResponse, (404,)),
    "/v1/responses": (None, (404, 429)),
    "/v1/responses/{response_id}": (None, (404,)),
}
_STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _add_schema(schemas: dict, model: type[BaseModel]) -> dict:
    schema = model.model_json_schema(
        ref_template="#/components/schemas/{model}", mode="serialization"
    )
    for name, sub in schema.pop("$defs", {}).items():
        schemas.setdefault(name, sub)
    schemas.setdefault(model.__name__, schema)
    return _ref(model.__name__)


def _error(status: int) -> dict:
    return {
        "description": _REASONS.get(status, "Error"),
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    }


def fix_document(doc: dict[str, Any], api_key_required: bool) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _add_schema(schemas, ErrorResponse)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            statuses = {500, 503}  # 503: while draining, or once the engine has stopped
            if "requestBody" in op:
                statuses.update((400, 408, 413))
            if api_key_required and path not in OPEN_PATHS:
                statuses.add(401)
            model, extra = _ROUTES.get(path, (None, ()))
            statuses.update(extra)
            ok = responses.setdefault("200", {"description": "Successful Response"})
            if model is not None:
                ok["content"] = {"application/json": {"schema": _add_schema(schemas, model)}}
            if path in _STREAMING:
                ok.setdefault("content", {}).update(_SSE)
            if path == "/health":
                ok["description"] = "Healthy (empty body)"
                ok.pop("content", None)
            elif path == "/metrics":
                ok["description"] = "Prometheus metrics"
                ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
            elif path == "/version":
                ok["content"] = {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {"version": {"type": "string"}},
                            "required": ["version"],
                        }
                    }
                }
            for status in sorted(statuses):
                responses.setdefault(str(status), _error(status))
    return doc


def install_openapi(app: FastAPI, api_key_required: bool) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = fix_document(generate(), api_key_required)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
