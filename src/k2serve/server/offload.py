"""CPU-heavy request work (tokenizing, chat template rendering, detokenizing) off the event loop.

Owns: `CpuPool`, a small thread pool the handlers hand such work to, so one request with a huge
body cannot stall /health, streaming tokens or any other request.

Invariants:
- At most `max_workers` such jobs run at once (the rest wait in the pool's queue), so a burst
  of abusive requests costs bounded CPU; each job is bounded by the request body limit.
- Exceptions (an `APIError` for a bad request) propagate to the awaiting handler unchanged.
- A handler cancelled while its job runs (client gone) does not kill the thread; the job
  finishes and its result is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.exceptions import HTTPException
from pydantic import BaseModel

T = TypeVar("T")


def default_workers() -> int:
    return max(2, min(8, os.cpu_count() or 2))


class CpuPool:
    def __init__(self, max_workers: int | None = None):
        self.max_workers = max_workers or default_workers()
        self._pool: ThreadPoolExecutor | None = None  # threads start on first use

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="k2serve-cpu")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


# A lone surrogate: `\ud800`-`\udfff` written as a JSON escape, or its (invalid) UTF-8 bytes,
# which Python's json decodes with "surrogatepass". A pair is one ordinary character.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class LoneSurrogate(HTTPException):
    """A request string with a lone surrogate: it cannot be encoded as UTF-8, so it could not
    be tokenized nor echoed back; a 400 naming the field (`param`)."""

    def __init__(self, param: str):
        super().__init__(
            400,
            f"{param or 'the body'} contains a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
            "that is not part of a pair), which is not valid Unicode text",
        )
        self.param = param or None


def _find_surrogate(value: Any, path: list[str]) -> list[str] | None:
    if isinstance(value, str):
        return path if _LONE_SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            if _LONE_SURROGATE.search(k):
                return [*path, "<key>"] if not path else path
            found = _find_surrogate(v, [*path, k])
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _find_surrogate(v, [*path, str(i)])
            if found is not None:
                return found
    return None


def parse_json(body: bytes, loads=json.loads) -> Any:
    """json.loads, refusing (LoneSurrogate, a 400) a body with a lone surrogate anywhere: one
    regex scan of the bytes, and a walk only when it finds a candidate."""
    value = loads(body)
    if _MAYBE_SURROGATE.search(body) is not None:
        path = _find_surrogate(value, [])
        if path is not None:
            raise LoneSurrogate(".".join(p for p in path if p != "<key>"))
    return value


def _parse_big(body: bytes, model: Any) -> Any:
    """A large body: parsed, then (for a route with a body model) validated, both in pieces so
    the event loop gets the GIL between pieces. Returns the model instance, which FastAPI then
    takes as already valid."""
    from k2serve.server.big_body import loads_in_pieces, validate_in_pieces

    value = parse_json(body, loads_in_pieces)
    return validate_in_pieces(model, value) if model is not None else value


# Bodies smaller than this are parsed in place: a thread hop costs more than the parse.
OFFLOAD_JSON_BYTES = 256 * 1024


def offload_json_route(pool: CpuPool):
    """An APIRoute class whose request bodies are JSON-parsed in `pool` when they are large, so
    a body near the size limit does not hold the event loop for the whole parse. Set it as
    `app.router.route_class` before adding routes."""
    from fastapi.routing import APIRoute
    from starlette.requests import Request

    class PoolJSONRequest(Request):
        body_model: Any = None  # the route's body model: a large body is validated here too

        async def json(self):
            if not hasattr(self, "_json"):
                body = await self.body()
                if len(body) < OFFLOAD_JSON_BYTES:
                    self._json = parse_json(body)
                else:  # parsed and validated in pieces in the pool (see server/big_body.py)
                    self._json = await pool.run(_parse_big, body, self.body_model)
            return self._json

    class PoolJSONRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()
            model = getattr(self.body_field, "type_", None) if self.body_field else None
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                model = None

            async def route_handler(request: Request):
                req = PoolJSONRequest(request.scope, request.receive)
                req.body_model = model
                return await handler(req)

            return route_handler

    return PoolJSONRoute
