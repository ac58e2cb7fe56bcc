"""The HTTP layer against the fake engine, through the real `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from .fakes import FakeTokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(
        base_url=fake_server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30
    )


def _msgs(text="Hi there"):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def test_chat_basic_usage_and_reasoning(client, fake_server):
    r = client.chat.completions.create(model="fake-k2", messages=_msgs())
    ch = r.choices[0]
    assert ch.message.content.startswith("Hello! I am a fake model.")
    assert ch.message.reasoning_content == "Let me think."
    assert ch.finish_reason == "stop"
    # prompt tokens = the rendered template, tokenized
    tok = FakeTokenizer()
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        chat_template_kwargs={"thinking": True},
    )
    assert r.usage.prompt_tokens == len(tok.encode(text))
    gen = "Let me think.</think>" + ch.message.content
    assert r.usage.completion_tokens == len(tok.encode(gen)) + 1  # + <|im_end|>
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == "fake-k2"


def test_chat_thinking_off_and_alias_model(client):
    r = client.chat.completions.create(
        model="alias", messages=_msgs(), extra_body={"chat_template_kwargs": {"thinking": False}}
    )
    m = r.choices[0].message
    assert m.content.startswith("Hello!")
    assert getattr(m, "reasoning_content", None) is None


def test_chat_content_parts_and_history(client):
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}],
        },
        {"role": "assistant", "content": "ok", "reasoning": "thought"},
        {"role": "user", "content": "again"},
    ]
    r = client.chat.completions.create(model="fake-k2", messages=msgs)
    assert r.choices[0].message.content.startswith("Hello!")


def test_chat_stream_matches_whole_and_usage(client):
    whole = client.chat.completions.create(model="fake-k2", messages=_msgs())
    chunks = list(
        client.chat.completions.create(
            model="fake-k2", messages=_msgs(), stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert content == whole.choices[0].message.content
    assert reasoning == "Let me think."
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_tool_call_auto(client):
    r = client.chat.completions.create(
        model="fake-k2", messages=_msgs("What's the weather in Paris?"), tools=[WEATHER_TOOL]
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id == "functions.get_weather:0"
    assert not ch.message.content
    # the result goes back in as a tool message
    msgs = _msgs("What's the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    r2 = client.chat.completions.create(model="fake-k2", messages=msgs, tools=[WEATHER_TOOL])
    assert r2.choices[0].finish_reason in ("stop", "tool_calls")


def test_tool_call_stream(client):
    chunks = list(
        client.chat.completions.create(
            model="fake-k2",
            messages=_msgs("What's the weather in Paris?"),
            tools=[WEATHER_TOOL],
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert json.loads("".join(tc.function.arguments for tc in calls)) == {"city": "Paris"}
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["tool_calls"]
    assert "<|tool" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("thinking", [True, False])
def test_tool_choice_required_forces_a_call(client, thinking):
    # The fake model would answer in prose; "required" must force a call to an allowed tool.
    r = client.chat.completions.create(
        model="fake-k2",
        messages=_msgs("Hi"),
        tools=[TIME_TOOL, WEATHER_TOOL],
        tool_choice="required",
        max_tokens=60,
        extra_body={"chat_template_kwargs": {"thinking": thinking}},
    )
    ch = r.choices[0]
    assert ch.message.tool_calls, ch.message
    assert ch.message.tool_calls[0].function.name in ("get_time", "get_weather")
    if thinking:
        assert ch.message.reasoning_content == "Let me think."


def test_tool_choice_named_forces_that_function(client):
    r = client.chat.completions.create(
        model="fake-k2",
        messages=_msgs("What's the weather in Paris?"),
        tools=[WEATHER_TOOL, TIME_TOOL],
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert r.choices[0].message.tool_calls[0].function.name == "get_time"


def test_tool_choice_none_blocks_the_section(client):
    r = client.chat.completions.create(
        model="fake-k2",
        messages=_msgs("What's the weather in Paris?"),
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=30,
    )
    m = r.choices[0].message
    assert not m.tool_calls
    assert "<|tool" not in (m.content or "")


def test_n_stop_max_tokens_logprobs(client):
    r = client.chat.completions.create(model="fake-k2", messages=_msgs(), n=2)
    assert [c.index for c in r.choices] == [0, 1]
    r = client.chat.completions.create(model="fake-k2", messages=_msgs(), stop=["fake"])
    assert r.choices[0].message.content == "Hello! I am a"
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="fake-k2", messages=_msgs("count"), max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(
        model="fake-k2", messages=_msgs("count"), max_completion_tokens=7
    )
    assert r.usage.completion_tokens == 7
    r = client.chat.completions.create(
        model="fake-k2", messages=_msgs(), logprobs=True, top_logprobs=3, max_tokens=6
    )
    lps = r.choices[0].logprobs.content
    assert len(lps) == 6
    for lp in lps:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
        assert bytes(lp.bytes).decode() == lp.token
    assert "".join(lp.token for lp in lps) == "Let me"


def test_completions_text_ids_batch_echo_logprobs(client):
    tok = FakeTokenizer()
    r = client.completions.create(model="fake-k2", prompt="count to ten", max_tokens=4)
    assert r.choices[0].text == "1 2 " and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode("count to ten"))
    r = client.completions.create(
        model="fake-k2", prompt=tok.encode("count"), max_tokens=3, echo=True, logprobs=2
    )
    ch = r.choices[0]
    assert ch.text == "count1 2"
    assert ch.logprobs.tokens[:5] == list("count")
    assert ch.logprobs.token_logprobs[:5] == [None] * 5
    assert all(x <= 0 for x in ch.logprobs.token_logprobs[5:])
    assert ch.logprobs.text_offset == list(range(8))
    r = client.completions.create(model="fake-k2", prompt=["count", "hello"], max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == "1 2" and r.choices[2].text == "Hel"
    r = client.completions.create(
        model="fake-k2", prompt=[tok.encode("count"), tok.encode("x")], max_tokens=2
    )
    assert len(r.choices) == 2


def test_completions_stream(client):
    chunks = list(
        client.completions.create(
            model="fake-k2",
            prompt="count",
            max_tokens=6,
            stream=True,
            echo=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "count1 2 3 "
    assert chunks[-1].usage.completion_tokens == 6


def test_models_health_version_metrics(fake_server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["fake-k2", "alias"]
    assert httpx.get(fake_server.url + "/health").status_code == 200
    v = httpx.get(fake_server.url + "/version").json()
    import k2serve

    assert v["version"] == k2serve.__version__
    text = httpx.get(fake_server.url + "/metrics").text
    for name in (
        "k2serve:time_to_first_token_seconds_bucket",
        "k2serve:inter_token_latency_seconds",
        "k2serve:e2e_request_latency_seconds",
        "k2serve:prompt_tokens_total",
        "k2serve:generation_tokens_total",
        "k2serve:num_requests_running",
        "k2serve:num_requests_waiting",
        "k2serve:kv_cache_usage_perc",
        "k2serve:prefix_cache_hit_rate 0.25",
        "k2serve:kv_cache_total_pages 4096",
        'k2serve:http_requests_total{path="/v1/chat/completions",status="200"}',
    ):
        assert name in text, name


# ------------------------------------------------------------------------------------------
# Errors


def _err(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    return body["error"]


def _post(srv, path, body, key="sk-test", **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=30, **kw)


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
    _err(httpx.get(fake_server.url + "/nope"), 404)


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


# ------------------------------------------------------------------------------------------
# More protocol details


def test_parallel_tool_calls(client):
    msgs = _msgs("What's the weather in Paris and Rome?")
    r = client.chat.completions.create(model="fake-k2", messages=msgs, tools=[WEATHER_TOOL])
    cities = [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls]
    assert cities == ["Paris", "Rome"]
    r = client.chat.completions.create(
        model="fake-k2", messages=msgs, tools=[WEATHER_TOOL], parallel_tool_calls=False
    )
    assert len(r.choices[0].message.tool_calls) == 1
    chunks = list(
        client.chat.completions.create(
            model="fake-k2", messages=msgs, tools=[WEATHER_TOOL], stream=True
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.index for tc in calls] == [0, 1]
    assert [tc.id for tc in calls] == ["functions.get_weather:0", "functions.get_weather:1"]


def test_stream_n2_each_choice_finishes(client):
    chunks = list(
        client.chat.completions.create(model="fake-k2", messages=_msgs(), n=2, stream=True)
    )
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]
        assert "".join(c.delta.content or "" for c in mine).startswith("Hello!")


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


def test_mid_stream_failure_sends_error_event(fake_server, monkeypatch):
    real_run = fake_server.engine._run

    async def failing(prompt_ids, params, request_id):
        k = 0
        async for out in real_run(prompt_ids, params, request_id):
            yield out
            k += 1
            if k == 3:
                raise RuntimeError("boom with secret")

    monkeypatch.setattr(fake_server.engine, "_run", failing)
    r = _post(fake_server, "/v1/chat/completions", {"messages": _msgs(), "stream": True})
    assert r.status_code == 200
    events = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "internal_server_error" and "secret" not in err["message"]
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


def test_bodies_match_the_protocol_models(fake_server):
    """Every body validates against protocol.py's response models (extra fields forbidden)."""
    from k2serve.server import protocol as P

    def sse(r):
        return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]

    chat = {"messages": _msgs("What's the weather in Paris?"), "tools": [WEATHER_TOOL]}
    P.ChatCompletionResponse.model_validate(
        _post(fake_server, "/v1/chat/completions", {**chat, "logprobs": True}).json()
    )
    P.ChatCompletionResponse.model_validate(
        _post(fake_server, "/v1/chat/completions", {"messages": _msgs(), "n": 2}).json()
    )
    r = _post(
        fake_server,
        "/v1/chat/completions",
        {**chat, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True},
    )
    chunks = sse(r)
    assert len(chunks) > 3
    for c in chunks:
        P.ChatCompletionChunk.model_validate(c)
    body = {"prompt": ["count", "Hi"], "max_tokens": 3, "echo": True, "logprobs": 1}
    P.CompletionResponse.model_validate(_post(fake_server, "/v1/completions", body).json())
    for c in sse(_post(fake_server, "/v1/completions", {**body, "stream": True})):
        P.CompletionResponse.model_validate({**c, "object": "text_completion"})
    P.ModelList.model_validate(
        httpx.get(
            fake_server.url + "/v1/models", headers={"Authorization": "Bearer sk-test"}
        ).json()
    )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        key, _, val = line.rpartition(" ")
        if key == name:
            return float(val)
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_what_happened():
    """A fresh app (its own registry, next to the module's): the counters add up to the usage."""
    from k2serve.server.app import build_app

    from .conftest import ServerThread
    from .fakes import FakeAsyncEngine

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


def test_logit_bias(client, fake_server):
    tok = FakeTokenizer()
    x = tok.encode("x")[0]
    r = client.completions.create(
        model="fake-k2", prompt="Hi", max_tokens=4, logit_bias={str(x): 100}
    )
    assert r.choices[0].text == "xxxx"  # +100 beats the fake model's preferred token
    h = tok.encode("H")[0]
    r = client.completions.create(
        model="fake-k2", prompt="Hi", max_tokens=4, logit_bias={str(h): -100}
    )
    assert not r.choices[0].text.startswith("H")  # the fake model's first choice is "H"
    for bad in ({"abc": 1}, {str(10**7): 1}, {str(x): 101}):
        e = _err(_post(fake_server, "/v1/completions", {"prompt": "Hi", "logit_bias": bad}), 400)
        assert e["param"] == "logit_bias"


def test_drain_timeout_ends_inflight_requests_cleanly():
    """When the drain timeout runs out (stop_event), a stream ends with an error event and
    [DONE], a non-streaming request gets 503, and the engine requests are aborted."""
    import threading

    from k2serve.server.app import build_app

    from .conftest import ServerThread
    from .fakes import FakeAsyncEngine

    engine = FakeAsyncEngine(delay=0.005)
    app = build_app(engine)
    state = app.state.k2
    with ServerThread(app) as srv:
        out: dict = {}

        def stream():
            body = {"prompt": "forever", "max_tokens": 400, "stream": True}
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            out["stream"] = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]

        def whole():
            body = {"prompt": "forever", "max_tokens": 400}
            out["whole"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
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
