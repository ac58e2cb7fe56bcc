"""Summary statistics of a run: latency percentiles, throughput, goodput, errors by kind.

Definitions (vLLM `bench serve` where it has them; result keys use its names):
- TTFT, E2EL per successful request; ITL = every inter-chunk gap of every successful request;
- TPOT = (E2EL - TTFT) / (completion_tokens - 1), for requests with > 1 output token;
- throughput = totals / benchmark duration (first send to last completion);
- goodput = successful requests meeting every given SLO (`ttft`, `tpot`, `e2el` in ms) per second;
  a request with a single output token has no TPOT and meets any TPOT SLO (as vLLM).
Token totals are from the server's usage; `token_counts` says "usage", "chunks" (the server
sent none: output = content chunks, input = the workload's intended prompt length) or "mixed".
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from k2serve.bench.client import RequestOutcome

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME in {SLO_METRICS}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: not a comma-separated list") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles {text!r}: each must be in (0, 100]")
    return ps


def pct_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def tpot_of(o: RequestOutcome) -> float | None:
    n = o.completion_tokens
    if not o.success or n is None or n < 2 or o.latency is None or o.ttft is None:
        return None
    return (o.latency - o.ttft) / (n - 1)


def _stats(values_s: list[float], name: str, percentiles: tuple[float, ...]) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0  # ms
    out: dict[str, float] = {}
    if arr.size == 0:
        keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
        keys += [f"{pct_key(p)}_{name}_ms" for p in percentiles]
        return dict.fromkeys(keys, math.nan)
    out[f"mean_{name}_ms"] = float(arr.mean())
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(arr.std())
    for p in percentiles:
        out[f"{pct_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def is_good(o: RequestOutcome, slos: dict[str, float]) -> bool:
    if not o.success:
        return False
    tpot = tpot_of(o)
    measured = {"ttft": o.ttft, "tpot": 0.0 if tpot is None else tpot, "e2el": o.latency}
    return all((m := measured[k]) is not None and m * 1000.0 <= v for k, v in slos.items())


def summarize(
    outcomes: list[RequestOutcome],
    duration_s: float,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The result dict (JSON-ready); keys follow vLLM's result file where they exist."""
    ok = [o for o in outcomes if o.success]
    failed = [o for o in outcomes if not o.success]
    with_usage = sum(o.usage_reported for o in ok)
    if not ok or with_usage == len(ok):
        source = "usage"
    elif with_usage == 0:
        source = "chunks"
    else:
        source = "mixed"
    # Without usage, input counts fall back to the workload's intended length (labelled).
    total_in = sum(
        o.prompt_tokens if o.prompt_tokens is not None else o.prompt_len or 0 for o in ok
    )
    total_out = sum(o.completion_tokens or 0 for o in ok)
    dur = max(duration_s, 1e-9)
    res: dict[str, Any] = {
        "duration": duration_s,
        "num_requests": len(outcomes),
        "completed": len(ok),
        "failed": len(failed),
        "errors_by_kind": dict(sorted(Counter(o.error for o in failed).items())),
        # the server's own words for each kind (the first one seen), e.g. a 404's message
        "error_examples": {
            kind: next(o.error_detail for o in failed if o.error == kind)
            for kind in sorted({o.error for o in failed if o.error})
        },
        "token_counts": source,
        "requests_with_usage": with_usage,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": max_output_tokens_per_s(ok),
        "percentiles": list(percentiles),
    }
    if slos:
        good = sum(is_good(o, slos) for o in ok)
        res["goodput_slos_ms"] = dict(slos)
        res["good_requests"] = good
        res["request_goodput"] = good / dur
    series = {
        "ttft": [o.ttft for o in ok if o.ttft is not None],
        "tpot": [t for t in (tpot_of(o) for o in ok) if t is not None],
        "itl": [g for o in ok for g in o.itls],
        "e2el": [o.latency for o in ok if o.latency is not None],
    }
    for name in LATENCY_METRICS:
        res.update(_stats(series[name], name, percentiles))
    return res


def output_tokens_timeline(ok: list[RequestOutcome], bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times [n], output tokens/s in each bin [n]).

    Each request's completion tokens are spread evenly over its content chunks (exact when the
    server sends one token per chunk).
    """
    times: list[float] = []
    weights: list[float] = []
    for o in ok:
        if not o.chunk_times:
            continue
        w = (o.completion_tokens or 0) / len(o.chunk_times)
        times.extend(o.start + t for t in o.chunk_times)
        weights.extend([w] * len(o.chunk_times))
    if not times:
        return np.zeros(0), np.zeros(0)
    end = max(times)
    nbins = max(1, math.ceil(end / bin_s))
    hist, edges = np.histogram(times, bins=nbins, range=(0.0, nbins * bin_s), weights=weights)
    return edges[:-1], hist / bin_s


def max_output_tokens_per_s(ok: list[RequestOutcome]) -> float:
    """Peak output tokens/s over 1-second bins (vLLM reports the same figure)."""
    _, rate = output_tokens_timeline(ok, 1.0)
    return float(rate.max()) if rate.size else 0.0
