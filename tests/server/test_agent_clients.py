"""Agent frameworks on the Responses API (and chat), against the fake engine over HTTP: the
OpenAI Agents SDK (its default model is the Responses API) and LiteLLM's `responses()`. Skipped
where the library is not installed (both are in the `test` extra)."""

from __future__ import annotations

import os

import pytest

from k2serve.server.app import build_app

from .conftest import ServerThread
from .fakes import FakeAsyncEngine, default_script


def agent_script(prompt: str) -> str:
    """default_script, except that once a tool result is in the prompt the model answers."""
    if "## Return of" in prompt:
        head = "Got it.</think>" if prompt.endswith("<think>") else ""
        return head + "It is sunny in Paris.<|im_end|>"
    return default_script(prompt)


@pytest.fixture(scope="module")
def agent_server():
    eng = FakeAsyncEngine(script=agent_script)
    with ServerThread(build_app(eng, served_model_names=["fake-k2"])) as srv:
        srv.engine = eng
        yield srv


def test_openai_agents_sdk_tool_loop(agent_server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)
    model = agents.OpenAIResponsesModel(model="fake-k2", openai_client=client)
    agent = agents.Agent(
        name="weather", instructions="Use tools.", tools=[get_weather], model=model
    )
    result = agents.Runner.run_sync(
        agent,
        "What's the weather in Paris?",
        run_config=agents.RunConfig(tracing_disabled=True),
        max_turns=4,
    )
    assert calls == ["Paris"]
    assert result.final_output == "It is sunny in Paris."
    assert agent_server.engine.live == {}


def test_openai_agents_sdk_streamed(agent_server):
    agents = pytest.importorskip("agents")
    import asyncio

    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    async def main():
        client = AsyncOpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)
        model = agents.OpenAIResponsesModel(model="fake-k2", openai_client=client)
        agent = agents.Agent(name="w", instructions="Use tools.", tools=[get_weather], model=model)
        run = agents.Runner.run_streamed(
            agent, "What's the weather in Paris?",
            run_config=agents.RunConfig(tracing_disabled=True), max_turns=4,
        )  # fmt: skip
        kinds = [ev.type async for ev in run.stream_events()]
        return run.final_output, kinds

    final, kinds = asyncio.run(main())
    assert final == "It is sunny in Paris."
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_litellm_responses(agent_server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    r = litellm.responses(
        model="openai/fake-k2",
        input="Hi there",
        api_base=agent_server.url + "/v1",
        api_key="x",
    )
    texts = [
        part.text
        for item in r.output
        if getattr(item, "type", None) == "message"
        for part in item.content
    ]
    assert texts and texts[0].startswith("Hello! I am a fake model.")
    tool = {"type": "function", "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}  # fmt: skip
    r = litellm.responses(
        model="openai/fake-k2",
        input="What's the weather in Paris?",
        tools=[tool],
        api_base=agent_server.url + "/v1",
        api_key="x",
    )
    calls = [it for it in r.output if getattr(it, "type", None) == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
