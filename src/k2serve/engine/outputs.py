"""What the engine hands back: `RequestOutput` with one `CompletionOutput` per sample (vLLM shape).

`LLMEngine.step()` and `AsyncLLMEngine.generate()` produce DELTA outputs (only what is new since
the previous output for that request); `LLM.generate()` returns CUMULATIVE ones (see `merge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


# NOTE: slots: made per token per request, the step's hottest allocations
@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top ones).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    def merge(self, delta: RequestOutput) -> None:
        """Append a DELTA output of the same request to this cumulative one."""
        by_index = {c.index: c for c in self.outputs}
        for d in delta.outputs:
            c = by_index.get(d.index)
            if c is None:
                c = by_index[d.index] = CompletionOutput(index=d.index)
                self.outputs.append(c)
                self.outputs.sort(key=lambda o: o.index)
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
            c.cumulative_logprob = d.cumulative_logprob
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics = delta.metrics
