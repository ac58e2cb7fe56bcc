"""GPU fused-MoE expert backend: one Triton grouped GEMM per projection (k2serve.kernels).

Owns: `FusedMoEBackend` (implements `ExpertBackend`) and `stack_experts`, which turns a layer's
`experts` ModuleList (per-expert gate/up/down linears with the checkpoint's names) into the
stacked tensors the kernel reads. NOTE: after stacking, each expert's parameters are re-pointed
to views of the stacked tensors, so memory is not doubled and the torch reference path (and the
state_dict) still see the same values.
Supported schemes: bf16, int4_group (compressed-tensors, group 32), fp8_block (128x128).
"""

from __future__ import annotations

import torch
from torch import nn

from k2serve.kernels.fused_moe import ExpertWeights, fused_moe
from k2serve.moe.base import ExpertBackend

# linear scheme -> (quant name, weight attr, scale attr)
_SCHEMES = {
    "bf16": ("bf16", "weight", None),
    "int4_group": ("int4", "weight_packed", "weight_scale"),
    "fp8_block": ("fp8", "weight", "weight_scale_inv"),
}


def _stack(experts: nn.ModuleList, projs: tuple[str, ...], attr: str) -> torch.Tensor:
    """Stack [E, sum(rows), ...] and re-point each expert's parameter to its slice."""
    first = [getattr(getattr(experts[0], p), attr) for p in projs]
    rows = [t.shape[0] for t in first]
    out = torch.empty(len(experts), sum(rows), *first[0].shape[1:], dtype=first[0].dtype,
                      device=first[0].device)  # fmt: skip
    for e, ex in enumerate(experts):
        r0 = 0
        for p, n in zip(projs, rows, strict=True):
            lin = getattr(ex, p)
            out[e, r0 : r0 + n].copy_(getattr(lin, attr))
            setattr(lin, attr, nn.Parameter(out[e, r0 : r0 + n], requires_grad=False))
            r0 += n
    return out


def stack_experts(experts: nn.ModuleList) -> ExpertWeights:
    lin = experts[0].gate_proj
    scheme = getattr(lin, "scheme", "bf16")
    if scheme not in _SCHEMES:
        raise ValueError(f"FusedMoEBackend: expert linear scheme {scheme!r} is not supported")
    quant, wattr, sattr = _SCHEMES[scheme]
    if quant == "fp8" and tuple(lin.block) != (128, 128):
        raise ValueError(f"FusedMoEBackend: fp8 block {lin.block} is not 128x128")
    with torch.no_grad():
        w13 = _stack(experts, ("gate_proj", "up_proj"), wattr)
        w2 = _stack(experts, ("down_proj",), wattr)
        s13 = _stack(experts, ("gate_proj", "up_proj"), sattr) if sattr else None
        s2 = _stack(experts, ("down_proj",), sattr) if sattr else None
    return ExpertWeights(quant, w13, w2, s13, s2, group_size=getattr(lin, "group_size", 32))


class FusedMoEBackend(ExpertBackend):
    name = "fused_moe"

    def __init__(self, weights: ExpertWeights) -> None:
        self.weights = weights

    @classmethod
    def from_experts(cls, experts: nn.ModuleList) -> FusedMoEBackend:
        return cls(stack_experts(experts))

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        topk_ids: torch.Tensor,  # [T, k]
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor:  # [T, hidden]
        return fused_moe(hidden, self.weights, topk_weights, topk_ids)
