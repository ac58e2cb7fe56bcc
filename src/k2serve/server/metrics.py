"""Prometheus metrics of one server app, in a registry of its own (never the global one).

Owns: the metric names (vLLM's, with the `k2serve:` prefix), the per-request timing
(`RequestTimer`) and the scrape-time collector that reads `engine.get_stats()`. The same
registry also holds the vLLM-compatible `vllm:*` series (`vllm_metrics.VllmMetrics`).

Invariants:
- Two apps in one process never share a metric (tests build many apps).
- Engine gauges (running, waiting, KV pages, prefix-cache hit rate) are read at scrape time, so
  /metrics is exact even when no request is in flight.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from k2serve.server.kv_tier_metrics import KVTierCollector
from k2serve.server.vllm_metrics import VllmMetrics, read_stat, scrape_stats

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _stat(stats, *names, default=0.0) -> float:
    """`read_stat`, with `default` when none of the names is present."""
    val = read_stat(stats, *names)
    return float(default) if val is None else val


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        s = scrape_stats(self.engine, logger)
        if s is None:
            return
        used = _stat(s, "kv_pages_used", "num_used_pages", "used_pages", "kv_used_pages")
        total = _stat(s, "kv_pages_total", "num_total_pages", "total_pages", "kv_total_pages")
        values = [
            (
                "k2serve:num_requests_running",
                "Requests in the running batch.",
                _stat(s, "running", "num_running", "num_running_reqs"),
            ),
            (
                "k2serve:num_requests_waiting",
                "Requests waiting to be scheduled.",
                _stat(s, "waiting", "num_waiting", "num_waiting_reqs"),
            ),
            ("k2serve:kv_cache_used_pages", "KV cache pages held by requests.", used),
            ("k2serve:kv_cache_total_pages", "KV cache pages in the pool.", total),
            (
                "k2serve:kv_cache_usage_perc",
                "Fraction of KV cache pages in use (0..1).",
                _stat(s, "kv_cache_usage", "kv_usage", default=(used / total if total else 0.0)),
            ),
            (
                "k2serve:prefix_cache_hit_rate",
                "Prefix-cache hit rate over prompt tokens (0..1).",
                _stat(s, "prefix_cache_hit_rate", "prefix_hit_rate"),
            ),
        ]
        for name, doc, val in values:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], val)
            yield g


class ServerMetrics:
    def __init__(self, engine, model_name: str, max_model_len: int = 131072):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.model_name = model_name
        self.http_requests = Counter(
            "k2serve:http_requests",
            "HTTP requests by path and status code.",
            ["path", "status"],
            registry=r,
        )
        self.request_success = Counter(
            "k2serve:request_success",
            "Finished generations by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "k2serve:prompt_tokens", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            "k2serve:generation_tokens", "Tokens generated.", registry=r
        )
        self.ttft = Histogram(
            "k2serve:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "k2serve:inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "k2serve:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine))
        self.vllm = VllmMetrics(r, engine, model_name, max_model_len)
        r.register(KVTierCollector(engine, model_name))  # host KV tier (issue 27)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Times one engine request: call `tokens(k)` per delta with k new tokens, then `finish`."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.first: float | None = None  # time to first token
        self.generated = 0
        self.done = False

    def admitted(self, prompt_tokens: int, max_tokens: int | None = None) -> None:
        """The engine accepted the request (its prompt counts as processed)."""
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.vllm.observe_start(prompt_tokens, 0, max_tokens)

    def cached(self, tokens: int) -> None:
        """Prompt tokens served from the prefix cache (reported once, with the first output)."""
        self.m.vllm.fallback_hits += tokens

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        t = time.perf_counter()
        gap = None
        if self.last is None:
            self.first = t - self.start
            self.m.ttft.observe(self.first)
            self.m.vllm.observe_first_token(self.first)
        else:
            # A delta with k tokens after dt: k tokens arrived at dt / k apart on average.
            gap = t - self.last
            for _ in range(k):
                self.m.itl.observe(gap / k)
        self.last = t
        self.generated += k
        self.m.generation_tokens.inc(k)
        self.m.vllm.observe_tokens(k, gap)

    def finish(self, reason: str | None) -> None:
        if self.done:
            return
        self.done = True
        e2e = time.perf_counter() - self.start
        self.m.e2e.observe(e2e)
        self.m.request_success.labels(finished_reason=reason or "abort").inc()
        self.m.vllm.observe_finish(reason or "abort", e2e, self.first, self.generated)
