"""End to end on loopback with the real engine on the demo checkpoint: the Responses API (the
openai client and the Agents SDK), incremental tool-call argument streaming and
`thinking_token_budget`. Skipped without the demo (a random checkpoint does not call tools)."""

from __future__ import annotations

import json

import pytest

from .test_e2e_engine import _need_demo, client, model_dir, real  # noqa: F401 - fixtures

W = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CHAT_W = {"type": "function", "function": {k: v for k, v in W.items() if k != "type"}}


def test_responses_tool_round_trip(client, real):  # noqa: F811
    _need_demo(real)
    q = "What's the weather in Paris?"
    r = client.responses.create(
        model="demo", input=q, tools=[W], temperature=0, max_output_tokens=400
    )
    assert r.status == "completed"
    types = [o.type for o in r.output]
    assert types[0] == "reasoning" and types[-1] == "function_call"
    fc = r.output[-1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    # streamed: the same items; the arguments arrive in fragments
    events = list(
        client.responses.create(
            model="demo", input=q, tools=[W], temperature=0, max_output_tokens=400, stream=True
        )
    )
    final = events[-1].response
    assert [o.type for o in final.output] == types
    frags = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(frags) > 1 and "".join(frags) == fc.arguments
    # the result goes back through previous_response_id; the demo quotes it
    for result in ("Rainy, 12°C", "Snow, -3°C"):
        r2 = client.responses.create(
            model="demo",
            previous_response_id=r.id,
            input=[{"type": "function_call_output", "call_id": fc.call_id, "output": result}],
            tools=[W],
            temperature=0,
            max_output_tokens=200,
        )
        assert r2.status == "completed" and result in r2.output_text


def test_agents_sdk_on_the_demo(real):  # noqa: F811
    _need_demo(real)
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        seen.append(city)
        return "Rainy, 12°C"

    oa = AsyncOpenAI(base_url=real.url + "/v1", api_key="sk-e2e", max_retries=0, timeout=120)
    agent = agents.Agent(
        name="weather",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model="demo", openai_client=oa),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=300),
    )
    result = agents.Runner.run_sync(
        agent,
        "What's the weather in Paris?",
        run_config=agents.RunConfig(tracing_disabled=True),
        max_turns=4,
    )
    assert seen == ["Paris"]
    assert "Rainy, 12°C" in result.final_output


def test_chat_streams_arguments_incrementally(client, real):  # noqa: F811
    _need_demo(real)
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    kw = dict(model="demo", messages=msgs, tools=[CHAT_W], temperature=0, max_tokens=400)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id == whole.id and calls[0].function.name == "get_weather"
    assert len(calls) > 2  # name first, then several argument fragments
    assert "".join(tc.function.arguments or "" for tc in calls) == whole.function.arguments


def test_thinking_token_budget_on_the_demo(client, real):  # noqa: F811
    _need_demo(real)
    q = "Hello! Who are you?"
    free = client.responses.create(model="demo", input=q, temperature=0, max_output_tokens=200)
    assert free.usage.output_tokens_details.reasoning_tokens > 3
    for budget in (0, 3):
        r = client.responses.create(
            model="demo", input=q, temperature=0, max_output_tokens=200,
            extra_body={"thinking_token_budget": budget},
        )  # fmt: skip
        assert r.usage.output_tokens_details.reasoning_tokens == budget
        assert r.output_text  # the answer still comes
        c = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": q}], temperature=0,
            max_tokens=200, extra_body={"thinking_token_budget": budget},
        )  # fmt: skip
        reasoning = c.choices[0].message.reasoning_content
        assert (reasoning is None) == (budget == 0)
        assert c.choices[0].message.content


def test_litellm_responses_on_the_demo(real):  # noqa: F811
    _need_demo(real)
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    kw = dict(model="openai/demo", api_base=real.url + "/v1", api_key="sk-e2e", temperature=0)
    r = litellm.responses(input="What's the weather in Paris?", tools=[W], **kw)
    calls = [it for it in r.output if getattr(it, "type", None) == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    r2 = litellm.responses(
        input=[
            {"role": "user", "content": "What's the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Snow, -3°C"},
        ],
        tools=[W],
        **kw,
    )  # fmt: skip
    text = "".join(
        part.text
        for it in r2.output
        if getattr(it, "type", None) == "message"
        for part in it.content
    )
    assert "Snow, -3°C" in text


def test_vllm_metrics_from_the_real_engine(client, real):  # noqa: F811
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    fams = {
        f.name: f for f in text_string_to_metric_families(httpx.get(real.url + "/metrics").text)
    }

    def value(name, sample):
        return next(s.value for s in fams[name].samples if s.name == sample)

    # the engine's own counters (EngineStats, a snapshot taken after each step) feed the
    # prefix-cache series
    q = value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    assert 0 < q <= real.engine.get_stats().prefix_cache_queries
    assert 0 <= value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") <= q
    assert value("vllm:num_requests_running", "vllm:num_requests_running") == 0
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") >= 4
    assert all(
        s.labels["model_name"] == "demo" for f in fams.values() if f.name.startswith("vllm:")
        for s in f.samples
    )  # fmt: skip
