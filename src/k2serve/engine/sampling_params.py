"""Sampling parameters of one request (vLLM field names and meanings).

Owns: the per-request knobs of the sampler and of the stop checker, and their validation.

Invariants:
- A constructed `SamplingParams` is valid: every bad value raises `ValueError` naming the parameter
  and the value at construction (`__post_init__`), so nothing invalid reaches the engine.
- `stop` is always a list of non-empty strings, `stop_token_ids` a list of ints.
- `max_tokens=None` means "up to max_model_len"; the engine fills it in per request.
- `logits_processors` are vLLM-v0 style callables `(output_token_ids, logits_row) -> logits_row`
  applied to one row `[vocab] float32` before penalties and temperature.
- `structured_outputs` (vLLM's name) constrains the output to a JSON schema / regex / choice /
  grammar; the engine compiles it (a bad one is a `ValueError` from `validate`) and the sampler
  masks every token the grammar does not allow.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k2serve.structured.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs limit

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    # normalised by __post_init__ (a str, a tuple or None is accepted and becomes a list)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per generated token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logits_processors: list[LogitsProcessor] = field(default_factory=list, repr=False)
    structured_outputs: StructuredOutputsParams | None = None
    # per-request opt-out of the engine's speculative decoding (--speculative-config); output
    # is the same either way, only its speed differs
    speculative_decoding: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(
                f"stop={self.stop!r} is invalid: must be a string or a list of strings"
            )
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids={self.stop_token_ids!r} is invalid: must be a list of integers"
            )
        self.logits_processors = list(self.logits_processors or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    # ------------------------------------------------------------------------------------------
    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {why}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (
            not _is_int(self.seed) or not -(2**63) <= self.seed <= 2**63 - 1
        ):
            # torch.Generator.manual_seed takes [-2**63, 2**64); the sampler adds the sample index
            raise bad("seed", "must be an integer in [-2**63, 2**63 - 1] (int64) or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} is invalid: must be <= max_tokens={self.max_tokens}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(
                    f"stop={self.stop!r} is invalid: every stop must be a non-empty string"
                )
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None:
            raise bad("prompt_logprobs", "prompt logprobs are not supported yet")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a number > 0")
        for p in self.logits_processors:
            if not callable(p):
                raise bad("logits_processors", "every entry must be callable")
        if not isinstance(self.speculative_decoding, bool):
            raise bad("speculative_decoding", "must be true or false")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    # ------------------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes) -> SamplingParams:
        """A copy (logits processors are shared, not copied) with `changes` applied."""
        procs = self.logits_processors
        self.logits_processors = []
        try:
            out = copy.deepcopy(self)
        finally:
            self.logits_processors = procs
        out.logits_processors = list(procs)
        for k, v in changes.items():
            setattr(out, k, v)
        out._validate()
        return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN
