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
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from k2serve.server.access_log import DISCONNECT_SCOPE_KEY
from k2serve.server.finite import dumps_utf8


def sse_event(obj: Any) -> str:
    return f"data: {dumps_utf8(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class SSEResponse(Response):
    """Streams `events`; ends early on client disconnect or when `stop` is set (drain timeout),
    in which case the client gets an error event and `[DONE]` instead of a cut connection."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        stop: asyncio.Event | None = None,
        headers: dict[str, str] | None = None,
    ):
        self.events = events
        self.stop = stop
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
        tasks: list[asyncio.Future[Any]] = [pump_task, listen_task]
        if self.stop is not None:
            tasks.append(asyncio.ensure_future(self.stop.wait()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped = len(tasks) == 3 and tasks[2].done() and not pump_task.done()
            disconnected = listen_task.done()
            if disconnected and not pump_task.done():
                scope[DISCONNECT_SCOPE_KEY] = True  # for the access log
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
        if stopped and not disconnected:
            err = {"error": {"message": "the server is shutting down (drain timeout reached)",
                             "type": "service_unavailable_error", "param": None,
                             "code": "shutting_down"}}  # fmt: skip
            for chunk in (sse_event(err), SSE_DONE):
                await send(
                    {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if not pump_task.cancelled() and pump_task.exception() is not None:
            exc = pump_task.exception()
            if isinstance(exc, OSError):  # the client went away
                scope[DISCONNECT_SCOPE_KEY] = True
            elif exc is not None:
                raise exc


class ServerStopping(Exception):
    """The drain timeout ran out before the response was ready."""


async def cancel_on_disconnect(
    request: Request, work: Awaitable[Any], stop: asyncio.Event | None = None
) -> Any:
    """Await `work`; cancel it and raise ClientDisconnected if the client disconnects first, or
    ServerStopping if `stop` is set first."""
    task = asyncio.ensure_future(work)
    others: list[asyncio.Future[Any]] = [asyncio.ensure_future(_wait_disconnect(request.receive))]
    if stop is not None:
        others.append(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait([task, *others], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        for t in others:
            t.cancel()
        await asyncio.gather(task, *others, return_exceptions=True)
    if task.cancelled():
        if stop is not None and stop.is_set():
            raise ServerStopping()
        raise ClientDisconnected()
    return task.result()
