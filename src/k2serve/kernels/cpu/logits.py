"""A CPU decode step's logits on the calling thread (k2logits.h): `cpu_float32` (bf16 ->
float32, exact) and `cpu_argmax` (torch.argmax's rule: the first maximum; a NaN beats every
number, the first NaN among NaNs).

Why: at batch 1 the lm_head's [1, 163,840] output went through two torch ops above torch's
OpenMP grain (32,768 elements), compute_logits' .to(float32) and the sampler's greedy argmax;
torch's OpenMP team ran them and then spun on the cores the next step's first kernel calls
need (dev box, 2 threads: +1.1-1.2 ms on the next step's first GEMVs;
benchmarks/cpu_sampler_probe.py). Both here run on the calling thread and give torch's
results; anything else (CUDA, more than LINEAR_MAX_ROWS rows, no kernel, a tracing dispatch
mode) keeps the torch op.
"""

from __future__ import annotations

import os

import torch

from k2serve.kernels.cpu import LINEAR_MAX_ROWS, _default_pool, dispatch_mode_active


def _lib(t: torch.Tensor, dtype: torch.dtype):
    """The kernel library when t is a CPU decode step's contiguous [rows, n] `dtype` rows."""
    if (
        t.device.type != "cpu"
        or t.dtype != dtype
        or t.dim() != 2
        or not 0 < t.shape[0] <= LINEAR_MAX_ROWS
        or t.shape[1] == 0
        or not t.is_contiguous()
        or t.requires_grad
        or dispatch_mode_active()
    ):
        return None
    lp = _default_pool(os.getpid())
    return None if lp is None else lp[0]


def cpu_float32(t: torch.Tensor) -> torch.Tensor:
    """t.to(torch.float32); a bf16 CPU decode step's [rows, n] widened by the kernel."""
    lib = _lib(t, torch.bfloat16)
    if lib is None:
        return t.to(torch.float32)
    out = torch.empty(t.shape, dtype=torch.float32)
    lib.k2_bf16_to_f32(t.data_ptr(), out.data_ptr(), t.numel())
    return out


def cpu_argmax(t: torch.Tensor) -> torch.Tensor | None:  # [rows] int64
    """t.argmax(dim=-1) for a CPU decode step's float32 [rows, n], by the kernel; else None."""
    lib = _lib(t, torch.float32)
    if lib is None:
        return None
    out = torch.empty(t.shape[0], dtype=torch.int64)
    lib.k2_argmax(t.data_ptr(), t.shape[0], t.shape[1], out.data_ptr())
    return out
