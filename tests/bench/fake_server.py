"""A small fake OpenAI server (raw asyncio HTTP/1.1, chunked SSE) with injected, known behaviour.

It runs on its own event loop in a thread on a random 127.0.0.1 port. Per request it waits
`ttft_s`, then sends the completion tokens `tokens_per_chunk` at a time, `itl_s` apart, then a
usage chunk (unless `send_usage=False`) and `data: [DONE]`.

Known truths for the tests: prompt_tokens = tokens_per_word x the whitespace-separated words of
the prompt (plus CHAT_OVERHEAD for chat), completion_tokens = max_tokens (or `default_tokens`).
Faults by arrival index (0-based): "429", "500", "disconnect" (close the socket mid-stream),
"hang" (never answer), "error_event" (an error object in the stream).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

CHAT_OVERHEAD = 3


@dataclass
class Behavior:
    ttft_s: float = 0.2
    itl_s: float = 0.02
    default_tokens: int = 16
    tokens_per_chunk: int = 1
    send_usage: bool = True
    faults: dict[int, str] = field(default_factory=dict)
    model: str = "fake-model"
    api_key: str | None = None
    tokens_per_word: int = 1
    check_model: bool = False  # 404 for another model name, as vLLM / k2serve


class FakeOpenAIServer:
    def __init__(self, behavior: Behavior | None = None):
        self.behavior = behavior or Behavior()
        self.arrivals: list[float] = []  # perf_counter of each POST, in arrival order
        self.bodies: list[dict] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> FakeOpenAIServer:
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", 0)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            pending = asyncio.all_tasks(self._loop)  # e.g. a "hang" handler
            for t in pending:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._server.close()
            self._loop.run_until_complete(self._server.wait_closed())
            self._loop.close()

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- HTTP -----------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if not line:
                return
            method, path, _ = line.decode().split(" ", 2)
            headers = {}
            while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = h.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            await self._route(method, path, headers, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _respond(writer, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        reason = {200: "OK", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests"}
        writer.write(
            f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    @staticmethod
    async def _chunk(writer, payload: str) -> None:
        data = payload.encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def _route(self, method, path, headers, body, writer) -> None:
        b = self.behavior
        if b.api_key and headers.get("authorization") != f"Bearer {b.api_key}":
            await self._respond(writer, 401, {"error": {"message": "bad key"}})
            return
        if method == "GET" and path == "/v1/models":
            await self._respond(writer, 200, {"object": "list", "data": [{"id": b.model}]})
            return
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            await self._respond(writer, 404, {"error": {"message": f"no route {path}"}})
            return
        index = len(self.arrivals)
        self.arrivals.append(time.perf_counter())
        req = json.loads(body)
        self.bodies.append(req)
        if b.check_model and req.get("model") != b.model:
            msg = f"The model `{req.get('model')}` does not exist."
            await self._respond(writer, 404, {"error": {"message": msg, "code": 404}})
            return
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            await self._generate(index, path, req, writer)
        finally:
            self._in_flight -= 1

    async def _generate(self, index: int, path: str, req: dict, writer) -> None:
        b = self.behavior
        fault = b.faults.get(index)
        if fault in ("429", "500"):
            await self._respond(writer, int(fault), {"error": {"message": f"injected {fault}"}})
            return
        if fault == "hang":
            await asyncio.sleep(3600)
        chat = path.endswith("chat/completions")
        if chat:
            text = " ".join(str(m.get("content", "")) for m in req["messages"])
            prompt_tokens = len(text.split()) * b.tokens_per_word + CHAT_OVERHEAD
        else:
            prompt_tokens = len(req["prompt"].split()) * b.tokens_per_word
        n = int(req.get("max_tokens") or b.default_tokens)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        start = time.perf_counter()
        await asyncio.sleep(b.ttft_s)
        sent = 0
        k = 0
        while sent < n:
            if k > 0:
                # Sleep to an absolute schedule so that jitter does not accumulate.
                await asyncio.sleep(max(0.0, start + b.ttft_s + k * b.itl_s - time.perf_counter()))
            m = min(b.tokens_per_chunk, n - sent)
            text = " tok" * m
            choice = {"index": 0, "finish_reason": "length" if sent + m == n else None}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            await self._chunk(writer, "data: " + json.dumps({"choices": [choice]}) + "\n\n")
            sent += m
            k += 1
            if fault == "disconnect" and sent >= n // 2:
                writer.transport.abort()  # mid-stream, no terminating chunk
                return
            if fault == "error_event" and sent >= n // 2:
                err = {"error": {"message": "injected", "code": 500}}
                await self._chunk(writer, "data: " + json.dumps(err) + "\n\n")
                break
        if b.send_usage and (req.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "total_tokens": prompt_tokens + n,
            }
            await self._chunk(
                writer, "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            )
        await self._chunk(writer, "data: [DONE]\n\n")
        await self._chunk(writer, "")  # terminating zero-length chunk


def _main() -> None:
    """`python tests/bench/fake_server.py --port 8100 --ttft-ms 200 --itl-ms 20` (Ctrl-C stops)."""
    import argparse

    p = argparse.ArgumentParser(description="fake OpenAI server with injected delays")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--ttft-ms", type=float, default=200.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    a = p.parse_args()
    b = Behavior(
        ttft_s=a.ttft_ms / 1000, itl_s=a.itl_ms / 1000, tokens_per_chunk=a.tokens_per_chunk
    )

    async def serve() -> None:
        srv = FakeOpenAIServer(b)
        server = await asyncio.start_server(srv._handle, "127.0.0.1", a.port)
        print(f"fake OpenAI server on http://127.0.0.1:{a.port}", flush=True)
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    _main()
