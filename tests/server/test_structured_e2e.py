"""Structured outputs end to end: the real engine on the demo checkpoint behind the real server,
driven by the `openai` client.

The demo model's raw output is not JSON (nor a valid tool call) at temperature 1, so only the
grammar constraint can make these replies valid: each reply is parsed and validated against its
schema with `jsonschema`, for several prompts and seeds, streamed and with n=2.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from .conftest import ServerThread  # noqa: E402
from .test_e2e_engine import model_dir  # noqa: E402,F401  (the checkpoint fixture)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
PROMPTS = ["Describe someone.", "Hi", "Write a poem about the sea"]


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.config import EngineConfig
    from k2serve.server.app import build_app

    cfg = EngineConfig(
        model=model_dir, max_model_len=1024, num_kv_pages=512, max_num_seqs=32, device="cpu"
    )
    engine = AsyncLLMEngine(cfg)
    app = build_app(engine, served_model_names=["demo"], api_key="sk-so")
    try:
        with ServerThread(app) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-so", max_retries=0, timeout=120)


def _user(text):
    return [{"role": "user", "content": text}]


def _schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _closers(server) -> dict[str, float]:
    tok = server.engine.tokenizer
    return {str(t): 8 for t in tok.encode('"') + tok.encode("}")}


def _check_integrity(server):
    server.engine.engine.check_integrity()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_is_valid_for_prompts_and_seeds(client, server, seed):
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model="demo",
            messages=_user(prompt),
            response_format=_schema_format(PERSON),
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            extra_body=NO_THINK,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    _check_integrity(server)


def test_openai_parse_with_a_pydantic_model(client, server):
    # what `client.chat.completions.parse(response_format=Model)` sends: a pydantic JSON schema
    # with $defs, enums, optional fields, strict
    from enum import Enum

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Part(BaseModel):
        label: str = Field(max_length=10)
        count: int

    class Order(BaseModel):
        color: Color
        parts: list[Part] = Field(max_length=2)
        note: str | None = Field(max_length=10)

    for seed in (1, 2):
        r = client.chat.completions.parse(
            model="demo",
            messages=_user("Order something"),
            response_format=Order,
            temperature=1.0,
            seed=seed,
            max_tokens=300,
            extra_body=NO_THINK,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "stop"
        assert isinstance(ch.message.parsed, Order), ch.message.content
    _check_integrity(server)


def test_responses_text_format_json_schema(client, server):
    for seed in (1, 2):
        r = client.responses.create(
            model="demo",
            input="Describe someone.",
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
            temperature=1.0,
            max_output_tokens=300,
            extra_body={**NO_THINK, "seed": seed},
        )
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), PERSON)
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(
            model="demo",
            input="x",
            text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "objectx"}}},
        )
    assert ei.value.body["param"] == "text.format"
    _check_integrity(server)


def test_json_object_streaming_and_n2(client, server):
    # any JSON object is unbounded (the tiny model writes endless strings), so a bias towards
    # quotes and braces lets it finish; the bias alone makes no JSON
    close = _closers(server)
    stream = client.chat.completions.create(
        model="demo",
        messages=_user("Give me JSON"),
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=11,
        n=2,
        max_tokens=300,
        stream=True,
        logit_bias=close,
        extra_body=NO_THINK,
    )
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop", "stop"]
    for t in texts:
        assert isinstance(json.loads(t), dict), t
    _check_integrity(server)


def test_json_schema_n2_and_thinking_on(client, server):
    # thinking on: the reasoning is free and the schema applies after </think>; a logit bias on
    # </think> makes the tiny model close its reasoning quickly
    tok = server.engine.tokenizer
    think_end = tok.token_to_id("</think>")
    r = client.chat.completions.create(
        model="demo",
        messages=_user("Describe someone."),
        response_format=_schema_format(PERSON),
        temperature=1.0,
        seed=5,
        n=2,
        max_tokens=300,
        logit_bias={str(think_end): 8},
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    assert len(r.choices) == 2
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    _check_integrity(server)


def test_choice_regex_grammar_and_legacy_fields(client, server):
    for seed in (1, 2):
        r = client.chat.completions.create(
            model="demo",
            messages=_user("Pick a color"),
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            extra_body={**NO_THINK, "structured_outputs": {"choice": ["red", "green", "blue"]}},
        )
        assert r.choices[0].message.content in ("red", "green", "blue")
        assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model="demo",
        messages=_user("A phone number"),
        temperature=1.0,
        max_tokens=30,
        extra_body={**NO_THINK, "guided_regex": r"\d{3}-\d{4}"},
    )
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    r = client.chat.completions.create(
        model="demo",
        messages=_user("yes or no"),
        temperature=1.0,
        max_tokens=20,
        extra_body={**NO_THINK, "guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].message.content in ("yes", "no")
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    r = client.chat.completions.create(
        model="demo",
        messages=_user("math"),
        temperature=1.0,
        max_tokens=60,
        extra_body={**NO_THINK, "guided_grammar": grammar},
    )
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", r.choices[0].message.content)
    _check_integrity(server)


def test_completions_structured_outputs(client, server):
    r = client.completions.create(
        model="demo",
        prompt=["Once upon a time", "JSON:"],
        temperature=1.0,
        seed=4,
        n=2,
        max_tokens=300,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)
    r = client.completions.create(
        model="demo",
        prompt="Answer:",
        temperature=1.0,
        max_tokens=300,
        logit_bias=_closers(server),
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    _check_integrity(server)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_tool_choice_named_and_required_give_schema_valid_arguments(client, server, seed, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD_TOOL, WEATHER_TOOL)}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kw = dict(
            model="demo",
            messages=_user("What is 2 + 3?"),
            tools=[ADD_TOOL, WEATHER_TOOL],
            tool_choice=choice,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            extra_body=NO_THINK,
        )
        if stream:
            calls: dict[int, dict] = {}
            reason = None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    reason = c.finish_reason or reason
                    for tc in c.delta.tool_calls or []:
                        d = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                        if tc.function and tc.function.name:
                            d["name"] = tc.function.name
                        if tc.function and tc.function.arguments:
                            d["arguments"] += tc.function.arguments
            got = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(**kw)
            reason = r.choices[0].finish_reason
            got = [
                {"name": tc.function.name, "arguments": tc.function.arguments}
                for tc in r.choices[0].message.tool_calls
            ]
        assert reason == "tool_calls", (choice, got)
        assert got, choice
        if isinstance(choice, dict):
            assert [c["name"] for c in got] == ["add"]
        for c in got:
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
    _check_integrity(server)


def test_strict_tool_under_auto_is_constrained_once_opened(client, server):
    # a strong bias on the section marker makes the tiny model open a tool call; the strict
    # tool's arguments must then follow its schema
    tok = server.engine.tokenizer
    begin = tok.token_to_id("<|tool_calls_section_begin|>")
    strict_add = {"type": "function", "function": {**ADD_TOOL["function"], "strict": True}}
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model="demo",
            messages=_user("What is 2 + 3?"),
            tools=[strict_add],
            tool_choice="auto",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            logit_bias={str(begin): 30},
            extra_body=NO_THINK,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        for tc in ch.message.tool_calls:
            assert tc.function.name == "add"
            jsonschema.validate(
                json.loads(tc.function.arguments), ADD_TOOL["function"]["parameters"]
            )
    _check_integrity(server)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": _schema_format({"type": "objectx"})}, "response_format"),
        (
            {"response_format": _schema_format({"$ref": "#/$defs/missing"})},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        (
            {"guided_regex": "a+", "response_format": {"type": "json_object"}},
            "guided_regex",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, server, extra, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="demo", messages=_user("x"), max_tokens=5, extra_body=extra
        )
    err = ei.value.body
    assert err["param"] is None or err["param"].startswith(param), err
    assert param.split(".")[0] in err["message"] or err["param"], err
    _check_integrity(server)


def test_bad_tool_schema_is_400(client, server):
    bad = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 3}}},
    }
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="demo", messages=_user("x"), tools=[bad], tool_choice="required", max_tokens=5
        )
    assert ei.value.body["param"].startswith("tools")  # the meta-schema check names the path
    _check_integrity(server)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_with_thinking_on(client, server, stream):
    # the reasoning is free; the call (after </think>) must match the schema; a bias on
    # </think> makes the tiny model close its reasoning within max_tokens
    tok = server.engine.tokenizer
    kw = dict(
        model="demo",
        messages=_user("What is 2 + 3?"),
        tools=[ADD_TOOL],
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=1.0,
        seed=7,
        max_tokens=300,
        logit_bias={str(tok.token_to_id("</think>")): 8},
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    if stream:
        args, names, reason = "", [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                reason = c.finish_reason or reason
                for tc in c.delta.tool_calls or []:
                    if tc.function and tc.function.name:
                        names.append(tc.function.name)
                    if tc.function and tc.function.arguments:
                        args += tc.function.arguments
    else:
        ch = client.chat.completions.create(**kw).choices[0]
        reason = ch.finish_reason
        names = [tc.function.name for tc in ch.message.tool_calls]
        args = ch.message.tool_calls[0].function.arguments if names else ""
    assert reason == "tool_calls" and names == ["add"], (reason, names)
    jsonschema.validate(json.loads(args), ADD_TOOL["function"]["parameters"])
    _check_integrity(server)


def test_response_format_structural_tag_is_accepted(client, server):
    # vLLM's response_format extension; the tiny model never writes the trigger, so the reply
    # is free text that never opens a tag badly
    r = client.chat.completions.create(
        model="demo",
        messages=_user("Hi"),
        max_tokens=20,
        temperature=1.0,
        response_format={
            "type": "structural_tag",
            "structures": [
                {"begin": "<fn=add>", "schema": ADD_TOOL["function"]["parameters"], "end": "</fn>"}
            ],
            "triggers": ["<fn="],
        },
        extra_body=NO_THINK,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="demo",
            messages=_user("Hi"),
            max_tokens=5,
            response_format={"type": "structural_tag", "nothing": 1},
        )
    assert ei.value.body["param"] == "response_format"
    _check_integrity(server)


def test_tgi_grammar_forms_constrain_as_tgi(client, server):
    """huggingface_hub's InferenceClient sends TGI's grammar: {"type": "json_object" | "json",
    "value": SCHEMA} and {"type": "regex", "value": ...}; each constrains the reply."""
    from huggingface_hub import InferenceClient

    hf = InferenceClient(base_url=server.url, api_key="sk-so", timeout=120)
    for fmt in (
        {"type": "json_object", "value": PERSON},
        {"type": "json", "value": PERSON},
        {"type": "json", "value": json.dumps(PERSON)},  # the schema as a string
    ):
        out = hf.chat_completion(
            _user("Describe someone."), model="demo", response_format=fmt, max_tokens=300,
            temperature=1.0, seed=2, extra_body=NO_THINK,
        )  # fmt: skip
        ch = out.choices[0]
        assert ch.finish_reason == "stop", (fmt, ch)
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    r = client.chat.completions.create(
        model="demo", messages=_user("Hi"), max_tokens=20, temperature=1.0,
        response_format={"type": "regex", "value": "(yes|no)"}, extra_body=NO_THINK,
    )  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")
    for bad, param in (
        ({"type": "json"}, "response_format.value"),
        ({"type": "json", "value": "{not json"}, "response_format.value"),
        ({"type": "regex", "value": 3}, "response_format.value"),
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(model="demo", messages=_user("Hi"),
                                           response_format=bad, max_tokens=5)  # fmt: skip
        assert ei.value.body["param"] == param
    _check_integrity(server)
