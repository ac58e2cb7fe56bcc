"""Issue #31 C, D, H, I end to end on the demo checkpoint.

I: with thinking on, a model that wants to end its turn inside the reasoning cannot skip the
constraint (tool_choice required / named, json_schema). C / D: the probe's schemas are a 400
naming the field. H: a nullable length-bounded string stays valid JSON.

A large bias on <|im_end|> makes the tiny model try to end the turn at once, as the probe saw
("The tool answered.<|im_end|>" inside <think>); a smaller one on </think> lets it close the
reasoning. Each reply must hold the constrained part, or be cut by max_tokens ("length").
"""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from .test_e2e_engine import model_dir  # noqa: E402,F401  (the checkpoint fixture)
from .test_structured_e2e import ADD_TOOL, PERSON, _user, client, server  # noqa: E402,F401


def _bias(srv) -> dict[str, int]:
    tok = srv.engine.tokenizer
    return {str(tok.token_to_id("<|im_end|>")): 30, str(tok.token_to_id("</think>")): 6}


THINK = {"chat_template_kwargs": {"thinking": True}}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_holds_with_thinking_on(client, server, choice):  # noqa: F811
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(
        model="demo", messages=_user("Add 2 and 3."), tools=[ADD_TOOL], tool_choice=tc,
        temperature=1.0, seed=3, n=3, max_tokens=160, logit_bias=_bias(server), extra_body=THINK,
    )  # fmt: skip
    for ch in r.choices:
        assert ch.finish_reason in ("tool_calls", "length"), (ch.finish_reason, ch.message)
        if ch.finish_reason == "tool_calls":
            args = json.loads(ch.message.tool_calls[0].function.arguments)
            jsonschema.validate(args, ADD_TOOL["function"]["parameters"])
    assert any(ch.finish_reason == "tool_calls" for ch in r.choices)


def test_json_schema_holds_with_thinking_on(client, server):  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    r = client.chat.completions.create(
        model="demo", messages=_user("Describe someone."), response_format=fmt,
        temperature=1.5, seed=5, n=3, max_tokens=200, logit_bias=_bias(server), extra_body=THINK,
    )  # fmt: skip
    for ch in r.choices:
        assert ch.finish_reason in ("stop", "length"), ch.finish_reason
        if ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), PERSON)
    assert any(ch.finish_reason == "stop" for ch in r.choices)


# ---- C / D over HTTP: the probe's schemas are a 400 naming the field, before generation -------
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    "extra, param, needle",
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
         "response_format", "matches no"),
        ({"structured_outputs": {"json": LOOP}}, "structured_outputs.json", "matches no"),
        ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar",
         "matches nothing"),
        ({"guided_json": {"not": {}}}, "guided_json", "'not'"),
        ({"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "guided_json",
         "matches no value"),
    ],
)  # fmt: skip
def test_unusable_schemas_are_400_before_generation(client, server, extra, param, needle):  # noqa: F811
    import openai

    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model="demo", messages=_user("x"), max_tokens=8, extra_body=extra
        )
    err = ei.value.body
    assert err["param"] == param and needle in err["message"], err


def test_nullable_bounded_string_is_valid_json(client, server):  # noqa: F811
    schema = {"type": "object", "properties": {"s": {"type": ["string", "null"], "maxLength": 5}},
              "required": ["s"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    tok = server.engine.tokenizer
    bias = {str(t): 4 for t in tok.encode('"') + tok.encode("}")}
    r = client.chat.completions.create(
        model="demo", messages=_user("Say something."), response_format=fmt, temperature=1.0,
        seed=11, n=6, max_tokens=40, logit_bias=bias,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )  # fmt: skip
    stopped = [ch for ch in r.choices if ch.finish_reason == "stop"]
    assert stopped
    for ch in stopped:
        jsonschema.validate(json.loads(ch.message.content), schema)
