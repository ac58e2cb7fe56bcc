"""Prometheus series of the host KV tier (`--kv-offloading-size`, k2serve.cache.host_tier).

vLLM's names where vLLM has one, labelled `model_name` like the other `vllm:*` series:
- `vllm:kv_offload_total_bytes{transfer_type="GPU_to_CPU"|"CPU_to_GPU"}` and
  `vllm:kv_offload_total_time{transfer_type=...}` (seconds the copies took), as vLLM's
  offloading connector; `vllm:kv_offload_store_bytes` / `vllm:kv_offload_load_bytes`, its newer
  per-direction spelling;
- `vllm:kv_offload_cpu_cache_usage_perc` and v0's `vllm:cpu_cache_usage_perc` (host pages in use);
- `vllm:external_prefix_cache_hits` (prompt tokens restored from host RAM instead of computed);
- v0's `vllm:num_requests_swapped`.
k2serve's own: `k2serve:kv_host_tier_pages`, `k2serve:kv_swap_outs` / `k2serve:kv_swap_ins`,
`k2serve:kv_copy_stalls` (forwards that waited for a copy on the GPU).

Read from `engine.get_stats()` at scrape time; nothing is exported while the tier is off.
"""

from __future__ import annotations

import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from k2serve.server.vllm_metrics import scrape_stats

logger = logging.getLogger(__name__)

DIRECTIONS = (("GPU_to_CPU", "d2h"), ("CPU_to_GPU", "h2d"))


class KVTierCollector:
    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self):
        s = scrape_stats(self.engine, logger)
        if s is None:
            return
        total = getattr(s, "kv_host_pages_total", 0)
        if not total:
            return
        name = [self.model_name]
        lbl = ["model_name"]
        usage = s.kv_host_pages_used / total
        by_dir = (
            ("vllm:kv_offload_total_bytes", "Bytes moved between the GPU KV cache and host RAM.",
             "kv_offload_bytes"),
            ("vllm:kv_offload_total_time", "Seconds the KV offloading copies took.",
             "kv_offload_seconds"),
        )  # fmt: skip
        for metric, doc, attr in by_dir:
            c = CounterMetricFamily(metric, doc, labels=[*lbl, "transfer_type"])
            for label, d in DIRECTIONS:
                c.add_metric([*name, label], float(getattr(s, f"{attr}_{d}")))
            yield c
        counters = (
            ("vllm:kv_offload_store_bytes", "Bytes copied from the GPU KV cache to host RAM.",
             s.kv_offload_bytes_d2h),
            ("vllm:kv_offload_load_bytes", "Bytes copied from host RAM to the GPU KV cache.",
             s.kv_offload_bytes_h2d),
            ("vllm:external_prefix_cache_hits",
             "Prompt tokens restored from the host KV tier instead of computed.",
             s.host_cache_hits),
            ("k2serve:kv_swap_outs", "Preempted requests whose KV was swapped to host RAM.",
             s.num_swap_outs),
            ("k2serve:kv_swap_ins", "Swapped-out requests whose KV was copied back.",
             s.num_swap_ins),
            ("k2serve:kv_copy_stalls", "Forwards that waited on the GPU for a KV write-back.",
             s.kv_copy_stalls),
        )  # fmt: skip
        for metric, doc, val in counters:
            c = CounterMetricFamily(metric, doc, labels=lbl)
            c.add_metric(name, float(val))
            yield c
        gauges = (
            ("vllm:kv_offload_cpu_cache_usage_perc", "Host KV tier usage. 1 means 100 percent.",
             usage),
            ("vllm:cpu_cache_usage_perc", "Host KV tier usage. 1 means 100 percent usage.", usage),
            ("vllm:num_requests_swapped", "Requests whose KV is swapped out to host RAM.",
             s.num_swapped),
            ("k2serve:kv_host_tier_pages", "Pages of the host KV tier (per rank).", total),
        )  # fmt: skip
        for metric, doc, val in gauges:
            g = GaugeMetricFamily(metric, doc, labels=lbl)
            g.add_metric(name, float(val))
            yield g
