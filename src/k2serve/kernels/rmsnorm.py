"""Fused RMSNorm, optionally with the residual add folded in (vLLM `fused_add_rms_norm`).

Owns: `rms_norm(x, weight, eps, residual=None)` (Triton) and `rms_norm_ref` (torch).
With a residual: `residual <- x + residual` (in place) and returns `rms_norm(residual)`; without:
returns `rms_norm(x)`. Statistics in float32, output in x's dtype, as the torch module.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton


def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        residual.copy_((x.float() + residual.float()).to(residual.dtype))
        x = residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _rms_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, N, x_stride, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
            x = x + r
            x_st = x.to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * N + offs, x_st, mask=mask)
            x = x_st.to(tl.float32)
        var = tl.sum(x * x, 0) / N
        y = x * tl.rsqrt(var + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, N] (row stride may be larger than N)
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N] contiguous, updated in place
) -> torch.Tensor:  # [T, N]
    require_triton(x)
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm needs a 2-D tensor with unit last stride, got {x.shape}")
    T, N = x.shape
    if weight.shape != (N,):
        raise ValueError(f"rms_norm weight shape {tuple(weight.shape)} != ({N},)")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError("rms_norm residual must be contiguous with x's shape")
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block = triton.next_power_of_2(N)
    _rms_kernel[(T,)](
        x, residual if residual is not None else x, weight, out, N, x.stride(0), float(eps),
        HAS_RES=residual is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
    return out
