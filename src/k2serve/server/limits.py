"""Request read limits: the body size limit and read deadlines for headers and body.

Owns: `read_body` (reads a whole request body under a size limit and a deadline, before any
parsing) and `uvicorn_http_protocol` (uvicorn's h11 protocol with a header deadline).

Why: h11 has no body timeout and uvicorn's `timeout_keep_alive` only runs between requests (and
any byte resets it), so a client that sends `Content-Length: 10` and two bytes, or half a header
line, held a connection (and, for a body, a request task) forever.

Invariants:
- A request's body is read completely (up to `max_bytes`) before the app sees it: a body over
  the limit is refused with 413 as soon as the limit is crossed, with or without Content-Length,
  on every endpoint; a body that has not fully arrived `timeout` seconds after its headers gets
  408. Both are OpenAI error JSON and the connection is closed (the rest of the body is unread).
- The header deadline starts when a connection opens (or a response completes, for the next
  request on a kept-alive connection) and ends when the request line and headers are complete;
  data that trickles in does not reset it. When it runs out the connection is closed.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import Message, Receive


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


async def read_body(receive: Receive, max_bytes: int, timeout: float | None) -> list[Message]:
    """The request's messages up to and including the body's last chunk, as one
    `http.request` message (plus an `http.disconnect` if the client left).

    Raises BodyTooLarge past `max_bytes`, BodyTimeout past `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise BodyTimeout()
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            raise BodyTimeout() from None
        if message["type"] != "http.request":  # http.disconnect: hand it on after the body
            body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return [body, message]
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]


def uvicorn_http_protocol(header_timeout: float):
    """uvicorn's H11Protocol, closing connections whose request headers take longer than
    `header_timeout` seconds. Pass as `uvicorn.Config(http=...)`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.debug("closing a connection whose request headers never arrived")
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # waiting for the next request on this connection

    return HeaderTimeoutH11Protocol
