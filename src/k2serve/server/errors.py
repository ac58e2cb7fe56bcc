"""OpenAI-style errors: one exception type, the JSON body, and the app's exception handlers.

Owns: the mapping from every failure to `{"error": {"message", "type", "param", "code"}}` with
the right HTTP status.

Invariants:
- No response ever carries a traceback: unexpected exceptions are logged here with their stack
  and answered with a generic 500 that names the request id only.
- Validation errors are 400 (as vLLM and OpenAI), with `param` naming the offending field.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k2serve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error to send to the client as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        from k2serve.server.finite import SafeJSONResponse

        return SafeJSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def stream_error(exc: Exception) -> APIError:
    """The error a stream sends as its last event when it fails after the response started
    (the status is already sent): the APIError as raised, else a 500 naming the class."""
    if isinstance(exc, APIError):
        return exc
    return APIError(500, f"internal error ({type(exc).__name__})")


def _is(exc: BaseException, name: str) -> bool:
    """Match the engine's error classes by name, so the server needs no engine import."""
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def engine_error(exc: Exception) -> APIError:
    """Translate what `AsyncLLMEngine.generate` / `SamplingParams` raise before queueing."""
    if isinstance(exc, APIError):
        return exc
    if _is(exc, "EngineDeadError"):
        return APIError(503, "the engine has stopped; see the server log", code="engine_dead")
    if _is(exc, "EngineQueueFull"):
        return APIError(
            429,
            f"the server is at capacity: {exc}",
            code="rate_limit_exceeded",
        )
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    raise exc


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "tuple", "set"}


def _split_loc(loc: tuple) -> tuple[list[str], list[str]]:
    """(path to the field, path inside one union branch), without "body" or pydantic's union tags.

    Pydantic names a failed union branch by its type ("str", "list[str]", "literal['a','b']",
    "NamedToolChoice") in the error's location; the client only knows the field names.
    """
    parts = [x for x in loc if x != "body"]
    for i, x in enumerate(parts):
        if isinstance(x, str) and (not _FIELD.fullmatch(x) or x in _TYPE_TAGS):
            inner = [
                str(y) for y in parts[i + 1 :] if not isinstance(y, str) or _FIELD.fullmatch(y)
            ]
            return [str(y) for y in parts[:i]], [y for y in inner if y not in _TYPE_TAGS]
    return [str(y) for y in parts], []


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    loc, _ = _split_loc(tuple(first.get("loc", ())))
    param = ".".join(loc) or None
    if loc and loc[0] == "prompt" and len(errs) > 1:
        return (
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            "prompt",
        )
    # The errors of one field: one per union branch when the field is a union.
    same = [e for e in errs if _split_loc(tuple(e.get("loc", ())))[0] == loc]
    reasons = []
    for e in same:
        msg = str(e.get("msg", "invalid value"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
            # whole-request checks (model validators) start their message with the field name
            m = re.match(r"([a-z_]+)\b", msg)
            if param is None and m:
                param = m.group(1)
        inner = _split_loc(tuple(e.get("loc", ())))[1]
        reason = f"{'.'.join(inner)}: {msg}" if inner else msg
        if reason not in reasons:
            reasons.append(reason)
    text = (
        reasons[0]
        if len(reasons) == 1
        else "no accepted form matched (" + "; or ".join(reasons) + ")"
    )
    parts = [f"{'.'.join(loc) or 'body'}: {text}"]
    if len(errs) > len(same):
        parts.append(f"(and {len(errs) - len(same)} more problem(s))")
    return " ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return APIError(400, msg, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        errors = getattr(exc, "errors", None)  # big_body.BodyInvalid: validated in the pool
        if isinstance(errors, list):
            msg, param = _validation_message(RequestValidationError(errors))
            return APIError(400, msg, param=param, code="invalid_value").response()
        msg = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        resp = APIError(exc.status_code, msg, param=getattr(exc, "param", None)).response()
        for name, value in (exc.headers or {}).items():  # 405 carries Allow (RFC 9110)
            resp.headers[name] = value
        return resp

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        from k2serve.server.access_log import printable

        logger.exception(
            "internal error on %s %s", printable(request.method), printable(request.url.path)
        )
        return APIError(
            500, f"internal server error ({type(exc).__name__}); see the server log"
        ).response()
