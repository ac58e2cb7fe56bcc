"""POST /v1/responses against the fake engine, through the real `openai` client and raw httpx:
output items, usage, tools round trips (stored and stateless), streaming events, errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from k2serve.server.responses_input import ResponseStore, input_messages

from .helpers import _err, _post

W = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
T = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def client(fake_server):
    return openai.OpenAI(
        base_url=fake_server.url + "/v1", api_key="sk-test", max_retries=0, timeout=30
    )


def test_text_response_items_and_usage(client):
    r = client.responses.create(model="fake-k2", input="Hi there", instructions="Be brief.")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think."
    assert r.output_text.startswith("Hello! I am a fake model.")
    assert r.output[1].content[0].type == "output_text"
    # the same conversation through chat: the same prompt, the same tokens
    chat = client.chat.completions.create(
        model="fake-k2",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
        ],
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == len("Let me think.")
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_tool_round_trip_with_previous_response_id(client, fake_server):
    r = client.responses.create(model="fake-k2", input="What's the weather in Paris?", tools=[W])
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    fc = calls[0]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    assert fc.call_id == "functions.get_weather:0" and fc.id.startswith("fc_")
    assert fc.status == "completed"
    # stored: GET returns it
    got = httpx.get(
        f"{fake_server.url}/v1/responses/{r.id}", headers={"Authorization": "Bearer sk-test"}
    )
    assert got.status_code == 200 and got.json()["output"][-1]["call_id"] == fc.call_id
    out = [{"type": "function_call_output", "call_id": fc.call_id, "output": '{"temp": 21}'}]
    r2 = client.responses.create(model="fake-k2", previous_response_id=r.id, input=out, tools=[W])
    assert r2.status == "completed" and r2.previous_response_id == r.id
    # the continued prompt holds the first turn, the call and its result
    assert r2.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens


def test_stateless_round_trip_with_input_items(client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "I should call it."}]},
        {"type": "function_call", "call_id": "functions.get_weather:0", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "functions.get_weather:0", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "Thanks!"},
    ]  # fmt: skip
    r = client.responses.create(model="fake-k2", input=items, store=False)
    assert r.status == "completed" and r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)  # store=false: not kept


def test_input_items_map_to_chat_messages():
    msgs = input_messages(
        [
            {"type": "message", "role": "developer", "content": "rules"},
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": {"x": 1}},
            {"type": "function_call_output", "call_id": "c1", "output": "r1"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "r2"}]},
        ]
    )  # fmt: skip
    assert msgs == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "plan",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function",
                 "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
    ]  # fmt: skip
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_store_is_a_bounded_lru():
    s = ResponseStore(capacity=3)
    for i in range(5):
        s.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert len(s) == 3 and s.get("r0") is None and s.get("r1") is None
    assert s.get("r2") is not None  # touched: now the newest
    s.put({"id": "r5"}, [])
    assert s.get("r3") is None and s.get("r2") is not None
    resp, msgs = s.get("r4")
    msgs.append("x")  # copies: the store cannot be changed from outside
    assert s.get("r4")[1] == [{"role": "user", "content": "4"}]
    assert s.delete("r4") and not s.delete("r4")


def _events(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        ev = json.loads(lines[1][6:])
        assert ev["type"] == lines[0][7:]
        out.append(ev)
    return out


def test_stream_events_follow_openai(fake_server):
    body = {"model": "fake-k2", "input": "What's the weather in Paris?", "tools": [W],
            "stream": True}  # fmt: skip
    r = _post(fake_server, "/v1/responses", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = _events(r.text)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    types = [e["type"] for e in evs]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    final = evs[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    # reasoning: added, part added, deltas, done, part done, item done
    rs = [t for t in types if "reasoning" in t or t.startswith("response.content_part")]
    assert rs[0] == "response.content_part.added" and rs[-1] == "response.content_part.done"
    reasoning = "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta")
    assert reasoning == final["output"][0]["content"][0]["text"] == "Let me think."
    # the call: added with its name, arguments as fragments, done with the whole text
    fc = final["output"][1]
    added = [e for e in evs if e["type"] == "response.output_item.added"]
    assert added[1]["item"]["name"] == "get_weather" and added[1]["item"]["arguments"] == ""
    frags = [e for e in evs if e["type"] == "response.function_call_arguments.delta"]
    assert len(frags) > 3 and all(e["item_id"] == fc["id"] for e in frags)
    assert "".join(e["delta"] for e in frags) == fc["arguments"] == '{"city": "Paris"}'
    done = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == fc["arguments"] and done[0]["name"] == "get_weather"
    items_done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert items_done == final["output"]
    # the stored response is the one the stream ended with
    got = httpx.get(f"{fake_server.url}/v1/responses/{final['id']}",
                    headers={"Authorization": "Bearer sk-test"}).json()  # fmt: skip
    assert got["output"] == final["output"] and got["status"] == "completed"


def test_stream_text_with_the_openai_client(client):
    stream = client.responses.create(model="fake-k2", input="Hi there", stream=True)
    events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed"
    assert text == final.response.output_text
    assert text.startswith("Hello! I am a fake model.")
    kinds = [e.type for e in events]
    assert kinds.index("response.output_text.done") < kinds.index("response.completed")


def test_max_output_tokens_gives_incomplete(client, fake_server):
    r = client.responses.create(model="fake-k2", input="count", max_output_tokens=20)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 20
    body = {"model": "fake-k2", "input": "count", "max_output_tokens": 20, "stream": True}
    evs = _events(_post(fake_server, "/v1/responses", body).text)
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_tool_choice_required_and_named_and_parallel(client):
    r = client.responses.create(model="fake-k2", input="Hi", tools=[T, W], tool_choice="required")
    assert [o.type for o in r.output][-1] == "function_call"
    r = client.responses.create(
        model="fake-k2", input="Hi", tools=[T, W],
        tool_choice={"type": "function", "name": "get_time"},
    )  # fmt: skip
    assert [o.name for o in r.output if o.type == "function_call"] == ["get_time"]
    two = client.responses.create(model="fake-k2", input="weather in Paris and Rome", tools=[W])
    assert len([o for o in two.output if o.type == "function_call"]) == 2
    one = client.responses.create(
        model="fake-k2", input="weather in Paris and Rome", tools=[W], parallel_tool_calls=False
    )
    assert len([o for o in one.output if o.type == "function_call"]) == 1
    # tool_choice none: never a call
    r = client.responses.create(
        model="fake-k2", input="What's the weather in Paris?", tools=[W], tool_choice="none"
    )
    assert not [o for o in r.output if o.type == "function_call"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, 400, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         400, "input.0.content.0.type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0.type"),
        ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input.0.role"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "temperature": 5}, 400, "temperature"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [W]},
         400, None),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, 400, "tool_choice"),
        ({"input": []}, 400, "input"),
        ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"input": "x", "model": "nope"}, 404, "model"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
        ({"input": "x" * 5000}, 400, "input"),
    ],
)  # fmt: skip
def test_errors(fake_server, body, status, param):
    e = _err(_post(fake_server, "/v1/responses", body), status)
    if param is not None:
        assert e["param"] == param, e


def test_get_and_delete(fake_server, client):
    r = client.responses.create(model="fake-k2", input="Hi there")
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    e = _err(httpx.get(fake_server.url + "/v1/responses/resp_x",
                       headers={"Authorization": "Bearer sk-test"}), 404)  # fmt: skip
    assert "resp_x" in e["message"]
    # the engine freed everything
    assert fake_server.engine.live == {}


def test_text_format_goes_to_the_chat_path(fake_server):
    body = {"input": "x", "text": {"format": {"type": "json_schema", "name": "o",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}  # fmt: skip
    r = _post(fake_server, "/v1/responses", body)
    # the chat path decides (a 400 naming response_format until constrained decoding is there)
    if r.status_code == 400:
        assert _err(r, 400)["param"] == "text.format"
    else:
        assert r.status_code == 200


def test_openai_stream_helper_accumulates(client):
    # client.responses.stream() rebuilds the response from the events and checks their order
    with client.responses.stream(
        model="fake-k2", input="What's the weather in Paris?", tools=[W]
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == "Let me think."
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
