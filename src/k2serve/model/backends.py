"""The backend registry: which attention / expert / RMSNorm / linear implementation a model runs.

Owns: `resolve_backends` (the one place where "auto" and `triton_usable` are resolved: names
in, a frozen `BackendChoice` of concrete names and the device-restricted `KernelPolicy` out),
`restrict_policy` (a policy with what the device cannot run turned off) and `install_backends`
(builds the concrete backends of a choice and hands them to the model, which only wires them).
`setup_backends(model, ...)` is both steps at once, for tests, benchmarks and the loader; the
engine resolves once into its `RuntimeSpec` (`engine.setup`) and installs from there.

Registries (name -> what it builds):
- attention: "torch" (TorchMLABackend, the reference; syncs with the host, no CUDA graphs) and
  "triton" (TritonMLABackend; reads bf16 caches, and fp8 ones on NVIDIA sm_80+);
- moe: "torch" (TorchExpertBackend), "triton" (the fused Triton MoE; "auto" falls back to torch
  for a weight format it does not take) and "cpu" (the native CPU expert kernel, one call per
  layer-step); experts that the placement puts on the CPU always get the CPU backend (hybrid);
- rms_norm and linear: "torch" or "triton" (the fused norm; the FP8 GEMM and one-row GEMV
  kernels of the policy).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from k2serve.attention import make_attention_backend
from k2serve.attention.torch_ref import is_fp8
from k2serve.kernels.policy import KernelPolicy, triton_usable
from k2serve.moe import make_expert_backend
from k2serve.moe.placement import ExpertPlacement

if TYPE_CHECKING:
    from k2serve.model.deepseek_v3 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)

CHOICES = ("auto", "torch", "triton")  # what a user may ask for, per family
ATTENTION_BACKENDS = ("torch", "triton")
MOE_BACKENDS = ("torch", "triton", "cpu")
NORM_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class BackendChoice:
    """Concrete backend names (no "auto") and the kernel policy the device can run."""

    attention: str  # ATTENTION_BACKENDS
    moe: str  # MOE_BACKENDS
    rms_norm: str  # NORM_BACKENDS
    linear: str  # "triton" when the policy's FP8 GEMM / one-row GEMV kernels are on
    policy: KernelPolicy
    kv_cache_dtype: torch.dtype | None = None  # the cache the attention backend reads
    moe_fallback: bool = True  # "auto": a weight format the fused MoE rejects takes torch

    def describe(self) -> str:
        return (
            f"attention={self.attention}, moe={self.moe}, rms_norm={self.rms_norm}, "
            f"linear={self.linear}"
        )


def _check(family: str, name: str) -> None:
    if name not in CHOICES:
        raise ValueError(f"{family}_backend={name!r}; expected one of {CHOICES}")


def _needs_triton(family: str, device: torch.device) -> ValueError:
    return ValueError(
        f"{family}_backend='triton' needs a CUDA device and Triton (device is {device}); use "
        "'auto' or 'torch'"
    )


def restrict_policy(
    policy: KernelPolicy, device: torch.device | str, *, attention: str = "triton",
    moe: str = "triton", sharded: bool = False,
) -> KernelPolicy:  # fmt: skip
    """`policy` with what `device` cannot run turned off: Triton kernels without Triton, the
    side stream off CUDA, the fused RoPE without the Triton attention or on tensor-parallel
    shards, the Triton router with the torch experts."""
    device = torch.device(device)
    ok = triton_usable(device)
    # NOTE: the fused RoPE kernel is off on tensor-parallel shards: with it TP=2 logits differ
    # from TP=1 by 0.12-0.16 on 2 H200s, without it by 0.008, although the kernel alone is
    # within one rounding of the torch code; the cause is open
    return replace(
        policy,
        triton=policy.triton and ok,
        fused_rope=policy.fused_rope and ok and attention == "triton" and not sharded,
        triton_router=policy.triton_router and ok and moe != "torch",
        decode_gemv=policy.decode_gemv and ok,
        fp8_gemm=policy.fp8_gemm and ok,
        mla_prefill_attn=policy.mla_prefill_attn if ok else "sdpa",
        shared_stream=policy.shared_stream and device.type == "cuda",
    )


def resolve_backends(
    device: torch.device | str,
    *,
    attention: str = "auto",
    moe: str = "auto",
    norm: str = "auto",
    kv_cache_dtype: torch.dtype | None = None,
    policy: KernelPolicy | None = None,
    sharded: bool = False,
) -> BackendChoice:
    """Resolve the asked-for names ("auto": Triton on CUDA when Triton imports, torch
    references elsewhere, the CPU expert kernel on a CPU device) for `device` and a KV cache of
    `kv_cache_dtype`; a forced "triton" that the device cannot run is a ValueError. `policy`:
    the kernels wanted (None: `KernelPolicy.for_device`); the choice holds it restricted to
    what the device and the chosen backends can run."""
    for family, name in (("attention", attention), ("moe", moe), ("norm", norm)):
        _check(family, name)
    device = torch.device(device)
    triton = triton_usable(device)
    for family, name in (("attention", attention), ("moe", moe), ("norm", norm)):
        if name == "triton" and not triton:
            raise _needs_triton(family, device)
    fp8 = kv_cache_dtype is not None and is_fp8(kv_cache_dtype)
    attn = "triton" if attention != "torch" and triton else "torch"
    if attn == "triton" and fp8:
        from k2serve.kernels.mla_attention import fp8_cache_supported

        if not fp8_cache_supported(device):
            if attention == "triton":
                raise ValueError(
                    f"attention_backend='triton' cannot read an fp8 KV cache on {device} (needs "
                    "an NVIDIA GPU of compute capability 8.0+); use 'auto' or 'torch'"
                )
            logger.warning(
                "kv_cache_dtype fp8: the Triton MLA kernel reads fp8 caches on NVIDIA sm_80+ "
                "only; using the torch reference attention backend on %s (slower decode, no "
                "decode CUDA graphs)",
                device,
            )
            attn = "torch"
    if moe == "auto":
        experts = "cpu" if device.type == "cpu" else "triton" if triton else "torch"
    else:
        experts = moe
    policy = restrict_policy(
        policy if policy is not None else KernelPolicy.for_device(device),
        device, attention=attn, moe=experts, sharded=sharded,
    )  # fmt: skip
    return BackendChoice(
        attention=attn,
        moe=experts,
        rms_norm="triton" if norm != "torch" and triton else "torch",
        linear="triton" if policy.fp8_gemm or policy.decode_gemv else "torch",
        policy=policy,
        kv_cache_dtype=kv_cache_dtype if fp8 else None,
        moe_fallback=moe == "auto",
    )


def install_backends(
    model: DeepseekV3ForCausalLM, choice: BackendChoice, placement: ExpertPlacement | None
) -> str:
    """Build `choice`'s backends for `model` (one attention backend shared by every layer, one
    expert backend per MoE layer for the `placement`; None: every expert on the model's device)
    and hand them to it. Logs and returns one line saying what runs."""
    dev = model.device
    attn = make_attention_backend(choice.attention, choice.kv_cache_dtype, choice.policy)

    def experts(layer: int, modules: nn.ModuleList):
        return make_expert_backend(
            modules, choice.moe, dev, layer=layer, placement=placement, policy=choice.policy,
            fallback=choice.moe_fallback,
        )  # fmt: skip

    fused = model.install_backends(attn, experts, choice.rms_norm == "triton", choice.policy,
                                   placement)  # fmt: skip
    from k2serve.moe.placement import describe_placement

    moe_names = sorted({m.expert_backend.name for m in model.moe_blocks()})
    line = (
        f"backends on {dev}: attention={attn.name}, moe={'/'.join(moe_names) or '-'}"
        f", rms_norm={choice.rms_norm}"
        + (f", fused: {fused}" if fused else "")
        + "; "
        + (describe_placement(model) if moe_names else "no routed experts")
    )
    logger.info("%s", line)
    return line


def setup_backends(
    model: DeepseekV3ForCausalLM,
    attention: str = "auto",
    moe: str = "auto",
    norm: str = "auto",
    placement: ExpertPlacement | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    policy: KernelPolicy | None = None,
) -> str:
    """`resolve_backends` for the model's device (tensor-parallel shards: no fused RoPE), then
    `install_backends`. Returns the logged line."""
    choice = resolve_backends(
        model.device, attention=attention, moe=moe, norm=norm, kv_cache_dtype=kv_cache_dtype,
        policy=policy, sharded=getattr(model, "tp_plan", None) is not None,
    )  # fmt: skip
    return install_backends(model, choice, placement)


__all__ = [
    "ATTENTION_BACKENDS",
    "BackendChoice",
    "MOE_BACKENDS",
    "NORM_BACKENDS",
    "install_backends",
    "resolve_backends",
    "restrict_policy",
    "setup_backends",
]
