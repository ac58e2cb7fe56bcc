"""SSE parsing corner cases through httpx.MockTransport (no sockets)."""

from __future__ import annotations

import asyncio
import json

import httpx

from k2serve.bench.client import RequestSpec, send_request
from k2serve.bench.datasets import SampleRequest


def _send(body: bytes, ctype: str = "text/event-stream", api: str = "chat"):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": ctype}, content=body)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            spec = RequestSpec("http://127.0.0.1/v1/chat/completions", api, "m")
            return await send_request(c, spec, SampleRequest("hi", 1, 4), 0, 0.0)

    return asyncio.run(go())


def _ev(obj) -> str:
    return "data: " + json.dumps(obj)


def _delta(text, finish=None):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def test_comments_crlf_multiline_and_empty_deltas():
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    multi = json.dumps(_delta("b")).replace(", ", ",\ndata: ")  # one event over several lines
    body = "\r\n\r\n".join(
        [
            ": keep-alive comment",
            _ev({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),  # no content
            _ev(_delta("a")),
            "data: " + multi,
            "data:" + json.dumps(_delta("c", "stop")),  # no space after the colon
            _ev(usage),
            "data: [DONE]",
            "",
        ]
    ).encode()
    o = _send(body)
    assert o.success, o.error_detail
    assert o.num_chunks == 3 and len(o.itls) == 2
    assert (o.prompt_tokens, o.completion_tokens, o.usage_reported) == (9, 3, True)
    assert o.finish_reason == "stop"


def test_reasoning_and_tool_calls_count_as_output():
    body = "\n\n".join(
        [
            _ev({"choices": [{"delta": {"reasoning_content": "think"}}]}),
            _ev({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "x"}]}}]}),
            _ev({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
            "data: [DONE]",
            "",
        ]
    ).encode()
    o = _send(body)
    assert o.success and o.num_chunks == 2 and not o.usage_reported
    assert o.completion_tokens == 2  # labelled fallback: chunks


def test_stream_without_done_or_finish_is_disconnected():
    o = _send(("\n\n".join([_ev(_delta("a")), _ev(_delta("b"))]) + "\n\n").encode())
    assert not o.success and o.error == "disconnected"


def test_garbage_is_a_bad_response():
    o = _send(b"data: {oops\n\n")
    assert o.error == "bad_response"


def test_server_that_ignores_stream_true():
    whole = {
        "choices": [{"message": {"content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 5},
    }
    o = _send(json.dumps(whole).encode(), ctype="application/json")
    assert o.success and o.completion_tokens == 5 and o.ttft is not None
    assert o.itls == []
