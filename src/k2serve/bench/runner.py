"""Drive a workload against a server: arrivals, concurrency, warm-ups, count and time bounds.

Arrivals (as vLLM `bench serve`): with `request_rate = inf` every request is released at once
(burst); otherwise inter-arrival gaps are gamma-distributed with shape `burstiness` and mean
1/rate (burstiness 1 = Poisson process); release times are absolute (t0 + cumulative gaps).
`max_concurrency` caps the requests in flight; a request's clock starts when it is actually
sent, after waiting for a slot.

Bounds: at most `len(samples)` requests, or, with `duration_s`, requests are released (cycling
the samples) until `duration_s` has passed; each request is bounded by `spec.timeout_s`. So a
run always ends, after at most duration + timeout.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import httpx
import numpy as np

from k2serve.bench.client import RequestOutcome, RequestSpec, headers, send_request
from k2serve.bench.datasets import SampleRequest


@dataclass
class LoadSpec:
    request_rate: float = math.inf  # requests/s; inf = burst
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    max_concurrency: int | None = None
    num_warmups: int = 0
    duration_s: float | None = None  # release requests until this time (cycling the samples)
    seed: int = 0
    progress: bool = True

    def validate(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if self.duration_s is not None:
            if not self.duration_s > 0:
                raise ValueError(f"--duration must be > 0, got {self.duration_s}")
            if math.isinf(self.request_rate) and self.max_concurrency is None:
                raise ValueError(
                    "--duration with --request-rate inf would release unboundedly many "
                    "requests at once: give --max-concurrency or a finite --request-rate"
                )


@dataclass
class RunResult:
    outcomes: list[RequestOutcome]
    duration_s: float  # first send to last completion
    warmup_outcomes: list[RequestOutcome] = field(default_factory=list)


def interarrival_gaps(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Endless inter-arrival gaps in seconds (all 0 for rate inf)."""
    if math.isinf(rate):
        while True:
            yield 0.0
    theta = 1.0 / (rate * burstiness)  # gamma scale so that the mean gap is 1/rate
    while True:
        yield float(rng.gamma(shape=burstiness, scale=theta))


def _client(load: LoadSpec, spec: RequestSpec) -> httpx.AsyncClient:
    # No connection-pool queueing: waiting for a pool slot would count as TTFT. The only cap on
    # requests in flight is max_concurrency.
    n = load.max_concurrency
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n or 100)
    timeout = httpx.Timeout(spec.timeout_s, connect=min(30.0, spec.timeout_s), pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def warmup_sample(sample: SampleRequest, i: int) -> SampleRequest:
    """Warm-up request i: `sample` behind a line of its own, so that it shares no cached prefix
    with the measured requests (a warm-up that sent a measured prompt as is left that prompt in
    the server's prefix cache, and its measured TTFT was a one-token prefill: C=1's 1K-token
    TTFT read 23 ms against the model's 56 ms prefill)."""
    mark = f"Warm-up request {i}, not measured.\n"
    prompt = sample.prompt
    if isinstance(prompt, str):
        return replace(sample, prompt=mark + prompt)
    messages = [dict(m) for m in prompt]
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            m["content"] = mark + content
            break
        if isinstance(content, list):
            m["content"] = [{"type": "text", "text": mark}, *content]
            break
    else:
        messages.insert(0, {"role": "user", "content": mark})
    return replace(sample, prompt=messages)


async def _warmup(
    client: httpx.AsyncClient, spec: RequestSpec, samples: list[SampleRequest], load: LoadSpec
) -> list[RequestOutcome]:
    sem = asyncio.Semaphore(load.max_concurrency or load.num_warmups or 1)
    t0 = time.perf_counter()

    async def one(i: int) -> RequestOutcome:
        async with sem:
            sample = warmup_sample(samples[i % len(samples)], i)
            return await send_request(client, spec, sample, i, t0)

    return list(await asyncio.gather(*(one(i) for i in range(load.num_warmups))))


async def run_load(spec: RequestSpec, samples: list[SampleRequest], load: LoadSpec) -> RunResult:
    """Run the warm-ups, then the measured load; returns every measured request's outcome."""
    load.validate()
    if not samples:
        raise ValueError("the workload has no requests (--num-prompts must be >= 1)")
    from tqdm.auto import tqdm

    rng = np.random.default_rng(load.seed)
    async with _client(load, spec) as client:
        if spec.warm_url:
            # NOTE: the first connection of a client pays ~25 ms of one-off setup (lazy imports
            # in httpx/anyio); pay it here, not in the first measured TTFT.
            try:
                await client.get(spec.warm_url, headers=headers(spec))
            except httpx.HTTPError:
                pass
        warm = await _warmup(client, spec, samples, load) if load.num_warmups else []
        if warm and not any(o.success for o in warm):
            first = warm[0]
            raise ConnectionError(
                f"every warm-up request failed, first: {first.error}: {first.error_detail}"
            )
        sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        total = None if load.duration_s is not None else len(samples)
        bar = tqdm(total=total, disable=not load.progress, unit="req", desc="bench")
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()

        async def one(i: int) -> RequestOutcome:
            try:
                out = await send_request(client, spec, samples[i % len(samples)], i, t0)
            finally:
                if sem is not None:
                    sem.release()  # acquired by the release loop below
            bar.update(1)
            return out

        gaps = interarrival_gaps(load.request_rate, load.burstiness, rng)
        next_t = 0.0
        i = 0
        while True:
            if load.duration_s is None and i >= len(samples):
                break
            if load.duration_s is not None and next_t >= load.duration_s:
                break
            delay = next_t - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                # NOTE: the slot is taken here, not in the task, so at most max_concurrency
                # tasks exist; the schedule is absolute, so late releases go out at once, which
                # is what waiting on the semaphore inside the task would do.
                await sem.acquire()
                if load.duration_s is not None and time.perf_counter() - t0 >= load.duration_s:
                    sem.release()
                    break
            tasks.append(asyncio.ensure_future(one(i)))
            i += 1
            next_t += next(gaps)
            if delay <= 0 and i % 64 == 0:
                await asyncio.sleep(0)  # let sends start during a burst
        outcomes = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        bar.close()
    return RunResult(outcomes=outcomes, duration_s=duration, warmup_outcomes=warm)


def run(spec: RequestSpec, samples: list[SampleRequest], load: LoadSpec) -> RunResult:
    # NOTE: a full garbage collection during the run stalls every stream being timed (in a
    # process that has imported torch it can take over 100 ms): collect once now and freeze
    # what is alive, so that the collections during the run only look at new objects.
    gc.collect()
    gc.freeze()
    try:
        return asyncio.run(run_load(spec, samples, load))
    finally:
        gc.unfreeze()
