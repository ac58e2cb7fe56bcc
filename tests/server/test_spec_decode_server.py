"""The server with `--speculative-config` (n-gram drafting) on the demo checkpoint: the same
completions as with drafting opted out per request (`speculative_decoding: false`), streamed
or not, with logprobs, n, stop strings, structured outputs and thinking_token_budget; the
vLLM spec-decode counters on /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerThread

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 4}  # fmt: skip
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef"


@pytest.fixture(scope="module")
def srv():
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.config import EngineConfig
    from k2serve.server.app import build_app

    cfg = EngineConfig(
        max_model_len=1024, num_kv_pages=512, device="cpu", dtype="float32",
        speculative_config=SPEC,
    )  # fmt: skip
    engine = AsyncLLMEngine(cfg)
    app = build_app(engine, served_model_names=["demo"])
    try:
        with ServerThread(app) as s:
            s.engine = engine
            yield s
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _both(client, **kw):
    on = client.completions.create(model="demo", **kw)
    off = client.completions.create(model="demo", extra_body={"speculative_decoding": False}, **kw)
    return on, off


def test_completions_same_with_and_without_drafts(client):
    kw = dict(prompt=PROMPT, max_tokens=40, temperature=0, logprobs=2, n=2, stop=["\n\n\n"])
    on, off = _both(client, **kw)
    for a, b in zip(on.choices, off.choices, strict=True):
        assert a.text == b.text and a.finish_reason == b.finish_reason
        assert a.logprobs.tokens == b.logprobs.tokens
        assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-4)
    assert on.usage.completion_tokens == off.usage.completion_tokens
    # streamed: the deltas add up to the same text
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=40, temperature=0, stream=True
        )
    )
    assert text == off.choices[0].text


def test_chat_structured_and_thinking_budget(client):
    for extra in (
        {"structured_outputs": {"choice": ["alpha", "beta"]}},
        {"thinking_token_budget": 3, "chat_template_kwargs": {"thinking": True}},
    ):
        kw = dict(
            model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
            temperature=0,
        )  # fmt: skip
        on = client.chat.completions.create(extra_body=extra, **kw)
        off = client.chat.completions.create(
            extra_body={**extra, "speculative_decoding": False}, **kw
        )
        assert on.choices[0].message == off.choices[0].message
    assert on.choices[0].message.content is not None


def test_bad_opt_out_value_is_400(srv):
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": "demo", "prompt": "hi", "max_tokens": 2, "speculative_decoding": "no"},
    )
    assert r.status_code == 400, r.text


def test_spec_decode_metrics(client, srv):
    client.completions.create(model="demo", prompt=PROMPT, max_tokens=30, temperature=0)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    vals = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        fam = fams[f"vllm:spec_decode_{name}"]
        assert fam.type == "counter"
        vals[name] = fam.samples[0].value
    assert vals["num_draft_tokens"] >= vals["num_accepted_tokens"] > 0
    per_pos = fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [s.labels["position"] for s in per_pos] == ["0", "1", "2", "3"]
    assert sum(s.value for s in per_pos) == vals["num_accepted_tokens"]
