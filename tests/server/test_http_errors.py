"""The HTTP layer against the fake engine: errors, client disconnects, draining, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from k2serve.server.app import build_app

from .conftest import ServerThread
from .fakes import FakeAsyncEngine
from .helpers import WEATHER_TOOL, _err, _msgs, _post


def test_errors_400(fake_server):
    e = _err(
        _post(
            fake_server,
            "/v1/chat/completions",
            {"model": "fake-k2", "messages": _msgs(), "temperature": 7},
        ),
        400,
    )
    assert e["param"] == "temperature" and e["type"] == "invalid_request_error"
    e = _err(_post(fake_server, "/v1/chat/completions", {"model": "fake-k2", "messages": []}), 400)
    assert e["param"] == "messages"
    e = _err(
        _post(
            fake_server, "/v1/chat/completions", {"messages": _msgs(), "tool_choice": "required"}
        ),
        400,
    )
    assert "tools" in e["message"]
    e = _err(_post(fake_server, "/v1/completions", {"prompt": [10**9], "max_tokens": 2}), 400)
    assert "vocabulary" in e["message"]
    r = httpx.post(
        fake_server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": "Bearer sk-test", "content-type": "application/json"},
    )
    assert "JSON" in _err(r, 400)["message"]
    e = _err(
        _post(
            fake_server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        ),
        400,
    )
    assert "image_url" in e["message"]


def test_error_context_length_gives_numbers(fake_server):
    long = "x" * 600  # 600 prompt tokens > max_model_len 512
    e = _err(_post(fake_server, "/v1/completions", {"prompt": long, "max_tokens": 2}), 400)
    assert "512" in e["message"] and "600" in e["message"]
    assert e["code"] == "context_length_exceeded"
    e = _err(_post(fake_server, "/v1/completions", {"prompt": "x" * 500, "max_tokens": 100}), 400)
    assert "512" in e["message"] and "600" in e["message"] and "100" in e["message"]
    e = _err(_post(fake_server, "/v1/chat/completions", {"messages": _msgs("y" * 700)}), 400)
    assert "512" in e["message"]


def test_errors_401_404_413(fake_server):
    r = httpx.get(fake_server.url + "/v1/models")
    assert _err(r, 401)["code"] == "invalid_api_key"
    r = httpx.get(fake_server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    _err(r, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=fake_server.url + "/v1", api_key="wrong", max_retries=0
        ).models.list()
    e = _err(
        _post(fake_server, "/v1/chat/completions", {"model": "gpt-4", "messages": _msgs()}), 404
    )
    assert e["param"] == "model" and "gpt-4" in e["message"]
    e = _err(_post(fake_server, "/v1/completions", {"prompt": "a" * 70000}), 413)
    assert "limit" in e["message"]

    def chunked():
        for _ in range(20):
            yield b" " * 8192

    r = httpx.post(
        fake_server.url + "/v1/completions",
        content=chunked(),
        headers={"Authorization": "Bearer sk-test"},
    )
    _err(r, 413)
    _err(httpx.get(fake_server.url + "/nope", headers={"Authorization": "Bearer sk-test"}), 404)
    _err(httpx.get(fake_server.url + "/nope"), 401)  # unknown paths need the key too


def test_error_500_has_no_traceback(fake_server, monkeypatch):
    async def broken(*a, **k):
        raise RuntimeError("secret internal detail")
        yield

    monkeypatch.setattr(fake_server.engine, "generate", broken)
    e = _err(_post(fake_server, "/v1/chat/completions", {"messages": _msgs()}), 500)
    assert "secret" not in e["message"]


def test_error_429_when_queue_full(fake_server, monkeypatch):
    monkeypatch.setattr(fake_server.engine, "max_waiting", 0)
    e = _err(_post(fake_server, "/v1/chat/completions", {"messages": _msgs()}), 429)
    assert e["type"] == "rate_limit_error"
    r = _post(fake_server, "/v1/chat/completions", {"messages": _msgs(), "stream": True})
    _err(r, 429)


# ------------------------------------------------------------------------------------------
# Disconnects


def test_nonstreaming_disconnect_aborts(fake_server):
    eng = fake_server.engine
    before = len(eng.aborted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            fake_server.url + "/v1/completions",
            json={"prompt": "forever", "max_tokens": 400},
            headers={"Authorization": "Bearer sk-test"},
            timeout=0.3,
        )
    for _ in range(100):
        if len(eng.aborted) > before and not eng.live:
            break
        time.sleep(0.05)
    assert len(eng.aborted) == before + 1
    assert eng.live == {}


def test_64_streams_random_disconnects_free_everything(fake_server):
    eng = fake_server.engine
    before = len(eng.aborted)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"messages": _msgs("count" if i % 2 else "Hi"), "stream": True, "max_tokens": 120}
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            n = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if i % 3 == 0 and n == 2 + i % 5:
                        return "left"
                    if line == "data: [DONE]":
                        return "done"
        return "eof"

    async def main():
        async with httpx.AsyncClient(
            base_url=fake_server.url,
            timeout=60,
            headers={"Authorization": "Bearer sk-test"},
            limits=httpx.Limits(max_connections=100),
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(main())
    assert results.count("left") == 22 and results.count("done") == 42
    for _ in range(200):
        if not eng.live and eng.running == 0 and eng.waiting == 0:
            break
        time.sleep(0.05)
    assert eng.live == {} and eng.running == 0 and eng.waiting == 0
    assert len(eng.aborted) - before == 22
    text = httpx.get(fake_server.url + "/metrics").text
    assert "k2serve:kv_cache_used_pages 0.0" in text
    assert "k2serve:num_requests_running 0.0" in text
    assert httpx.get(fake_server.url + "/health").status_code == 200


def test_more_400s(fake_server):
    cases = [
        ({"messages": _msgs(), "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"messages": _msgs(), "n": 0}, "n"),
        ({"messages": _msgs(), "top_logprobs": 3}, None),
        ({"messages": _msgs(), "response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "messages": _msgs(),
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            None,
        ),
    ]
    for body, param in cases:
        e = _err(_post(fake_server, "/v1/chat/completions", body), 400)
        if param is not None:
            assert e["param"] == param, (body, e)
    ok = _post(
        fake_server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}],
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "top_k": 5,
            "seed": 1,
            "user": "someone",
            "unknown_future_field": 1,
        },
    )
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": _msgs(), "stream": True}),
        ("/v1/completions", {"prompt": "Hi", "stream": True, "max_tokens": 16}),
        ("/v1/responses", {"input": "Hi", "stream": True}),
    ],
)
def test_mid_stream_failure_sends_error_event(fake_server, monkeypatch, path, body):
    real_run = fake_server.engine._run

    async def failing(prompt_ids, params, request_id):
        k = 0
        async for out in real_run(prompt_ids, params, request_id):
            yield out
            k += 1
            if k == 3:
                raise RuntimeError("boom with secret")

    monkeypatch.setattr(fake_server.engine, "_run", failing)
    r = _post(fake_server, path, body)
    assert r.status_code == 200
    events = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    if path == "/v1/responses":  # its own event stream: a typed "error" event, no [DONE]
        last = json.loads(events[-1])
        assert last["type"] == "error" and "RuntimeError" in last["message"]
        assert "secret" not in last["message"]
    else:
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "internal_server_error" and "secret" not in err["message"]
        assert "RuntimeError" in err["message"]
    assert fake_server.engine.live == {}


def test_engine_dead_is_503_and_health_follows(fake_server, monkeypatch):
    class EngineDeadError(RuntimeError):
        pass

    async def dead(*a, **k):
        raise EngineDeadError("loop died")
        yield

    monkeypatch.setattr(fake_server.engine, "generate", dead)
    e = _err(_post(fake_server, "/v1/chat/completions", {"messages": _msgs()}), 503)
    assert e["code"] == "engine_dead"
    monkeypatch.setattr(fake_server.engine, "healthy", False)
    _err(httpx.get(fake_server.url + "/health"), 503)


def test_draining_refuses_new_work(fake_server, monkeypatch):
    state = fake_server.app.state.k2
    monkeypatch.setattr(state, "draining", True)
    _err(httpx.get(fake_server.url + "/health"), 503)
    _err(_post(fake_server, "/v1/chat/completions", {"messages": _msgs()}), 503)
    assert httpx.get(fake_server.url + "/metrics").status_code == 200


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        key, _, val = line.rpartition(" ")
        if key == name:
            return float(val)
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_what_happened():
    """A fresh app (its own registry, next to the module's): the counters add up to the usage."""

    engine = FakeAsyncEngine()
    with ServerThread(build_app(engine, served_model_names=["m"])) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        a = c.chat.completions.create(model="m", messages=_msgs())
        b = c.completions.create(model="m", prompt="count", max_tokens=7)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="m", prompt="count", temperature=9)
        engine.max_waiting = 0
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model="m", prompt="count")
        text = httpx.get(srv.url + "/metrics").text
    prompt = a.usage.prompt_tokens + b.usage.prompt_tokens
    gen = a.usage.completion_tokens + b.usage.completion_tokens
    assert _metric(text, "k2serve:prompt_tokens_total") == prompt
    assert _metric(text, "k2serve:generation_tokens_total") == gen
    assert _metric(text, "k2serve:time_to_first_token_seconds_count") == 2
    assert _metric(text, "k2serve:e2e_request_latency_seconds_count") == 2
    assert _metric(text, "k2serve:inter_token_latency_seconds_count") == gen - 2
    assert 'k2serve:request_success_total{finished_reason="stop"} 1.0' in text
    assert 'k2serve:request_success_total{finished_reason="length"} 1.0' in text
    assert 'k2serve:http_requests_total{path="/v1/completions",status="400"} 1.0' in text
    assert 'k2serve:http_requests_total{path="/v1/completions",status="429"} 1.0' in text
    assert 'k2serve:http_requests_total{path="/v1/chat/completions",status="200"} 1.0' in text


def test_drain_timeout_ends_inflight_requests_cleanly():
    """When the drain timeout runs out (stop_event), a stream ends with an error event and
    [DONE], a non-streaming request gets 503, and the engine requests are aborted."""

    engine = FakeAsyncEngine(delay=0.005)
    app = build_app(engine)
    state = app.state.k2
    with ServerThread(app) as srv:
        out: dict = {}

        streaming = threading.Event()

        def stream():
            body = {"prompt": "forever", "max_tokens": 400, "stream": True}
            out["stream"] = []
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out["stream"].append(line[6:])
                        streaming.set()

        def whole():
            body = {"prompt": "forever", "max_tokens": 400}
            out["whole"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert streaming.wait(10)
        for _ in range(200):
            if engine.running == 2:
                break
            time.sleep(0.01)
        assert engine.running == 2
        state.loop.call_soon_threadsafe(state.stop_event.set)
        for t in threads:
            t.join(20)
        events = out["stream"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert _err(out["whole"], 503)["code"] == "shutting_down"
        for _ in range(100):
            if not engine.live:
                break
            time.sleep(0.02)
        assert engine.live == {} and len(engine.aborted) == 2


def test_cors_preflight_needs_no_key():
    app = build_app(FakeAsyncEngine(), api_key="k", allowed_origins=["https://ui.example"])
    with ServerThread(app) as srv:
        r = httpx.options(
            srv.url + "/v1/chat/completions",
            headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"},
        )  # fmt: skip
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "https://ui.example"})
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
