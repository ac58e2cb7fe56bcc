"""Issue #31: the outside probe's reproducers (fake engine, real HTTP over uvicorn).

Each test failed before its fix: lone surrogates, unusable tool names, tool-schema checks on the
event loop, the sentinel choice's cost, Responses metadata limits, log injection, several API
keys with per-key stored responses, OPTIONS / HEAD, one access-log line per request and strict
integer / boolean fields.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from k2serve.server.app import build_app

from .conftest import ServerThread
from .fakes import FakeAsyncEngine
from .helpers import _err, _msgs

KEY = "sk-test"


@pytest.fixture(scope="module")
def srv():
    engine = FakeAsyncEngine()
    app = build_app(engine, served_model_names=["fake"], api_key=["sk-test", "sk-other"])
    with ServerThread(app) as s:
        s.engine, s.app = engine, app
        yield s


def _raw(srv, path, text: str, key=KEY, method="POST"):
    """POST a JSON text as is (json.dumps escapes a lone surrogate as \\ud800)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.request(method, srv.url + path, content=text.encode(), headers=headers, timeout=30)


def _post(srv, path, body, key=KEY):
    return _raw(srv, path, json.dumps(body), key)


# ---- A: lone surrogates ---------------------------------------------------------------------
LONE = "a\ud800"
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
RESPONSES_CASES = [
    {"instructions": LONE},
    {"metadata": {LONE: "x"}},
    {"metadata": {"k": LONE}},
    {"user": LONE},
    {"truncation": LONE},
    {"reasoning": {"effort": LONE}},
    {"text": {"format": {"type": "json_schema", "name": LONE, "schema": {"type": "object"}}}},
    {"tools": [{**TOOL, "description": LONE}]},
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", RESPONSES_CASES, ids=lambda e: next(iter(e)))
def test_lone_surrogates_are_a_400_naming_the_field(srv, extra, stream):
    body = {"model": "fake", "input": "hi", "stream": stream, **extra}
    r = _post(srv, "/v1/responses", body)
    err = _err(r, 400)
    assert "surrogate" in err["message"] and err["param"]


def test_lone_surrogate_in_an_echoed_prompt_is_a_400(srv):
    r = _post(srv, "/v1/completions", {"prompt": LONE, "echo": True, "max_tokens": 2})
    assert _err(r, 400)["param"] == "prompt"
    r = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]})
    assert _err(r, 400)["param"] == "messages.0.content"
    ok = _post(srv, "/v1/chat/completions", {"messages": _msgs("\U0001f600 ok"), "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # a surrogate pair is one ordinary character


def test_surrogates_in_a_reply_are_encoded_safely():
    from k2serve.server.finite import SafeJSONResponse
    from k2serve.server.sse import sse_event

    body = SafeJSONResponse({"text": LONE}).body
    assert json.loads(body)["text"] == LONE
    assert json.loads(sse_event({"t": LONE})[len("data: ") :])["t"] == LONE


# ---- B: tool names the Kimi dialect cannot write ---------------------------------------------
@pytest.mark.parametrize("name", ["a<b", "a>b", "get:x", "a\nb"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_unencodable_tool_names_are_a_400_naming_the_tool(srv, name, choice):
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    tc = "required" if choice == "required" else {"type": "function", "function": {"name": name}}
    r = _post(
        srv, "/v1/chat/completions", {"messages": _msgs(), "tools": [tool], "tool_choice": tc}
    )
    err = _err(r, 400)
    assert repr(name) in err["message"] and err["param"] == "tools.0.function.name"
    rtool = {"type": "function", "name": name, "parameters": {"type": "object"}}
    rtc = "required" if choice == "required" else {"type": "function", "name": name}
    r = _post(srv, "/v1/responses", {"input": "hi", "tools": [rtool], "tool_choice": rtc})
    assert repr(name) in _err(r, 400)["message"]


def test_lenient_tool_names_still_work(srv):
    tool = {"type": "function", "function": {"name": "ns.tool-1 ü", "parameters": {}}}
    body = {"messages": _msgs(), "tools": [tool], "tool_choice": "required", "max_tokens": 4}
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text


def test_unusable_tool_schema_is_a_400_not_a_500(srv):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}
    body = {"messages": _msgs(), "tools": [tool], "tool_choice": "required"}
    r = _post(srv, "/v1/chat/completions", body)
    assert "not" in _err(r, 400)["message"]


# ---- E: tool schemas are checked off the event loop, once per distinct schema ----------------
def test_tool_schema_checks_run_off_the_event_loop(srv, monkeypatch):
    import k2serve.server.protocol as protocol

    threads: list[str] = []
    real = protocol.check_json_schema

    def spy(schema):
        threads.append(threading.current_thread().name)
        return real(schema)

    monkeypatch.setattr(protocol, "check_json_schema", spy)
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object",
         "properties": {"x": {"type": "integer", "maximum": i % 3}}}}}
        for i in range(30)
    ]  # fmt: skip
    r = _post(srv, "/v1/chat/completions", {"messages": _msgs(), "tools": tools, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert threads and all(t.startswith("k2serve-cpu") for t in threads), set(threads)
    assert len(threads) <= 3  # three distinct schemas: each is checked once


def test_bad_tool_schema_still_names_the_tool(srv):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    r = _post(srv, "/v1/chat/completions", {"messages": _msgs(), "tools": [tool]})
    assert _err(r, 400)["param"] == "tools.0.function.parameters"


# ---- F: the sentinel choice is linear in the request -------------------------------------------
def test_sentinel_choice_is_linear():
    from k2serve.tokenizer.safe import pick_sentinel

    every = "".join(chr(c) for c in range(0xE000, 0xF8FF))
    strings = ["a"] * 20_000 + [every]
    t = time.perf_counter()
    assert pick_sentinel(strings) == "\uf8ff"
    assert time.perf_counter() - t < 1.0
    assert pick_sentinel(["x\\ue000", "\ue001"]) == "\ue002"  # escaped forms count too
    with pytest.raises(ValueError, match="private-use"):
        pick_sentinel([every + "\uf8ff"] + ["a"] * 10_000)


# ---- G: Responses metadata limits -----------------------------------------------------------
@pytest.mark.parametrize(
    "meta",
    [
        {f"k{i}": "v" for i in range(17)},
        {"k" * 65: "v"},
        {"k": "v" * 513},
        {"k": 5},
    ],
    ids=["17-pairs", "long-key", "long-value", "not-a-string"],
)
def test_responses_metadata_limits(srv, meta):
    r = _post(srv, "/v1/responses", {"input": "hi", "metadata": meta})
    assert _err(r, 400)["param"] == "metadata"


def test_responses_metadata_at_the_limits_is_fine(srv):
    meta = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = _post(srv, "/v1/responses", {"input": "hi", "metadata": meta, "max_output_tokens": 2})
    assert r.status_code == 200, r.text and r.json()["metadata"] == meta


# ---- several API keys; stored responses belong to their key ----------------------------------
def test_several_keys_and_responses_scoped_to_their_key(srv):
    r = _post(srv, "/v1/responses", {"input": "hi", "max_output_tokens": 2}, key="sk-other")
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{srv.url}/v1/responses/{rid}", headers=h).status_code == 404
    assert httpx.delete(f"{srv.url}/v1/responses/{rid}", headers=h).status_code == 404
    follow = {"input": "more", "previous_response_id": rid, "max_output_tokens": 2}
    assert _err(_post(srv, "/v1/responses", follow), 404)["param"] == "previous_response_id"
    assert _post(srv, "/v1/responses", follow, key="sk-other").status_code == 200
    h2 = {"Authorization": "Bearer sk-other"}
    assert httpx.get(f"{srv.url}/v1/responses/{rid}", headers=h2).status_code == 200
    assert httpx.delete(f"{srv.url}/v1/responses/{rid}", headers=h2).status_code == 200
    assert (
        httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
    )


# ---- OPTIONS / HEAD -------------------------------------------------------------------------
def test_options_lists_every_method_and_head_works(srv):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.options(f"{srv.url}/v1/responses/resp_1", headers=h)
    assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "DELETE"}
    for path in ("/health", "/version", "/metrics"):
        r = httpx.head(srv.url + path)
        assert r.status_code == 200 and r.content == b"", path
    assert httpx.head(f"{srv.url}/v1/models", headers=h).status_code == 200


# ---- logs: no injection, one access line per request, disconnects -----------------------------
def test_logged_client_strings_cannot_forge_lines(srv, caplog):
    with caplog.at_level(logging.INFO, logger="k2serve.server"):
        httpx.get(f"{srv.url}/v1/x%0A%0DFORGED%1b[31m", headers={"Authorization": "Bearer x"})
        _post(srv, "/v1/chat/completions", {"messages": [], "model": "m\nFORGED"})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "FORGED" in text
    assert all(not line.lstrip("\r").startswith("FORGED") for line in text.splitlines()), text
    assert "\x1b" not in text and "\r" not in text


def test_one_access_line_per_finished_request(srv, caplog):
    with caplog.at_level(logging.INFO, logger="k2serve.server"):
        r = _post(srv, "/v1/chat/completions", {"messages": _msgs(), "max_tokens": 3})
        assert r.status_code == 200
        usage = r.json()["usage"]
        httpx.get(srv.url + "/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "k2serve.server.access"]
    chat = [ln for ln in lines if "/v1/chat/completions" in ln]
    assert len(chat) == 1, lines
    assert "POST" in chat[0] and " 200 " in chat[0] and "ms" in chat[0]
    assert f"{usage['prompt_tokens']}+{usage['completion_tokens']} tokens" in chat[0]


def test_access_log_can_be_turned_off(caplog):
    app = build_app(FakeAsyncEngine(), served_model_names=["fake"], access_log=False)
    with ServerThread(app) as s, caplog.at_level(logging.INFO, logger="k2serve.server"):
        httpx.get(s.url + "/v1/models")
    assert not [r for r in caplog.records if r.name == "k2serve.server.access"]


def test_access_log_flags_parse():
    import argparse

    from k2serve.server.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).disable_access_log is False
    for flag in ("--disable-access-log", "--disable-uvicorn-access-log", "--disable-log-requests"):
        assert p.parse_args([flag]).disable_access_log is True
    assert p.parse_args(["--api-key", "a", "b"]).api_key == ["a", "b"]


def test_a_disconnect_is_logged_as_a_disconnect(caplog):
    engine = FakeAsyncEngine(delay=0.05)
    app = build_app(engine, served_model_names=["fake"])
    body = {"messages": _msgs("x " * 40), "max_tokens": 200}
    with ServerThread(app) as s, caplog.at_level(logging.INFO, logger="k2serve.server"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/chat/completions", json=body, timeout=0.3)
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("disconnected" in m and "/v1/chat/completions" in m for m in msgs), msgs
    assert not any(m.startswith("rejected") and "499" in m for m in msgs), msgs


def test_a_streaming_disconnect_is_logged_as_a_disconnect(caplog):
    engine = FakeAsyncEngine(delay=0.05)
    app = build_app(engine, served_model_names=["fake"])
    body = {"messages": _msgs("x " * 40), "max_tokens": 200, "stream": True}
    with ServerThread(app) as s, caplog.at_level(logging.INFO, logger="k2serve.server"):
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=10) as r:
            next(r.iter_lines())  # the first event arrived: the stream is under way
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    msgs = [r.getMessage() for r in caplog.records if r.name == "k2serve.server.access"]
    line = [m for m in msgs if "/v1/chat/completions" in m]
    assert len(line) == 1 and "disconnected" in line[0], msgs


# ---- strict integer / boolean fields (as OpenAI) ---------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", "10"), ("n", "2"), ("stream", "yes"), ("stream", 1), ("max_tokens", 10.0),
     ("temperature", "0.5"), ("logprobs", "true"), ("seed", True)],
)  # fmt: skip
def test_strings_and_booleans_are_not_coerced(srv, field, value):
    r = _post(srv, "/v1/chat/completions", {"messages": _msgs(), field: value})
    assert _err(r, 400)["param"] == field


def test_numbers_where_a_float_is_expected_accept_integers(srv):
    r = _post(srv, "/v1/chat/completions", {"messages": _msgs(), "temperature": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- E at the body limit: parse and validation in pieces, /health keeps answering ------------
def test_pieces_parse_like_json_loads():
    from k2serve.server.big_body import loads_in_pieces

    for text in ['{"a": [1, {"b": [2]}, "x"], "c": {"d": []}, "e": [] , "f": null}', "[1, 2]",
                 '  {"k": "\\u00e9\\ud83d\\ude00", "l": [ ]}  ', '{"a": NaN}', "{}"]:  # fmt: skip
        assert loads_in_pieces(text.encode()) == json.loads(text)
    for bad in ['{"a": [1,]}', '{"a": 1', '{"a": 1} x', '{"a" 1}', ""]:
        with pytest.raises(json.JSONDecodeError):
            loads_in_pieces(bad.encode())


def test_big_bodies_do_not_stall_the_event_loop():
    engine = FakeAsyncEngine(max_model_len=10**9)
    app = build_app(engine, served_model_names=["fake"], max_body_bytes=32 * 2**20)
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "description": "d" * 40,
         "parameters": {"type": "object", "properties": {f"x{i}": {"type": "integer"}}}}}
        for i in range(6_000)
    ]  # fmt: skip
    body = json.dumps({"messages": _msgs(), "tools": tools, "tool_choice": "none", "max_tokens": 1})
    bad = json.dumps({"messages": _msgs(), "tools": [*tools[:999], {"type": "function"}]})
    with ServerThread(app) as s:
        done: list = []

        def send():
            done.append(httpx.post(s.url + "/v1/chat/completions", content=body, timeout=120,
                                   headers={"Content-Type": "application/json"}))  # fmt: skip

        worst = 0.0
        th = threading.Thread(target=send)
        th.start()
        while th.is_alive():
            t = time.perf_counter()
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.perf_counter() - t)
            time.sleep(0.02)
        th.join()
        r = httpx.post(s.url + "/v1/chat/completions", content=bad, timeout=60,
                       headers={"Content-Type": "application/json"})  # fmt: skip
    assert done and done[0].status_code == 200, done[0].text[:300]
    assert worst < 1.0, worst
    assert _err(r, 400)["param"] == "tools.999.function"
