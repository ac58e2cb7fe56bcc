"""`serve --stream-interval N` end to end on loopback (the demo checkpoint, CPU): streamed
completions and chat completions carry several tokens a chunk and give the same text, finish
reason and usage as the whole response."""

import os

import httpx
import pytest

from .conftest import ServerThread


@pytest.fixture(scope="module")
def server():
    from k2serve.demo import demo_path
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.config import EngineConfig
    from k2serve.server.app import build_app

    cfg = EngineConfig(
        model=os.fspath(demo_path()),
        max_model_len=512,
        num_kv_pages=128,
        max_num_seqs=8,
        device="cpu",
        stream_interval=4,
    )
    engine = AsyncLLMEngine(cfg)
    app = build_app(engine, served_model_names=["demo"])
    try:
        with ServerThread(app) as srv:
            yield srv
    finally:
        engine.shutdown()


def _events(resp) -> list[dict]:
    import json

    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_chunks_carry_several_tokens_and_the_same_result(server, route):
    body = {"model": "demo", "max_tokens": 21, "temperature": 0, "ignore_eos": True}
    if route == "completions":
        body["prompt"] = "Once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a story."}]
        body["chat_template_kwargs"] = {"thinking": False}
    url = f"{server.url}/v1/{route}"
    whole = httpx.post(url, json=body, timeout=120).json()
    with httpx.stream(
        "POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        events = _events(r)
    choices = [e["choices"][0] for e in events if e.get("choices")]
    key = "text" if route == "completions" else "content"
    pieces = [c.get(key) if key == "text" else (c["delta"].get("content") or "") for c in choices]
    w = whole["choices"][0]
    assert "".join(p or "" for p in pieces) == (
        w["text"] if key == "text" else w["message"]["content"]
    )
    assert choices[-1]["finish_reason"] == w["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 21
    # 21 tokens: the first at once, then every 4: at most 1 + 5 + 1 content chunks
    assert len([p for p in pieces if p]) <= 7
