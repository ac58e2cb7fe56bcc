"""Fit the server's prompt tokens per word, so random prompts can be sized in tokens.

Random prompts are words (no client tokenizer). With `--calibrate-input-len`, two probe requests
(`PROBE_WORDS` words each, max_tokens=1) ask the server itself: prompt_tokens = overhead +
tokens_per_word * words, fitted through the two points; then word counts are chosen so that the
server counts about the requested number of input tokens. The measured counts in the results
are still the server's usage.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np

from k2serve.bench.client import RequestSpec, send_request
from k2serve.bench.datasets import SampleRequest, random_words

PROBE_WORDS = (32, 160)


@dataclass(frozen=True)
class Calibration:
    tokens_per_word: float
    overhead_tokens: float  # chat template etc., counted once per request

    def words_for(self, tokens: int, with_overhead: bool = True) -> int:
        """Words whose prompt the server counts as ~`tokens` tokens (at least 1)."""
        t = tokens - (self.overhead_tokens if with_overhead else 0.0)
        return max(1, round(t / self.tokens_per_word))


async def _probe(spec: RequestSpec, seed: int) -> Calibration:
    rng = np.random.default_rng(seed + 1_000_003)
    counts = []
    async with httpx.AsyncClient(timeout=spec.timeout_s, trust_env=False) as client:
        for n in PROBE_WORDS:
            sample = SampleRequest(random_words(rng, n), n, 1)
            out = await send_request(client, spec, sample, -1, time.perf_counter())
            if not out.success:
                raise ConnectionError(
                    f"calibration request failed: {out.error}: {out.error_detail}"
                )
            if not out.usage_reported or out.prompt_tokens is None:
                raise ValueError("--calibrate-input-len needs a server that reports usage")
            counts.append(out.prompt_tokens)
    (w1, w2), (t1, t2) = PROBE_WORDS, counts
    slope = (t2 - t1) / (w2 - w1)
    if not slope > 0:
        raise ValueError(f"calibration: prompt tokens did not grow with words ({counts})")
    return Calibration(slope, t1 - slope * w1)


def calibrate(spec: RequestSpec, seed: int = 0) -> Calibration:
    return asyncio.run(_probe(spec, seed))
