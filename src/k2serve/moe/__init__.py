"""Routed-expert computation behind a small interface (`ExpertBackend`), and its choice.

`make_expert_backend(experts, name, device, layer=, placement=)` builds one MoE layer's
backend by name (chosen for the device in `k2serve.model.backends`): "triton" = the fused
Triton MoE (with `fallback`, the torch one for a weight format it does not take), "cpu" = the
CPU expert backend (native kernel, one call per layer-step; it falls back to the torch path
itself), "torch" = the reference.
With a placement that puts some of the layer's experts on the CPU, those experts' weights are
moved to host memory (if they are not there already) and the layer gets a
`HybridExpertBackend`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from k2serve.kernels.policy import KernelPolicy
from k2serve.moe.base import ExpertBackend
from k2serve.moe.cpu_experts import CpuExpertBackend
from k2serve.moe.hybrid import HybridExpertBackend
from k2serve.moe.placement import ExpertPlacement, describe_placement, make_placement
from k2serve.moe.torch_ref import TorchExpertBackend

logger = logging.getLogger(__name__)

MOE_BACKENDS = ("torch", "triton", "cpu")


def _gpu_backend(
    experts: nn.ModuleList, name: str, policy: KernelPolicy | None, fallback: bool
) -> ExpertBackend:
    if name != "triton":
        return TorchExpertBackend(experts)
    from k2serve.moe.fused_moe import FusedMoEBackend

    try:
        kw = policy.moe_kwargs() if policy is not None else {}
        return FusedMoEBackend.from_experts(experts, **kw)
    except ValueError as e:  # a weight format the fused kernel does not take
        if not fallback:
            raise
        logger.warning("fused MoE unavailable (%s); using the torch expert backend", e)
        return TorchExpertBackend(experts)


def make_expert_backend(
    experts: nn.ModuleList,
    name: str,
    device: torch.device | str,
    *,
    layer: int | None = None,
    placement: ExpertPlacement | None = None,
    cpu_compute_dtype: torch.dtype = torch.float32,
    policy: KernelPolicy | None = None,
    fallback: bool = False,
) -> ExpertBackend:
    """The backend of one MoE layer's routed `experts` (see the module docstring); `name` is
    one of MOE_BACKENDS as `model.backends.resolve_backends` chose it for the device; `policy`:
    the fused backend's dispatch limits and launch configs (None: the default tables);
    `fallback`: a weight format the fused kernel rejects takes the torch backend (else raises)."""
    if name not in MOE_BACKENDS:
        raise ValueError(f"expert backend {name!r}; expected one of {MOE_BACKENDS}")
    device = torch.device(device)
    gpu_name = "torch" if name == "cpu" else name  # experts on a GPU never run the CPU kernel
    cpu_ids = placement.cpu_experts(layer) if placement is not None and layer is not None else ()
    if not cpu_ids:
        if name == "cpu":  # CPU-only: every expert on the CPU kernel
            n = len(experts)
            return CpuExpertBackend(list(experts), range(n), n, cpu_compute_dtype)
        return _gpu_backend(experts, gpu_name, policy, fallback)
    gpu_ids = [e for e in range(len(experts)) if e not in set(cpu_ids)]
    for e in cpu_ids:
        experts[e].to("cpu")  # no-op when the loader already put them in host memory
    cpu = CpuExpertBackend([experts[e] for e in cpu_ids], cpu_ids, len(experts), cpu_compute_dtype)
    gpu = (
        _gpu_backend(nn.ModuleList(experts[e] for e in gpu_ids), gpu_name, policy, fallback)
        if gpu_ids
        else None
    )
    return HybridExpertBackend(gpu, gpu_ids, cpu, len(experts), device)


__all__ = [
    "MOE_BACKENDS",
    "CpuExpertBackend",
    "ExpertBackend",
    "ExpertPlacement",
    "HybridExpertBackend",
    "TorchExpertBackend",
    "describe_placement",
    "make_expert_backend",
    "make_placement",
]
