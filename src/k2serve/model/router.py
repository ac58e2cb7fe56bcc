"""The noaux_tc router of DeepSeek-V3 / Kimi-K2 (spec §3.5).

Invariants:
- Logits in float32; scores = sigmoid(logits).
- `e_score_correction_bias` (float32) is added for SELECTION only; the weights are the
  unbiased scores of the chosen experts, normalised (norm_topk_prob) and times
  routed_scaling_factor.
- With n_group > 1, groups are ranked by the sum of their top-2 biased scores; only the best
  topk_group groups are eligible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TopkRouter(nn.Module):
    """Checkpoint names: `mlp.gate.weight` [E, hidden], `mlp.gate.e_score_correction_bias` [E]."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        E, D = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, D, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(E, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        return grouped_topk(
            F.linear(x.to(torch.float32), self.weight.to(torch.float32)),
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )


def grouped_topk(
    logits: torch.Tensor,  # [T, E] float32
    bias: torch.Tensor,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    scores = logits.sigmoid()  # [T, E]
    choice = scores + bias.to(scores.dtype)  # [T, E]
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, topk_ids)  # [T, k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids
