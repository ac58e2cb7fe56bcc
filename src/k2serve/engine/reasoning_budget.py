"""`thinking_token_budget`: a per-request cap on reasoning tokens (vLLM's extra parameter).

Owns: `ThinkingBudget`, the logits processor that closes the thought with `</think>` once the
model has spent N tokens reasoning without closing it itself. N = 0 means no reasoning at all
(`</think>` is the first token). The answer (and any tool call) follows as the model writes it.

Invariants:
- Reasoning ends at `</think>`, or where the model opens a tool-call section / call inside its
  reasoning (K2-Thinking does); after that the processor never touches the logits.
- The forced text is `</think>` tokenized with the real tokenizer; forcing starts exactly at
  output position N, so the reasoning holds at most N tokens.
- Stateless in the request (a function of `output_token_ids`), so one instance serves all n
  samples and survives preemption (recompute); the end marker is searched for only inside the
  forcing window, so a step costs O(1) outside it.
"""

from __future__ import annotations

import torch

from k2serve.parsers.markers import CALL_BEGIN, SECTION_BEGIN, THINK_END


class ThinkingBudget:
    def __init__(self, tokenizer, budget: int):
        if budget < 0:
            raise ValueError(f"thinking_token_budget={budget} is invalid: must be >= 0")
        self.budget = budget
        self.end_ids = tokenizer.encode(THINK_END, allow_special=True)
        if not self.end_ids:
            raise ValueError(f"the tokenizer cannot encode {THINK_END}")
        ends = [tokenizer.token_to_id(m) for m in (SECTION_BEGIN, CALL_BEGIN)]
        self.section_ids = {t for t in ends if t is not None}

    def _ended(self, reasoning: list[int]) -> bool:
        if self.section_ids.intersection(reasoning):
            return True
        e, k = self.end_ids, len(self.end_ids)
        if k == 1:
            return e[0] in reasoning
        return any(reasoning[i : i + k] == e for i in range(len(reasoning) - k + 1))

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: [vocab] float32
        k = len(output_token_ids) - self.budget
        if not 0 <= k < len(self.end_ids):
            return logits
        if output_token_ids[self.budget :] != self.end_ids[:k]:
            return logits  # the model itself went on after the budget: not ours to force
        if self._ended(list(output_token_ids[: self.budget])):
            return logits
        tid = self.end_ids[k]
        out = torch.full_like(logits, float("-inf"))
        out[tid] = logits[tid] if torch.isfinite(logits[tid]) else 0.0
        return out
