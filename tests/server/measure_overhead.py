"""What the HTTP layer costs: the server over a zero-delay fake engine, measured on loopback.

Run: `.venv/bin/python -m tests.server.measure_overhead` (prints a markdown table row set).
The engine side is free (FakeAsyncEngine, delay=0), so the figures are the server's ceiling:
tokenize + template + SSE + JSON + uvicorn, per request and per streamed token.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

from k2serve.server.app import build_app

from .conftest import ServerThread
from .fakes import FakeAsyncEngine


async def _stream(client: httpx.AsyncClient, max_tokens: int) -> tuple[float, int]:
    body = {
        "messages": [{"role": "user", "content": "count"}],
        "stream": True,
        "max_tokens": max_tokens,
        "chat_template_kwargs": {"thinking": False},
    }
    t0 = time.perf_counter()
    n = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                n += 1
    return time.perf_counter() - t0, n


async def _small(client: httpx.AsyncClient) -> float:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0


async def main(url: str) -> None:
    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=httpx.Limits(max_connections=200)
    ) as c:
        await _small(c)
        lat = [await _small(c) for _ in range(200)]
        print(f"| 1-token chat request, sequential | p50 {statistics.median(lat) * 1e3:.2f} ms |")
        for conc in (1, 32):
            t0 = time.perf_counter()
            res = await asyncio.gather(*(_stream(c, 256) for _ in range(conc)))
            dt = time.perf_counter() - t0
            chunks = sum(n for _, n in res)
            print(f"| {conc} concurrent stream(s) x 256 tokens | {chunks / dt:,.0f} chunks/s |")


def run() -> None:
    engine = FakeAsyncEngine(delay=0, max_model_len=4096, max_num_seqs=64)
    with ServerThread(build_app(engine, served_model_names=["fake"])) as srv:
        asyncio.run(main(srv.url))


if __name__ == "__main__":
    run()
