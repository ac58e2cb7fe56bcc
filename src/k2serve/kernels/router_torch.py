"""The router's top-k in torch ops: the model's path off CUDA and the Triton kernel's fallback.

Owns: `grouped_topk_torch` (noaux_tc: sigmoid scores, bias for selection only, group ranking by
the sum of each group's top-2, renormalise, scale; see kernels/router.py for the rules). Free of
Triton on purpose: the model imports it at start-up, and importing k2serve must not import Triton.
"""

from __future__ import annotations

import torch

NAN_SCORE = -1.0e30  # a NaN selection score ranks here: below every real one, above "excluded"


def grouped_topk_torch(
    router_logits: torch.Tensor,  # [T, E] float32
    bias: torch.Tensor | None,  # [E] float32
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32, [T, k] int64)
    """The torch path (the model's router off CUDA, and the kernel's fallback); ids unsorted."""
    T, E = router_logits.shape
    if E % n_group:
        raise ValueError(f"n_group={n_group} does not divide num_experts={E}")
    scores = router_logits.float().sigmoid()  # [T, E]
    choice = scores + bias.to(scores.dtype) if bias is not None else scores  # [T, E]
    choice = choice.nan_to_num(nan=NAN_SCORE, neginf=NAN_SCORE)  # see kernels/router.py
    scores = scores.nan_to_num(nan=0.0)
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
