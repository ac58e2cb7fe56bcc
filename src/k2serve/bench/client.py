"""One streamed OpenAI request -> `RequestOutcome` (timings, server usage, error kind).

Timing (all `time.perf_counter()` seconds):
- TTFT = first SSE event carrying generated text (content, reasoning, tool call or `text`) minus
  the moment the request is sent;
- ITL  = every gap between consecutive content-carrying events (a chunk may hold several tokens:
  the gap is still one ITL, as in vLLM);
- E2EL = end of stream (`data: [DONE]`) minus send.
Token counts are the last `usage` object the server sends (`stream_options.include_usage`);
without one, `completion_tokens` falls back to the number of content chunks and
`usage_reported` is False so every report can say so.

Error kinds: `http_<status>`, `timeout`, `connection` (could not connect / send), `disconnected`
(the stream broke or ended before completion), `stream_error` (an `error` object in the stream),
`bad_response` (not parseable as OpenAI JSON).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from k2serve.bench.datasets import SampleRequest


@dataclass
class RequestSpec:
    """What every request of a run shares."""

    url: str
    api: str  # "chat" | "completions"
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, ... as given
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0  # whole-request bound (connect + stream)
    warm_url: str | None = None  # GET once before timing (e.g. /v1/models); errors ignored


@dataclass
class RequestOutcome:
    index: int
    start: float = 0.0  # send time, seconds since the benchmark's start
    success: bool = False
    ttft: float | None = None  # seconds
    latency: float | None = None  # end-to-end seconds
    itls: list[float] = field(default_factory=list)  # seconds, one per gap between chunks
    chunk_times: list[float] = field(default_factory=list)  # content chunks, s since send
    num_chunks: int = 0  # content-carrying chunks
    prompt_tokens: int | None = None  # server usage
    completion_tokens: int | None = None  # server usage, or num_chunks when not reported
    usage_reported: bool = False
    prompt_len: int | None = None  # intended input length (workload), not a measurement
    output_len: int | None = None  # max_tokens asked for
    finish_reason: str | None = None
    error: str | None = None  # kind, see module docstring
    error_detail: str = ""


def build_payload(spec: RequestSpec, sample: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if spec.api == "chat":
        if isinstance(sample.prompt, str):
            body["messages"] = [{"role": "user", "content": sample.prompt}]
        else:
            body["messages"] = sample.prompt
    else:
        if not isinstance(sample.prompt, str):
            raise ValueError("chat messages in the workload need --api chat")
        body["prompt"] = sample.prompt
    if sample.output_len is not None:
        body["max_tokens"] = sample.output_len
    if spec.ignore_eos:
        body["ignore_eos"] = True
    body.update(spec.sampling)
    body.update(spec.extra_body)
    return body


def headers(spec: RequestSpec) -> dict[str, str]:
    h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if spec.api_key:
        h["Authorization"] = f"Bearer {spec.api_key}"
    return h


def _has_content(choice: dict) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or choice.get("message") or {}
    return bool(
        delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("reasoning")
        or delta.get("tool_calls")
    )


class _Stream:
    """Accumulates SSE events of one response into a RequestOutcome."""

    def __init__(self, out: RequestOutcome, t0: float):
        self.out, self.t0 = out, t0
        self.last: float | None = None
        self.done = False

    def event(self, data: str) -> None:
        out = self.out
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            raise _BadResponse(f"not JSON: {data[:200]!r}") from None
        if not isinstance(obj, dict):
            raise _BadResponse(f"not a JSON object: {data[:200]!r}")
        if "error" in obj and not obj.get("choices"):
            raise _StreamError(json.dumps(obj["error"])[:500])
        now = time.perf_counter()
        if any(_has_content(c) for c in obj.get("choices") or [] if isinstance(c, dict)):
            if self.last is None:
                out.ttft = now - self.t0
            else:
                out.itls.append(now - self.last)
            out.chunk_times.append(now - self.t0)
            out.num_chunks += 1
            self.last = now
        for c in obj.get("choices") or []:
            if isinstance(c, dict) and c.get("finish_reason"):
                out.finish_reason = c["finish_reason"]
        usage = obj.get("usage")
        if isinstance(usage, dict):
            out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
            out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
            out.usage_reported = True


class _BadResponse(Exception):
    pass


class _StreamError(Exception):
    pass


async def _stream_sse(resp: httpx.Response, st: _Stream) -> None:
    data_lines: list[str] = []
    async for line in resp.aiter_lines():
        if line == "":  # event boundary (SSE)
            if data_lines:
                st.event("\n".join(data_lines))
                data_lines = []
            if st.done:
                return
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            data_lines.append(value[1:] if value.startswith(" ") else value)
    if data_lines:  # stream ended without the trailing blank line
        st.event("\n".join(data_lines))


async def _send(
    client: httpx.AsyncClient, spec: RequestSpec, body: dict, out: RequestOutcome
) -> None:
    t0 = time.perf_counter()
    st = _Stream(out, t0)
    async with client.stream("POST", spec.url, json=body, headers=headers(spec)) as resp:
        if resp.status_code != 200:
            raw = await resp.aread()
            out.error = f"http_{resp.status_code}"
            out.error_detail = raw[:500].decode("utf-8", "replace")
            return
        ctype = resp.headers.get("content-type", "")
        if ctype.startswith("text/event-stream"):
            await _stream_sse(resp, st)
        else:  # a server that ignored stream=true: one JSON body
            raw = await resp.aread()
            st.event(raw.decode("utf-8", "replace"))
            st.done = True
    out.latency = time.perf_counter() - t0
    if not st.done and out.finish_reason is None:
        out.error = "disconnected"
        out.error_detail = "stream ended before [DONE] and without a finish_reason"
        return
    if out.ttft is None:
        out.ttft = out.latency  # nothing generated (e.g. max_tokens reached at once)
    if not out.usage_reported:
        out.completion_tokens = out.num_chunks
    out.success = True


async def send_request(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    sample: SampleRequest,
    index: int,
    t_bench0: float,
) -> RequestOutcome:
    """Send one request; never raises for server/network faults (they become `error`)."""
    out = RequestOutcome(index=index, prompt_len=sample.prompt_len, output_len=sample.output_len)
    body = build_payload(spec, sample)
    out.start = time.perf_counter() - t_bench0
    try:
        await asyncio.wait_for(_send(client, spec, body, out), timeout=spec.timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        out.error, out.error_detail = "timeout", f"{type(e).__name__}: {e}"[:500]
    except (httpx.ConnectError, httpx.WriteError) as e:
        out.error, out.error_detail = "connection", f"{type(e).__name__}: {e}"[:500]
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        out.error, out.error_detail = "disconnected", f"{type(e).__name__}: {e}"[:500]
    except _StreamError as e:
        out.error, out.error_detail = "stream_error", str(e)
    except (_BadResponse, httpx.DecodingError) as e:
        out.error, out.error_detail = "bad_response", str(e)[:500]
    except httpx.HTTPError as e:
        out.error, out.error_detail = "connection", f"{type(e).__name__}: {e}"[:500]
    if out.error is not None:
        out.success = False
        if out.latency is None:  # time until the failure (shown as "in flight" in the plot)
            out.latency = time.perf_counter() - t_bench0 - out.start
    return out
