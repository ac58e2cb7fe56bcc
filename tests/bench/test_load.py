"""Arrivals (Poisson / gamma / burst), concurrency cap, warm-ups, duration, errors by kind."""

from __future__ import annotations

import math
import socket
import time

import numpy as np
import pytest

from k2serve.bench.client import RequestSpec
from k2serve.bench.datasets import SampleRequest, random_dataset
from k2serve.bench.metrics import summarize
from k2serve.bench.runner import LoadSpec, interarrival_gaps, run, warmup_sample


def _spec(base: str, timeout: float = 30.0) -> RequestSpec:
    return RequestSpec(
        base + "/v1/chat/completions", "chat", "fake-model", timeout_s=timeout,
        warm_url=base + "/v1/models",
    )  # fmt: skip


def _gaps(rate, burstiness, n, seed=0):
    g = interarrival_gaps(rate, burstiness, np.random.default_rng(seed))
    return np.array([next(g) for _ in range(n)])


def _ks_exponential(x: np.ndarray, rate: float) -> float:
    xs = np.sort(x)
    n = xs.size
    cdf = 1.0 - np.exp(-rate * xs)
    return float(max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_gaps_are_exponential_with_the_given_rate(seed):
    rate, n = 50.0, 4000
    x = _gaps(rate, 1.0, n, seed)
    # mean 1/rate (sd of the mean = 1/(rate sqrt n), 5 sd allowed); CV 1; KS at alpha ~ 0.001.
    assert abs(x.mean() - 1 / rate) < 5 / (rate * math.sqrt(n))
    assert abs(x.std() / x.mean() - 1.0) < 0.08
    assert _ks_exponential(x, rate) < 1.95 / math.sqrt(n)
    # ... and not some other law with the same mean: a uniform fails the same KS test.
    u = np.random.default_rng(seed).uniform(0, 2 / rate, n)
    assert _ks_exponential(u, rate) > 1.95 / math.sqrt(n)


def test_burstiness_changes_the_spread_not_the_mean():
    rate, n = 20.0, 4000
    for k in (0.25, 4.0):
        x = _gaps(rate, k, n)
        assert abs(x.mean() - 1 / rate) < 0.06 / rate
        assert abs(x.std() / x.mean() - 1 / math.sqrt(k)) < 0.1 / math.sqrt(k)  # gamma CV


def test_infinite_rate_is_a_burst():
    assert not _gaps(math.inf, 1.0, 100).any()


def test_server_sees_the_scheduled_poisson_arrivals(fake_server):
    server = fake_server(ttft_s=0.0, itl_s=0.001)
    rate, n, seed = 40.0, 40, 7
    samples = random_dataset(n, input_len=5, output_len=2, seed=0)
    res = run(
        _spec(server.base_url), samples, LoadSpec(request_rate=rate, seed=seed, progress=False)
    )
    assert all(o.success for o in res.outcomes)
    schedule = np.concatenate([[0.0], np.cumsum(_gaps(rate, 1.0, n - 1, seed))])
    arrived = np.array(server.arrivals) - server.arrivals[0]
    # The server sees the schedule up to one constant offset (connect time) and a little jitter.
    lag = arrived - schedule
    lag -= np.median(lag)
    assert np.abs(lag).max() < 0.03, lag
    assert np.median(np.abs(lag)) < 0.005, lag
    sent = np.array([o.start for o in res.outcomes])
    assert np.all(np.abs((sent - sent[0]) - schedule) < 0.05)


def test_max_concurrency_caps_requests_in_flight(fake_server):
    server = fake_server(ttft_s=0.05, itl_s=0.01)
    samples = random_dataset(12, input_len=5, output_len=4, seed=0)
    res = run(_spec(server.base_url), samples, LoadSpec(max_concurrency=3, progress=False))
    assert all(o.success for o in res.outcomes)
    assert server.max_in_flight == 3
    # 12 requests of ~80 ms, 3 at a time: at least 4 rounds.
    assert res.duration_s >= 4 * 0.08


def test_burst_sends_everything_at_once(fake_server):
    server = fake_server(ttft_s=0.2, itl_s=0.01)
    res = run(_spec(server.base_url), random_dataset(10, 5, 3), LoadSpec(progress=False))
    assert all(o.success for o in res.outcomes)
    assert server.max_in_flight == 10
    assert res.duration_s < 0.2 + 0.02 * 2 + 0.2  # one round, not ten


def test_warmups_are_sent_but_not_measured(fake_server):
    server = fake_server(ttft_s=0.0, itl_s=0.001)
    samples = random_dataset(5, 5, 2)
    res = run(_spec(server.base_url), samples, LoadSpec(num_warmups=3, progress=False))
    assert len(server.arrivals) == 8
    assert len(res.outcomes) == 5 and len(res.warmup_outcomes) == 3


def test_warmups_share_no_prefix_with_measured_requests(fake_server):
    """A warm-up that sent a measured prompt as is left it in the server's prefix cache, so
    that request's TTFT measured a one-token prefill."""
    server = fake_server(ttft_s=0.0, itl_s=0.001)
    samples = random_dataset(2, 50, 2)
    run(_spec(server.base_url), samples, LoadSpec(num_warmups=2, progress=False))
    text = [b["messages"][-1]["content"] for b in server.bodies]  # chat API: a user message
    warm, measured = text[:2], text[2:]
    # (concurrent requests: the server may see them in either order)
    assert sorted(measured) == sorted(s.prompt for s in samples)
    matched = []
    for w in warm:
        s = next(s for s in samples if w.endswith(s.prompt))
        assert w != s.prompt and not w.startswith(s.prompt[:8])
        matched.append(s.prompt)
    assert sorted(matched) == sorted(s.prompt for s in samples)  # one warm-up per sample


def test_warmup_sample_marks_chat_messages():
    s = SampleRequest([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], 1, 2)
    w = warmup_sample(s, 3)
    assert w.prompt[0]["content"][0]["text"].startswith("Warm-up request 3")
    assert w.prompt[0]["content"][1:] == s.prompt[0]["content"]
    assert s.prompt[0]["content"] == [{"type": "text", "text": "hi"}]  # the sample is unchanged
    assert warmup_sample(SampleRequest("abc", 1, 2), 0).prompt.endswith("\nabc")


def test_duration_bounds_the_run(fake_server):
    server = fake_server(ttft_s=0.0, itl_s=0.001)
    samples = random_dataset(4, 5, 2)  # cycled
    t = time.perf_counter()
    res = run(
        _spec(server.base_url),
        samples,
        LoadSpec(request_rate=30.0, duration_s=0.8, seed=3, progress=False),
    )
    wall = time.perf_counter() - t
    schedule = np.cumsum(_gaps(30.0, 1.0, 200, 3))
    expected = 1 + int((schedule < 0.8).sum())  # the first request goes at t = 0
    assert len(res.outcomes) == expected
    assert all(o.success for o in res.outcomes)
    assert wall < 0.8 + 1.0


def test_duration_with_burst_needs_a_cap():
    with pytest.raises(ValueError, match="max-concurrency"):
        LoadSpec(duration_s=1.0).validate()


def test_errors_are_counted_by_kind(fake_server):
    faults = {1: "429", 2: "500", 3: "disconnect", 4: "error_event", 5: "hang", 6: "429"}
    server = fake_server(ttft_s=0.01, itl_s=0.005, faults=faults)
    samples = random_dataset(10, 5, 6)
    res = run(
        _spec(server.base_url, timeout=1.0), samples, LoadSpec(max_concurrency=1, progress=False)
    )
    s = summarize(res.outcomes, res.duration_s)
    assert s["errors_by_kind"] == {
        "disconnected": 1,
        "http_429": 2,
        "http_500": 1,
        "stream_error": 1,
        "timeout": 1,
    }
    assert s["completed"] == 4 and s["failed"] == 6
    assert s["total_output_tokens"] == 4 * 6  # failed requests count nothing
    by_index = {o.index: o for o in res.outcomes}
    assert "injected 429" in by_index[1].error_detail


def test_unreachable_server_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens
    res = run(_spec(f"http://127.0.0.1:{port}", timeout=5.0), random_dataset(3, 5, 2),
              LoadSpec(progress=False))  # fmt: skip
    assert [o.error for o in res.outcomes] == ["connection"] * 3


def test_failed_warmups_abort_with_the_reason():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError, match="warm-up"):
        run(_spec(f"http://127.0.0.1:{port}"), random_dataset(3, 5, 2),
            LoadSpec(num_warmups=1, progress=False))  # fmt: skip
