"""The HTTP layer against the fake engine: chat and completions through the real `openai`
client and raw httpx (protocol, streaming, tools, logprobs, response schemas)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .fakes import FakeTokenizer
from .helpers import TIME_TOOL, WEATHER_TOOL, _err, _msgs, _post


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(
        base_url=fake_server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30
    )


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
    # vLLM's deltas: id, type and name first, then the arguments fragment by fragment
    assert [tc.function.name for tc in calls if tc.function.name] == ["get_weather"]
    assert calls[0].id == "functions.get_weather:0" and calls[0].type == "function"
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    assert len(calls) > 3 and {tc.index for tc in calls} == {0}
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
    for extra in ({"tools": [WEATHER_TOOL], "tool_choice": "none"}, {}):
        r = client.chat.completions.create(
            model="fake-k2", messages=_msgs("make a bare call"), max_tokens=30, **extra
        )
        assert not r.choices[0].message.tool_calls
        chunks = client.chat.completions.create(
            model="fake-k2", messages=_msgs("make a bare call"), stream=True, **extra
        )
        assert not [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    r = client.chat.completions.create(
        model="fake-k2", messages=_msgs("make a bare call"), max_tokens=100, tools=[WEATHER_TOOL]
    )
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


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
    assert v["git_revision"] == k2serve.git_revision()  # this checkout's commit
    assert v["git_revision"] is None or len(v["git_revision"]) >= 12
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
    firsts = [tc for tc in calls if tc.id]
    assert [tc.index for tc in firsts] == [0, 1]
    assert [tc.id for tc in firsts] == ["functions.get_weather:0", "functions.get_weather:1"]
    for i, city in enumerate(["Paris", "Rome"]):
        args = "".join(tc.function.arguments or "" for tc in calls if tc.index == i)
        assert json.loads(args) == {"city": city}


def test_stream_n2_each_choice_finishes(client):
    chunks = list(
        client.chat.completions.create(model="fake-k2", messages=_msgs(), n=2, stream=True)
    )
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert [c.finish_reason for c in mine if c.finish_reason] == ["stop"]
        assert "".join(c.delta.content or "" for c in mine).startswith("Hello!")


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


def test_tool_call_near_max_tokens_is_held_back_whole(client):
    # with few tokens left when the call opens, the call is sent whole once complete...
    chunks = list(
        client.chat.completions.create(
            model="fake-k2",
            messages=_msgs("What's the weather in Paris?"),
            tools=[WEATHER_TOOL],
            stream=True,
            max_tokens=200,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    # ...and a call that max_tokens cuts is never shown
    chunks = list(
        client.chat.completions.create(
            model="fake-k2",
            messages=_msgs("What's the weather in Paris?"),
            tools=[WEATHER_TOOL],
            stream=True,
            max_tokens=50,  # the fake writes the call from token 16 to 57
        )
    )
    assert not [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
