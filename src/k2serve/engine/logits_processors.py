"""Logits processors beside the sampler (vLLM-v0 style `(output_token_ids, logits_row) ->
logits_row`, the `LogitsProcessor` of `SamplingParams.logits_processors`).

Owns: `ForceToolCallPrefix` (tool_choice "required" / named: the output opens a tool call for an
allowed function), `BanTokens` (tool_choice "none" or no tools: the model cannot open a tool-call
section; the sampler applies every request's bans in one batched write instead of calling it)
and `LogitBias` (OpenAI `logit_bias`). `reasoning_budget.ThinkingBudget` is the fourth.

Invariants:
- The forced text is `tool_call_prefix(name, 0)` tokenized with the real tokenizer, one candidate
  token sequence per allowed function; at each step only tokens that continue a candidate
  matching what was generated so far are allowed, so the output is exactly one candidate.
- With thinking on, forcing starts after `</think>` (or at `<|tool_calls_section_begin|>` if the
  model opens the section inside its reasoning); the reasoning itself is free.
- Processors are stateless functions of `output_token_ids`, so one instance serves all n samples
  and survives preemption (recompute) unchanged.
"""

from __future__ import annotations

import torch

from k2serve.parsers import tool_call_prefix
from k2serve.parsers.markers import SECTION_BEGIN, THINK_END
from k2serve.tokenizer.safe import render_and_encode


class ForceToolCallPrefix:
    def __init__(self, tokenizer, names: list[str], thinking: bool):
        # the name is the client's: text, even if it spells a marker
        self.candidates = [
            render_and_encode(tokenizer, lambda x: tool_call_prefix(x, 0), n)[1] for n in names
        ]
        self.max_len = max(len(c) for c in self.candidates)
        self.think_end = tokenizer.token_to_id(THINK_END) if thinking else None
        self.section_begin = tokenizer.token_to_id(SECTION_BEGIN)
        if thinking and self.think_end is None:
            raise ValueError(f"the tokenizer has no {THINK_END} token to end thinking with")

    def _start(self, out: list[int]) -> int | None:
        """Where the forced prefix begins in `out`, or None while still reasoning."""
        if self.think_end is None:
            return 0
        for i, t in enumerate(out):
            if t == self.think_end:
                return i + 1
            if t == self.section_begin:
                return i
        return None

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: [vocab] float32
        start = self._start(output_token_ids)
        if start is None:
            return logits
        done = list(output_token_ids[start:])
        k = len(done)
        if k >= self.max_len:
            return logits
        allowed = {c[k] for c in self.candidates if len(c) > k and c[:k] == done}
        if not allowed:
            return logits
        idx = torch.tensor(sorted(allowed), dtype=torch.long, device=logits.device)
        out = torch.full_like(logits, float("-inf"))
        out[idx] = logits[idx]
        return out


class BanTokens:
    """A history-independent ban of `token_ids`. The sampler applies every request's BanTokens
    in one batched write per step instead of calling this per row (a per-row call is a few
    device ops per request per step); calling it gives the same row."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = sorted(set(token_ids))

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: [vocab] float32
        logits[self.token_ids] = float("-inf")
        return logits


class LogitBias:
    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: [vocab] float32
        logits[self.ids.to(logits.device)] += self.values.to(logits.device, logits.dtype)
        return logits
