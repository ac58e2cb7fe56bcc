"""The expert-backend interface: computes the routed experts' weighted sum for a batch.

A backend gets the tokens, the router's choice and weights, and returns the routed output
(without the shared experts, which stay in the model). GPU and CPU backends implement the same
call, so `moe/placement.py` decides per (layer, expert) which one computes it (a layer split
between the two gets `moe.hybrid.HybridExpertBackend`).
"""

from __future__ import annotations

import torch


class ExpertBackend:
    name = "base"

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        topk_ids: torch.Tensor,  # [T, k] int64
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor:  # [T, hidden], dtype of `hidden`
        raise NotImplementedError
