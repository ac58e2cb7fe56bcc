"""Shared request helpers and tool definitions for the server tests."""

from __future__ import annotations

import httpx

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


def _msgs(text="Hi there"):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


def _err(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    return body["error"]


def _post(srv, path, body, key="sk-test", **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=30, **kw)
