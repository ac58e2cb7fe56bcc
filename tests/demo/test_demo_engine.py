"""The demo checkpoint through the engine (paged latent cache, absorbed MLA, batching):
`k2serve.LLM()` with no model serves the demo, and greedy chat keeps the contract."""

import json

import pytest

from k2serve.demo.conversations import GET_WEATHER_TOOL
from k2serve.parsers import parse_output

CITIES = ["Paris", "New York", "Nairobi", "Singapore"]


@pytest.fixture(scope="module")
def llm():
    from k2serve import LLM

    return LLM()


def test_engine_batch_keeps_contract(llm):
    from k2serve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=60)
    convs = [[{"role": "user", "content": f"What's the weather in {c}?"}] for c in CITIES]
    outs = llm.chat(convs, params, tools=[GET_WEATHER_TOOL])
    for city, out in zip(CITIES, outs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        parsed = parse_output(text, thinking=True, tools=[GET_WEATHER_TOOL])
        assert parsed.reasoning_content, text
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": city})
        ], text

    hello = [{"role": "user", "content": "Hello"}]
    on = llm.chat(hello, params)[0].outputs[0].text
    off = llm.chat(hello, params, chat_template_kwargs={"thinking": False})[0].outputs[0].text
    p_on, p_off = parse_output(on, thinking=True), parse_output(off, thinking=False)
    assert p_on.reasoning_content and p_on.content.startswith("Hello"), on
    assert "</think>" not in off and p_off.content.startswith("Hello"), off
