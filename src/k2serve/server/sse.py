"""Server-sent events and client-disconnect handling.

Owns: `SSEResponse` (streams `data: ...` events and closes its generator however the stream
ends) and `cancel_on_disconnect` (runs a non-streaming handler and cancels it when the client
goes away).

Invariants:
- The event generator is always closed (`aclose`) before the response returns, so its
  `finally` blocks (which abort engine requests and free their pages) always run.
- Cancellation uses plain asyncio tasks (edge-triggered), so cleanup code may still await.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str] | None = None):
        self.events = events
        self.status_code = 200
        self.background = None
        hdrs = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        hdrs.update(headers or {})
        self.init_headers(hdrs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        listen_task = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, listen_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_task, listen_task):
                t.cancel()
            await asyncio.gather(pump_task, listen_task, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
        if not pump_task.cancelled() and pump_task.exception() is not None:
            exc = pump_task.exception()
            if not isinstance(exc, OSError):  # OSError = the client went away mid-send
                raise exc


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
