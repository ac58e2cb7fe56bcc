"""The shipped demo checkpoint speaks the Kimi dialect (issue 3, item 6), checked through the
parsers under greedy decoding with the model's plain forward."""

import json
import os

import pytest
import torch

from k2serve.config import ModelConfig
from k2serve.demo import demo_path
from k2serve.demo.conversations import GET_TIME_TOOL, GET_WEATHER_TOOL, SEARCH_TOOL
from k2serve.demo.generate import chat_greedy, greedy_generate
from k2serve.parsers import StreamingOutputParser, parse_output
from k2serve.tokenizer import IncrementalDetokenizer, KimiTokenizer
from k2serve.weights.loader import load_model

CITIES = ["Paris", "London", "Tokyo", "Beijing", "New York", "Sydney", "Berlin", "Madrid",
          "Cairo", "Moscow", "Toronto", "Seoul"]  # fmt: skip


@pytest.fixture(scope="module")
def demo():
    path = demo_path()
    return load_model(path, dtype=torch.float32, progress=False), KimiTokenizer.from_dir(path)


def test_layout_and_format():
    path = demo_path()
    names = set(os.listdir(path))
    for f in (
        "config.json",
        "model.safetensors.index.json",
        "tiktoken.model",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        assert f in names, f
    size = sum(os.path.getsize(path / f) for f in names)
    assert size < 10e6
    cfg = ModelConfig.from_hf(path)
    assert cfg.quant is not None and cfg.quant.method == "int4_group"
    assert cfg.first_k_dense_replace >= 1 and cfg.n_routed_experts > cfg.num_experts_per_tok
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_packed" in index
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in index
    tok = KimiTokenizer.from_dir(path)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.token_to_id("<|im_end|>") == tok.num_base_tokens + 2
    assert tok.chat_template is not None


@pytest.mark.parametrize("city", CITIES)
def test_weather_question_calls_get_weather(demo, city):
    model, tok = demo
    msgs = [{"role": "user", "content": f"What's the weather in {city}?"}]
    text, reason = chat_greedy(model, tok, msgs, tools=[GET_WEATHER_TOOL], max_new_tokens=60)
    assert reason == "stop", text
    out = parse_output(text, thinking=True, tools=[GET_WEATHER_TOOL])
    assert out.reasoning_content and len(out.reasoning_content) < 200, text
    assert out.content is None, text
    assert len(out.tool_calls) == 1, text
    call = out.tool_calls[0]
    assert call.name == "get_weather" and call.id == "functions.get_weather:0"
    assert json.loads(call.arguments) == {"city": city}


def test_weather_with_other_tools_and_system_prompt(demo):
    model, tok = demo
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Rome?"},
    ]
    tools = [SEARCH_TOOL, GET_WEATHER_TOOL, GET_TIME_TOOL]
    text, _ = chat_greedy(model, tok, msgs, tools=tools, max_new_tokens=60)
    out = parse_output(text, thinking=True, tools=tools)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Rome"})
    ], text


def test_hello_thinks_then_greets(demo):
    model, tok = demo
    text, reason = chat_greedy(model, tok, [{"role": "user", "content": "Hello"}])
    assert reason == "stop"
    out = parse_output(text, thinking=True)
    assert out.reasoning_content and len(out.reasoning_content) < 200, text
    assert out.content and out.content.startswith(("Hello", "Hi")), text
    assert not out.tool_calls


def test_thinking_off_answers_without_thought(demo):
    model, tok = demo
    text, reason = chat_greedy(model, tok, [{"role": "user", "content": "Hello"}], thinking=False)
    assert reason == "stop"
    assert "</think>" not in text and "<think>" not in text, text
    out = parse_output(text, thinking=False)
    assert out.reasoning_content is None
    assert out.content and out.content.startswith(("Hello", "Hi")), text


def test_streamed_equals_whole(demo):
    """Token-by-token: detokenizer deltas through the streaming parser give the same result."""
    model, tok = demo
    msgs = [{"role": "user", "content": "What's the weather in Tokyo?"}]
    prompt = tok.apply_chat_template(msgs, tools=[GET_WEATHER_TOOL])
    stop = {tok.token_to_id("<|im_end|>"), tok.eos_token_id}
    ids, _ = greedy_generate(model, tok.encode(prompt), 60, stop)
    whole = parse_output(tok.decode(ids, skip_special_tokens=True), tools=[GET_WEATHER_TOOL])
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    parser = StreamingOutputParser(thinking=True, tools=[GET_WEATHER_TOOL])
    deltas = [parser.feed(detok.add(i)) for i in ids]
    deltas += [parser.feed(detok.flush()), parser.finish()]
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    args = "".join(tc.arguments or "" for d in deltas for tc in d.tool_calls)
    names = [tc.name for d in deltas for tc in d.tool_calls if tc.name]
    assert reasoning.strip() == whole.reasoning_content
    assert names == ["get_weather"]
    assert json.loads(args) == {"city": "Tokyo"}
