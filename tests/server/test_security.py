"""Issue #16: what an outsider can do to the server (fake engine, real HTTP over uvicorn).

Each test here failed before its fix: keys on every non-probe route, body limits, CPU-heavy
work off the event loop, role injection through special-token strings, NaN in JSON, body read
timeouts, JSON Schema checks, strict token ids and an OpenAPI document true to the server.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from k2serve.server.app import build_app

from .conftest import ServerThread
from .fakes import FakeAsyncEngine, FakeTokenizer
from .helpers import _err, _msgs, _post


class SlowTokenizer(FakeTokenizer):
    """Encoding or rendering a text with "SLOW" in it takes `seconds` of blocking work."""

    def __init__(self, seconds: float = 2.5):
        super().__init__()
        self.seconds = seconds

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        if "SLOW" in text:
            time.sleep(self.seconds)  # blocking, as a real tokenizer on a huge input is
        return super().encode(text, allow_special)


@pytest.fixture(scope="module")
def slow_server():
    eng = FakeAsyncEngine()
    eng.tokenizer = SlowTokenizer()
    app = build_app(eng, served_model_names=["fake-k2"], api_key="sk-test")
    with ServerThread(app) as srv:
        srv.engine = eng
        yield srv


# ------------------------------------------------------------------------------------------
# 1. keys, body limits, CPU-heavy work off the event loop


def test_tokenize_and_detokenize_need_the_key(fake_server):
    r = httpx.post(fake_server.url + "/tokenize", json={"prompt": "ab " * 10})
    assert _err(r, 401)["code"] == "invalid_api_key"
    r = httpx.post(fake_server.url + "/detokenize", json={"tokens": [20, 21]})
    _err(r, 401)
    r = httpx.post(
        fake_server.url + "/tokenize", json={"prompt": "ab"}, headers={"Authorization": "Bearer x"}
    )
    _err(r, 401)
    assert _post(fake_server, "/tokenize", {"prompt": "ab"}).status_code == 200
    assert _post(fake_server, "/detokenize", {"tokens": [20, 21]}).status_code == 200
    # unknown routes are not a way around the key either
    _err(httpx.post(fake_server.url + "/tokenize/", json={}), 401)
    # the probes stay open
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(fake_server.url + path).status_code == 200, path


def test_unauthenticated_body_is_not_read(fake_server):
    """An unauthenticated client cannot make the server read (or parse) a big body."""
    r = httpx.post(fake_server.url + "/tokenize", content=b"x" * 200_000)
    _err(r, 401)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/chat/completions"])
def test_same_body_limit_on_every_endpoint(fake_server, path):
    body = b'{"prompt": "' + b"a" * 70_000 + b'"}'
    hdrs = {"Authorization": "Bearer sk-test", "content-type": "application/json"}
    e = _err(httpx.post(fake_server.url + path, content=body, headers=hdrs), 413)
    assert e["code"] == "request_too_large" and "65536" in e["message"]

    def chunked():  # no Content-Length: the limit applies while the body streams in
        for _ in range(20):
            yield b" " * 8192

    _err(httpx.post(fake_server.url + path, content=chunked(), headers=hdrs), 413)


def _health_latency_during(srv, path: str, body: dict) -> tuple[float, int]:
    """Start `body` on `path` in a thread; time a /health call made while it runs."""
    result = {}

    def slow():
        result["status"] = _post(srv, path, body).status_code

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)  # the slow request is now inside the tokenizer
    t0 = time.monotonic()
    r = httpx.get(srv.url + "/health", timeout=10)
    took = time.monotonic() - t0
    assert r.status_code == 200
    t.join(timeout=30)
    return took, result["status"]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/tokenize", {"prompt": "SLOW " * 100}),
        ("/tokenize", {"messages": _msgs("SLOW")}),
        ("/v1/completions", {"prompt": "SLOW", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": _msgs("SLOW"), "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": _msgs("SLOW"), "max_tokens": 2, "stream": True}),
    ],
)
def test_health_answers_while_a_big_tokenize_runs(slow_server, path, body):
    took, status = _health_latency_during(slow_server, path, body)
    assert status == 200
    assert took < 1.0, f"/health took {took:.2f}s while {path} was tokenizing"
