"""Reference expert backend: loops over the experts that were hit, in the activation dtype.

Invariants: expert e computes down(silu(gate(x)) * up(x)) with its own (possibly quantized,
dequantized per call) linears; outputs are scaled by the routing weight and summed per token,
accumulating in float32, as transformers' `DeepseekV3Experts` loop does (index_add).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k2serve.moe.base import ExpertBackend


class TorchExpertBackend(ExpertBackend):
    name = "torch"

    def __init__(self, experts: nn.ModuleList) -> None:
        self.experts = experts  # each has gate_proj, up_proj, down_proj

    def __call__(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden)  # [T, hidden]
        flat_ids = topk_ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        k = topk_ids.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok = sel // k  # [n] token index
            expert = self.experts[e]
            x = hidden[tok]  # [n, hidden]
            h = F.silu(expert.gate_proj(x)) * expert.up_proj(x)
            y = (
                expert.down_proj(h) * topk_weights.reshape(-1)[sel, None]
            )  # float32, as transformers
            out.index_add_(0, tok, y.to(out.dtype))
        return out
