"""Measured TTFT / ITL / TPOT / E2EL and token counts against a fake server with known delays."""

from __future__ import annotations

import numpy as np
import pytest

from k2serve.bench.client import RequestSpec
from k2serve.bench.datasets import random_dataset
from k2serve.bench.metrics import summarize, tpot_of
from k2serve.bench.report import format_table
from k2serve.bench.runner import LoadSpec, run

from .fake_server import CHAT_OVERHEAD


def _spec(server, api: str = "chat", timeout: float = 30.0) -> RequestSpec:
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    return RequestSpec(
        server.base_url + path, api, "fake-model", timeout_s=timeout,
        warm_url=server.base_url + "/v1/models",
    )  # fmt: skip


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_ttft_itl_match_injected_delays(fake_server, api):
    ttft_s, itl_s, n_tok = 0.2, 0.02, 12
    server = fake_server(ttft_s=ttft_s, itl_s=itl_s)
    samples = random_dataset(8, input_len=40, output_len=n_tok, seed=1)
    res = run(_spec(server, api), samples, LoadSpec(max_concurrency=4, progress=False))
    ok = [o for o in res.outcomes if o.success]
    assert len(ok) == 8, [o.error_detail for o in res.outcomes]

    ttft_ms = np.array([o.ttft for o in ok]) * 1000
    itl_ms = np.array([g for o in ok for g in o.itls]) * 1000
    tpot_ms = np.array([tpot_of(o) for o in ok]) * 1000
    e2el_ms = np.array([o.latency for o in ok]) * 1000
    # The server cannot answer before its injected delay; loopback + 2 shared cores add a little.
    assert ttft_ms.min() >= ttft_s * 1000 - 1
    assert np.median(ttft_ms) <= ttft_s * 1000 + 40
    assert len(itl_ms) == 8 * (n_tok - 1)  # one gap per chunk after the first
    assert itl_s * 1000 - 4 <= np.median(itl_ms) <= itl_s * 1000 + 6
    assert itl_s * 1000 - 1 <= tpot_ms.mean() <= itl_s * 1000 + 6
    expect_e2el = (ttft_s + (n_tok - 1) * itl_s) * 1000
    assert expect_e2el - 1 <= np.median(e2el_ms) <= expect_e2el + 50

    # Token counts are the server's usage: max_tokens out, prompt words (+ template) in.
    overhead = CHAT_OVERHEAD if api == "chat" else 0
    for o, s in zip(res.outcomes, samples, strict=True):
        assert o.usage_reported
        assert o.completion_tokens == n_tok
        assert o.prompt_tokens == len(s.prompt.split()) + overhead
    summary = summarize(res.outcomes, res.duration_s)
    assert summary["token_counts"] == "usage"
    assert summary["total_output_tokens"] == 8 * n_tok
    assert summary["total_input_tokens"] == sum(len(s.prompt.split()) + overhead for s in samples)
    assert summary["median_ttft_ms"] == pytest.approx(np.median(ttft_ms))
    assert summary["output_throughput"] == pytest.approx(8 * n_tok / res.duration_s)


def test_token_counts_come_from_usage_not_chunks(fake_server):
    server = fake_server(ttft_s=0.05, itl_s=0.02, tokens_per_chunk=3)
    samples = random_dataset(4, input_len=10, output_len=12, seed=2)
    res = run(_spec(server), samples, LoadSpec(progress=False))
    for o in res.outcomes:
        assert o.success and o.usage_reported
        assert o.num_chunks == 4  # 12 tokens, 3 per chunk
        assert o.completion_tokens == 12
        assert len(o.itls) == 3
        # TPOT spreads the 3 chunk gaps (~60 ms) over 11 tokens.
        assert 60 / 11 - 0.5 <= tpot_of(o) * 1000 <= 66 / 11 + 2


def test_missing_usage_is_labelled_and_falls_back_to_chunks(fake_server):
    server = fake_server(ttft_s=0.01, itl_s=0.005, tokens_per_chunk=2, send_usage=False)
    samples = random_dataset(3, input_len=10, output_len=10, seed=3)
    res = run(_spec(server), samples, LoadSpec(progress=False))
    summary = summarize(res.outcomes, res.duration_s)
    assert all(o.success and not o.usage_reported for o in res.outcomes)
    assert summary["token_counts"] == "chunks"
    assert summary["total_output_tokens"] == 3 * 5  # chunks, not the 30 tokens: labelled so
    assert summary["total_input_tokens"] == 3 * 10  # the workload's words, labelled likewise
    assert "NOTE: token counts: chunks" in format_table(summary)
