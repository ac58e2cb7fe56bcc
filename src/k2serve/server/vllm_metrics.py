"""vLLM-compatible Prometheus metrics (`vllm:*`, every series labelled `model_name`).

Owns: the names, types, help texts and buckets of the metrics that vLLM's /metrics exposes and
that dashboards, alerts and autoscalers written for vLLM read (Grafana's vLLM dashboard, KEDA/HPA
rules on `vllm:num_requests_waiting`, routers that read `vllm:kv_cache_usage_perc`). They live
beside k2serve's own `k2serve:*` metrics (`server/metrics.py`) in the same registry.

Names follow vLLM v1 (`docs/usage/metrics.md`): counters are declared without `_total` and
exposed with it (`vllm:prompt_tokens_total`), as prometheus_client and vLLM do. The deprecated
names vLLM still serves (`vllm:gpu_cache_usage_perc`, `vllm:time_per_output_token_seconds`) are
kept because the published dashboards still query them.

Invariants:
- Scheduler gauges and prefix-cache counters are read from `engine.get_stats()` at scrape time
  (exact with no request in flight); when the engine does not count prefix-cache lookups, the
  server's own per-request counts (prompt tokens / cached tokens) stand in.
- Per-request series (TTFT, ITL, e2e, token counts, finish reasons) are fed by `RequestTimer`
  exactly once per request.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's `build_1_2_5_buckets(max_model_len)`: 1, 2, 5, 10, 20, 50, ... <= max_model_len."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return out
            out.append(v)
        exp += 1


def read_stat(stats, *names) -> float | None:
    """The first present attribute (or dict key) of an EngineStats-like object, None if none."""
    for name in names:
        val = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
        if val is not None:
            return float(val)
    return None


def scrape_stats(engine, log: logging.Logger):
    """`engine.get_stats()` for a /metrics scrape, or None (logged on `log`) when it fails: a
    scrape must never fail because the engine is busy or gone."""
    try:
        return engine.get_stats()
    except Exception:
        log.exception("engine.get_stats() failed during a /metrics scrape")
        return None


class VllmMetrics:
    """The `vllm:` series of one app. `observe_*` methods are called by `RequestTimer`."""

    def __init__(self, registry: CollectorRegistry, engine, model_name: str, max_model_len: int):
        self.model_name = model_name
        lbl = ["model_name"]
        r = registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, lbl + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            h = Histogram(name, doc, lbl, buckets=buckets, registry=r)
            h.labels(model_name)  # the series exist (empty) before the first request
            return h

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )  # fmt: skip
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (deprecated: use "
            "vllm:inter_token_latency_seconds).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LATENCY_BUCKETS,
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            tokens,
        )  # fmt: skip
        for reason in FINISH_REASONS:  # the series exist (at 0) before the first request ends
            self.request_success.labels(model_name, reason)
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)
        self._hot: tuple | None = None  # (generation_tokens, itl, tpot) children of model_name
        # server-side prefix-cache counts, used when the engine does not report its own
        self.fallback_queries = 0
        self.fallback_hits = 0
        r.register(_VllmEngineCollector(engine, self))

    # -- per request --------------------------------------------------------------------------
    def observe_start(self, prompt_tokens: int, cached_tokens: int, max_tokens: int | None) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        if max_tokens is not None:
            self.request_max_tokens.labels(name).observe(max_tokens)
        self.fallback_queries += prompt_tokens
        self.fallback_hits += cached_tokens

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_tokens(self, k: int, gap: float | None) -> None:
        # NOTE: per streamed token: the labelled children are looked up once, not per call
        hot = self._hot
        if hot is None:
            name = self.model_name
            hot = self._hot = (
                self.generation_tokens.labels(name),
                self.itl.labels(name),
                self.tpot.labels(name),
            )
        gen, itl, tpot = hot
        gen.inc(k)
        if gap is not None:
            for _ in range(k):
                itl.observe(gap / k)
                tpot.observe(gap / k)

    def observe_finish(self, reason: str, e2e: float, ttft: float | None, generated: int) -> None:
        name = self.model_name
        self.request_success.labels(name, reason).inc()
        self.e2e.labels(name).observe(e2e)
        self.request_generation_tokens.labels(name).observe(generated)
        if ttft is not None:
            self.prefill_time.labels(name).observe(ttft)
            self.decode_time.labels(name).observe(max(0.0, e2e - ttft))


class _VllmEngineCollector:
    """Scheduler gauges and prefix-cache / preemption counters, read at scrape time."""

    def __init__(self, engine, metrics: VllmMetrics):
        self.engine = engine
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        s = scrape_stats(self.engine, logger)
        if s is None:
            return
        name = [self.m.model_name]
        used = read_stat(s, "kv_pages_used", "num_used_pages", "used_pages", "kv_used_pages") or 0.0
        total = read_stat(s, "kv_pages_total", "num_total_pages", "total_pages", "kv_total_pages")
        usage = read_stat(s, "kv_cache_usage", "kv_usage")
        if usage is None:
            usage = used / total if total else 0.0
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             read_stat(s, "running", "num_running", "num_running_reqs")),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             read_stat(s, "waiting", "num_waiting", "num_waiting_reqs")),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:gpu_cache_usage_perc",
             "GPU KV-cache usage. 1 means 100 percent usage (deprecated: use "
             "vllm:kv_cache_usage_perc).", usage),
        )  # fmt: skip
        for metric, doc, val in gauges:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, val or 0.0)
            yield g
        queries = read_stat(s, "prefix_cache_queries")
        hits = read_stat(s, "prefix_cache_hits")
        if queries is None or hits is None:
            queries, hits = float(self.m.fallback_queries), float(self.m.fallback_hits)
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", queries),
            ("vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             read_stat(s, "num_preemptions") or 0.0),
        )  # fmt: skip
        for metric, doc, val in counters:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, val)
            yield c
        yield from _spec_decode_counters(getattr(s, "spec_decode", None), name)


def _spec_decode_counters(sd, name: list[str]):
    """vLLM's speculative-decoding counters (only with --speculative-config)."""
    if sd is None:
        return
    for metric, doc, val in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", sd.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", sd.num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
         sd.num_accepted_tokens),
    ):  # fmt: skip
        c = CounterMetricFamily(metric, doc, labels=["model_name"])
        c.add_metric(name, float(val))
        yield c
    c = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=["model_name", "position"],
    )
    for pos, val in enumerate(sd.num_accepted_tokens_per_pos):
        c.add_metric([*name, str(pos)], float(val))
    yield c
