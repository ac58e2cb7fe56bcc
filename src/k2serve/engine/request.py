"""One sequence being generated: its tokens, progress and lifecycle (vLLM v1 vocabulary).

A user request with `n > 1` becomes n `Request`s (ids `"{id}#{i}"`) that share the prompt; the
engine merges their outputs again.

Invariants:
- `num_computed_tokens <= num_tokens`; tokens in `[0, num_computed_tokens)` have their latent KV
  in the pages the cache manager holds for this request.
- The scheduler gives a request new tokens to compute; it samples only in a step after which
  `num_computed_tokens == num_tokens` (so a partial prefill chunk never samples).
- Preemption (recompute) resets `num_computed_tokens` to 0 but keeps `output_token_ids`: the
  outputs are recomputed as part of the prompt and sampling continues where it stopped.
- Async scheduling (engine.pipeline): `num_output_placeholders` counts the tokens sampled by a
  step still in flight (0 or 1 when the scheduler runs); `num_tokens` includes them, so the
  next step can be scheduled before the token is known.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from k2serve.engine.outputs import RequestMetrics, SampleLogprobs
from k2serve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED_VALUES  # NOTE: hot (per request per step); no enum lookups


_FINISHED_VALUES = ("stop", "length", "abort")
assert {s.value for s in RequestStatus if s.name.startswith("FINISHED")} == set(_FINISHED_VALUES)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        max_tokens: int,
        parent_id: str | None = None,
        index: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        mm_inputs: list | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index  # which of the parent's n samples
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt  # extra prefix-cache key (LoRA, tenant)
        # K2.5 images (multimodal.inputs.ImageInput, prompt order, offsets set): their tokens
        # are placeholders whose embeddings the runner replaces with the image encoder's
        self.mm_inputs: list = list(mm_inputs or ())
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.cumulative_logprob = 0.0
        self.logprobs: SampleLogprobs | None = [] if sampling_params.logprobs is not None else None
        # per-request noise source of seeded sampling, made by the sampler on its device
        self.generator: torch.Generator | None = None
        # structured outputs: this sequence's k2serve.structured.state.GrammarState (or None)
        self.grammar: Any = None  # structured.state.GrammarState when constrained
        # speculative decoding: drafts proposed after the last step, verified in the next one
        # (the scheduler cuts them to its budget; k2serve.engine.spec_decode)
        self.spec_token_ids: list[int] = []
        # async scheduling: tokens a step in flight samples for this request (not yet appended)
        self.num_output_placeholders = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> bool:
        """After appending a token: set the finish status if it ends the request (not stop strings,
        which need text and are checked by the engine's output processor)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.grammar is not None:
            self.grammar.sync(self.output_token_ids)
            if self.grammar.finished:  # the grammar is complete: the reply is too
                # a token the grammar rejected (a dead end): the reply is not valid, so it is
                # never reported as a normal "stop"
                failed = self.grammar.failed
                self.status = (
                    RequestStatus.FINISHED_ABORTED if failed else RequestStatus.FINISHED_STOPPED
                )
                self.stop_reason = None
                return True
        pending = self.grammar is not None and self.grammar.pending  # see GrammarState.pending
        if self.num_output_tokens >= params.min_tokens and not pending:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = None
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"{self.status.value})"
        )
