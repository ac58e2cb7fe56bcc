"""The vLLM-compatible `vllm:*` metrics, scraped over HTTP and read with Prometheus's own text
parser (prometheus_client.parser), and the Grafana dashboard that uses them."""

from __future__ import annotations

import json
import pathlib
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from k2serve.server.vllm_metrics import ITL_BUCKETS, TTFT_BUCKETS, token_buckets

from .helpers import _msgs, _post

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "k2serve.json"

# name -> prometheus type, as vLLM's /metrics declares them
EXPECTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


def _scrape(srv) -> dict:
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _value(fams: dict, name: str, sample: str, **labels) -> float:
    for s in fams[name].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"{sample}{labels} not scraped")


def test_vllm_names_types_and_labels(fake_server):
    before = _scrape(fake_server)
    for name, kind in EXPECTED.items():
        assert name in before, name
        assert before[name].type == kind, (name, before[name].type)
    p0 = _value(before, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="fake-k2")
    g0 = _value(
        before, "vllm:generation_tokens", "vllm:generation_tokens_total", model_name="fake-k2"
    )
    s0 = _value(
        before, "vllm:request_success", "vllm:request_success_total",
        model_name="fake-k2", finished_reason="length",
    )  # fmt: skip
    e0 = _value(
        before,
        "vllm:e2e_request_latency_seconds",
        "vllm:e2e_request_latency_seconds_count",
        model_name="fake-k2",
    )

    body = {"model": "fake-k2", "messages": _msgs("count to ten"), "max_tokens": 7}
    out = _post(fake_server, "/v1/chat/completions", body).json()
    after = _scrape(fake_server)
    usage = out["usage"]
    p1 = _value(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="fake-k2")
    g1 = _value(
        after, "vllm:generation_tokens", "vllm:generation_tokens_total", model_name="fake-k2"
    )
    assert p1 - p0 == usage["prompt_tokens"]
    assert g1 - g0 == usage["completion_tokens"] == 7
    s1 = _value(
        after, "vllm:request_success", "vllm:request_success_total",
        model_name="fake-k2", finished_reason="length",
    )  # fmt: skip
    assert s1 - s0 == 1
    e1 = _value(
        after,
        "vllm:e2e_request_latency_seconds",
        "vllm:e2e_request_latency_seconds_count",
        model_name="fake-k2",
    )
    assert e1 - e0 == 1
    # every series carries the model_name label
    for name in EXPECTED:
        for s in after[name].samples:
            assert s.labels.get("model_name") == "fake-k2", (name, s)
    # vLLM's buckets
    ttft = [
        float(s.labels["le"])
        for s in after["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    ]
    assert tuple(ttft) == TTFT_BUCKETS
    itl = [
        float(s.labels["le"])
        for s in after["vllm:inter_token_latency_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    ]
    assert tuple(itl) == ITL_BUCKETS
    # the fake engine has no prefix-cache counters: the server counts the queried prompt tokens
    q = _value(
        after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total",
        model_name="fake-k2",
    )  # fmt: skip
    assert q >= usage["prompt_tokens"]
    # k2serve's own names are still there
    assert "k2serve:num_requests_running" in after


def test_gauges_follow_the_engine(fake_server):
    eng = fake_server.engine
    eng.running, eng.waiting = 3, 5
    eng.live["x"] = 1024
    try:
        fams = _scrape(fake_server)
    finally:
        eng.running, eng.waiting = 0, 0
        eng.live.pop("x", None)
    assert _value(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 3
    assert _value(fams, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 5
    usage = _value(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
    assert usage == 1024 / eng.num_pages
    assert _value(fams, "vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc") == usage


def test_token_buckets_are_vllms_1_2_5():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(1) == [1]
    assert token_buckets(4096)[-1] == 2000


def test_grafana_dashboard_queries_only_served_metrics(fake_server):
    dash = json.loads(DASHBOARD.read_text())
    scraped = set()
    for fam in _scrape(fake_server).values():
        scraped.update(s.name for s in fam.samples)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    used = {m for e in exprs for m in re.findall(r"vllm:[a-z0-9_]+", e)}
    assert used, exprs
    missing = sorted(used - scraped)
    assert not missing, f"the dashboard queries series /metrics does not serve: {missing}"
    # each query selects on the model_name variable
    assert all('model_name=~"$model_name"' in e for e in exprs)
    wanted = {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total"}
    assert wanted <= used
