"""End to end on loopback: the real AsyncLLMEngine on the demo checkpoint (or, before the demo
exists, a tiny random `make-checkpoint` one), driven by the real `openai` clients.

Tests that need a model that actually speaks the dialect (the weather tool call, reasoning with
thinking on) use the demo and skip without it; everything else holds for any weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from k2serve.parsers import parse_output

from .conftest import ServerThread

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
MAX_MODEL_LEN = 1024


def _demo_dir() -> str | None:
    """The demo checkpoint; K2SERVE_TEST_DEMO_DIR points these tests at a candidate one."""
    if os.environ.get("K2SERVE_TEST_DEMO_DIR"):
        return os.environ["K2SERVE_TEST_DEMO_DIR"]
    try:
        from k2serve.demo import demo_path

        return os.fspath(demo_path())
    except (ImportError, FileNotFoundError):
        return None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    demo = _demo_dir()
    if demo is not None:
        return demo
    out = tmp_path_factory.mktemp("tiny")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "k2serve.cli",
            "make-checkpoint",
            "--preset",
            "tiny",
            "--format",
            "int4",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return str(out)


@pytest.fixture(scope="module")
def real(model_dir):
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.config import EngineConfig
    from k2serve.server.app import build_app

    cfg = EngineConfig(
        model=model_dir,
        max_model_len=MAX_MODEL_LEN,
        num_kv_pages=512,
        max_num_seqs=32,
        device="cpu",
    )
    engine = AsyncLLMEngine(cfg)
    app = build_app(engine, served_model_names=["demo"], api_key="sk-e2e")
    try:
        with ServerThread(app) as srv:
            srv.engine = engine
            srv.is_demo = model_dir == _demo_dir()
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(real):
    return openai.OpenAI(base_url=real.url + "/v1", api_key="sk-e2e", max_retries=0, timeout=120)


def _need_demo(real):
    if not real.is_demo:
        pytest.skip("needs the trained demo checkpoint (k2serve.demo), not built yet")


def _user(text):
    return [{"role": "user", "content": text}]


def _raw_completion(client, real, messages, thinking, max_tokens, tools=None):
    """The same prompt through /v1/completions (raw text), greedy."""
    tok = real.engine.tokenizer
    text = tok.apply_chat_template(
        messages, tools=tools, chat_template_kwargs={"thinking": thinking}
    )
    ids = tok.encode(text, allow_special=True)
    r = client.completions.create(model="demo", prompt=ids, max_tokens=max_tokens, temperature=0)
    return ids, r.choices[0]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_matches_raw_output_and_usage(client, real, thinking):
    msgs = _user("Hello! Who are you?")
    r = client.chat.completions.create(
        model="demo",
        messages=msgs,
        max_tokens=40,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": thinking}},
    )
    ids, raw = _raw_completion(client, real, msgs, thinking, 40)
    want = parse_output(raw.text, thinking=thinking, truncated=raw.finish_reason == "length")
    m = r.choices[0].message
    assert r.usage.prompt_tokens == len(ids)
    assert 1 <= r.usage.completion_tokens <= 40
    assert (m.content or None) == want.content
    assert getattr(m, "reasoning_content", None) == want.reasoning_content
    if not thinking:
        assert getattr(m, "reasoning_content", None) is None
    assert r.choices[0].finish_reason == raw.finish_reason


def test_demo_reasoning_on_and_off(client, real):
    _need_demo(real)
    on = client.chat.completions.create(
        model="demo", messages=_user("Hello!"), max_tokens=200, temperature=0
    )
    assert on.choices[0].message.reasoning_content
    assert on.choices[0].message.content
    off = client.chat.completions.create(
        model="demo",
        messages=_user("Hello!"),
        max_tokens=200,
        temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}},
    )
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.choices[0].message.content


def test_stream_equals_whole_with_usage(client):
    msgs = _user("Tell me a story.")
    whole = client.chat.completions.create(
        model="demo", messages=msgs, max_tokens=30, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=msgs,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert text == (whole.choices[0].message.content or "")
    assert reasoning == (whole.choices[0].message.reasoning_content or "")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_demo_weather_tool_call(client, real):
    _need_demo(real)
    msgs = _user("What's the weather in Paris?")
    r = client.chat.completions.create(
        model="demo", messages=msgs, tools=[WEATHER_TOOL], max_tokens=200, temperature=0
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert ch.message.reasoning_content  # thinking is on by default for the demo
    # streamed: the same call arrives in the deltas, reasoning first
    chunks = list(
        client.chat.completions.create(
            model="demo", messages=msgs, tools=[WEATHER_TOOL], max_tokens=200, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.id, tc.function.name) for tc in calls] == [(call.id, "get_weather")]
    assert "".join(tc.function.arguments for tc in calls) == call.function.arguments
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == ch.message.reasoning_content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the result goes back as a tool message; the demo answers by quoting it (it was taught
    # a handful of result strings, so two of those show that it reads the message)
    for result in ("Rainy, 12°C", "Snow, -3°C"):
        history = msgs + [
            {
                "role": "assistant",
                "content": ch.message.content,
                "tool_calls": [call.model_dump()],
                "reasoning_content": ch.message.reasoning_content,
            },
            {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": result},
        ]
        r2 = client.chat.completions.create(
            model="demo", messages=history, tools=[WEATHER_TOOL], max_tokens=200, temperature=0
        )
        assert r2.choices[0].finish_reason == "stop"
        assert result in r2.choices[0].message.content


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {}}}


@pytest.mark.parametrize(
    "choice,allowed",
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_tool_choice_forces_the_call_prefix(client, choice, allowed):
    # Whatever the weights, the output must open a call to an allowed function: the generated
    # tokens (seen through logprobs) start with tool_call_prefix(name, 0).
    from k2serve.parsers import tool_call_prefix

    r = client.chat.completions.create(
        model="demo",
        messages=_user("Hi"),
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=choice,
        max_tokens=40,
        temperature=1.0,
        seed=3,
        logprobs=True,
        extra_body={"chat_template_kwargs": {"thinking": False}, "skip_special_tokens": False},
    )
    generated = "".join(t.token for t in r.choices[0].logprobs.content)
    opened = [n for n in allowed if generated.startswith(tool_call_prefix(n, 0))]
    assert opened, generated[:120]
    calls = r.choices[0].message.tool_calls
    if calls:  # a call the model closed within max_tokens is reported under its forced name
        assert calls[0].function.name == opened[0]
        assert r.choices[0].finish_reason == "tool_calls"


def test_n2_seed_stop_logprobs(client):
    r = client.chat.completions.create(
        model="demo", messages=_user("Hi"), n=2, max_tokens=12, temperature=1.0, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens <= 24
    # stop: cut a greedy raw completion at a substring of itself
    base = client.completions.create(
        model="demo",
        prompt="Once upon a time",
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    assert len(text) >= 6
    stop = text[3:6]
    cut = client.completions.create(
        model="demo",
        prompt="Once upon a time",
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # logprobs: greedy picks the top token
    lp = client.chat.completions.create(
        model="demo",
        messages=_user("Hi"),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob


def test_completions_batch_echo_logprobs(client, real):
    tok = real.engine.tokenizer
    prompts = [tok.encode("The sky is"), tok.encode("Hello")]
    r = client.completions.create(
        model="demo", prompt=prompts, max_tokens=5, temperature=0, echo=True, logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("The sky is")
    assert r.choices[1].text.startswith("Hello")
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    generated = 0
    for ch, ids in zip(r.choices, prompts, strict=True):
        lp = ch.logprobs
        # echoed prompt tokens have no logprob; every generated token has one, <= 0
        assert lp.token_logprobs[: len(ids)] == [None] * len(ids)
        gen = lp.token_logprobs[len(ids) :]
        assert 1 <= len(gen) <= 5 and all(x <= 0 for x in gen)
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[len(ids) :])
        assert lp.text_offset == sorted(lp.text_offset)
        generated += len(gen)
    assert r.usage.completion_tokens == generated
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=[prompts[0], "Hello"], max_tokens=2)
    assert "token-id lists" in str(e.value)


def test_real_errors(client, real, monkeypatch):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=_user("word " * 1500))
    assert str(MAX_MODEL_LEN) in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert str(MAX_MODEL_LEN) in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=_user("hi"))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=real.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=_user("hi"), top_p=0)
    monkeypatch.setattr(real.engine, "max_waiting", 0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="demo", messages=_user("hi"), max_tokens=2)


def test_64_async_streams_with_disconnects(real):
    aclient = openai.AsyncOpenAI(
        base_url=real.url + "/v1", api_key="sk-e2e", max_retries=0, timeout=120
    )
    rng = random.Random(0)
    leave_after = [rng.choice([None, 1, 3, 6]) for _ in range(64)]
    before = real.engine.get_stats().generation_tokens

    async def one(i: int) -> str:
        # a stream its client will leave asks for 1000 tokens: unless the server aborts it,
        # it keeps pages and generates for a long time after the client is gone
        leaving = leave_after[i] is not None
        stream = await aclient.chat.completions.create(
            model="demo",
            messages=_user(f"Question {i}: say something."),
            max_tokens=900 if leaving else 24,
            stream=True,
            temperature=0.8,
            seed=i,
            extra_body={"ignore_eos": leaving},
        )
        n = 0
        async for _chunk in stream:
            n += 1
            if leave_after[i] is not None and n >= leave_after[i]:
                await stream.close()
                return "left"
        return "done"

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    # a stream that ends before its planned exit counts as done; the first chunk always comes
    assert all(r == "done" for r, k in zip(results, leave_after, strict=True) if k is None)
    assert all(r == "left" for r, k in zip(results, leave_after, strict=True) if k == 1)
    assert results.count("left") >= 20
    stats = _wait_idle(real.engine)
    assert stats.generation_tokens - before < 64 * 24 + 20 * 64, stats  # far below 20 x 900
    text = httpx.get(real.url + "/metrics").text
    assert "k2serve:kv_cache_used_pages 0.0" in text, stats
    assert "k2serve:num_requests_running 0.0" in text
    assert "k2serve:num_requests_waiting 0.0" in text
    assert httpx.get(real.url + "/health").status_code == 200
    real.engine.engine.check_integrity()
    r = openai.OpenAI(base_url=real.url + "/v1", api_key="sk-e2e").chat.completions.create(
        model="demo", messages=_user("still alive?"), max_tokens=4
    )
    assert r.usage.completion_tokens >= 1


def _wait_idle(engine, rounds=200):
    for _ in range(rounds):  # bounded: the engine frees aborted requests on its next step
        st = engine.get_stats()
        if st.kv_pages_used == 0 and st.num_running == 0 and st.num_waiting == 0:
            return st
        time.sleep(0.05)
    return engine.get_stats()


def test_nonstreaming_disconnect_frees_pages(real):
    body = {"model": "demo", "prompt": "Once", "max_tokens": 1000, "ignore_eos": True}
    hdr = {"Authorization": "Bearer sk-e2e"}
    before = _wait_idle(real.engine).generation_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(real.url + "/v1/completions", json=body, headers=hdr, timeout=0.3)
    st = _wait_idle(real.engine)
    assert st.kv_pages_used == 0 and st.num_running == 0, st
    # the engine stopped early: it did not generate the 1000 tokens nobody was waiting for
    assert st.generation_tokens - before < 1000
    real.engine.engine.check_integrity()


def _read_stream(url: str, max_tokens: int, out: list, started=None) -> None:
    """Collect the SSE events of one streamed completion into `out` (ends with 'EOF' or the
    error name when the server cut the stream)."""
    body = {"prompt": "Once", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    if started is not None and len(out) == 2:
                        started.set()
        out.append("EOF")
    except httpx.HTTPError as e:
        out.append(type(e).__name__)


@pytest.mark.parametrize("engine_process", ["0", "1"])
def test_sigterm_drains_and_exits_0(model_dir, engine_process):
    """SIGTERM with two streams in flight: the short one completes, the long one is cut at
    --drain-timeout, new connections are refused, and the process exits 0; with the engine in
    a process of its own (engine.core_process), that process is gone too."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "k2serve.cli", "serve", "--model", model_dir, "--host",
           "127.0.0.1", "--port", str(port), "--num-kv-pages", "256", "--max-model-len", "1024",
           "--device", "cpu", "--drain-timeout", "2"]  # fmt: skip
    env = {**os.environ, "K2SERVE_API_KEY": "", "K2SERVE_GIL_SWITCH_INTERVAL": "0.0002",
           "K2SERVE_ENGINE_PROCESS": engine_process}  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        short, long_ = [], []
        started = [threading.Event(), threading.Event()]
        threads = [
            threading.Thread(target=_read_stream, args=(url, 40, short, started[0])),
            threading.Thread(target=_read_stream, args=(url, 1000, long_, started[1])),
        ]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        t_sig = time.monotonic()
        proc.send_signal(15)  # SIGTERM with both streams in flight
        for t in threads:
            t.join(60)
        assert proc.wait(timeout=60) == 0
        took = time.monotonic() - t_sig
        # the short request ran to completion
        assert short[-2:] == ["[DONE]", "EOF"], short[-3:]
        assert json.loads(short[-3])["choices"][0]["finish_reason"] == "length"
        # the long one was ended when the drain timeout ran out, with an error event
        assert long_[-2:] == ["[DONE]", "EOF"], long_[-3:]
        assert json.loads(long_[-3])["error"]["code"] == "shutting_down"
        assert len(long_) < 1000
        assert 1.5 < took < 30
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
        log = proc.stdout.read()
        assert "draining" in log and "serving on" in log and "Traceback" not in log
        assert "GIL switch interval 0.20 ms" in log  # the env var reached sys.setswitchinterval
        ready = re.search(r"engine process (\d+) ready", log)
        assert (ready is not None) == (engine_process == "1"), log
        if ready:  # the server stopped its engine process before exiting
            assert not os.path.exists(f"/proc/{ready.group(1)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
