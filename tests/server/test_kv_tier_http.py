"""The host KV tier through HTTP (forced on the CPU with K2SERVE_KV_HOST_TIER_ON_CPU): a long
prompt evicted from a small device pool comes back from host RAM, the reply is the same as the
first time, `usage.prompt_tokens_details.cached_tokens` counts the host hit, and /metrics shows
the tier's `vllm:*` series."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerThread


@pytest.fixture
def server(monkeypatch):
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.config import EngineConfig
    from k2serve.server.app import build_app

    monkeypatch.setenv("K2SERVE_KV_HOST_TIER_ON_CPU", "1")
    cfg = EngineConfig(device="cpu", max_model_len=256, num_kv_pages=20, page_size=16,
                       max_num_seqs=2, kv_offloading_size=0.01)  # fmt: skip
    engine = AsyncLLMEngine(cfg)
    app = build_app(engine, served_model_names=["demo"])
    try:
        with ServerThread(app) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.shutdown()


def _complete(srv, prompt):
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_host_hit_over_http(server):
    prompt = list(range(100, 300))  # token ids: 200 tokens = 12 full pages of 16
    first = _complete(server, prompt)
    for start in (400, 700):  # 2 x 200 tokens through a 320-token pool: the first prompt's
        _complete(server, list(range(start, start + 200)))  # pages are all evicted
    again = _complete(server, prompt)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    text = httpx.get(server.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    loaded = [s.value for s in fams["vllm:kv_offload_total_bytes"].samples
              if s.labels.get("transfer_type") == "CPU_to_GPU"]  # fmt: skip
    assert loaded and loaded[0] > 0
    hits = fams["vllm:external_prefix_cache_hits"].samples[0].value
    assert hits == 192
