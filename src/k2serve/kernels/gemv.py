"""One-row bf16 GEMV for decode at batch 1: y[1, N] = x[1, K] @ w[N, K]^T.

Owns: `gemv(x, w, out_dtype)`, `gemv_silu_mul(x, w)` (silu(gate) * up from a fused [gate; up]
weight, for the dense and shared MLPs) and `use_gemv(x, w)` (whether either applies). cuBLAS
runs these skinny products as split-K GEMMs plus a reduce kernel (two launches, 70-85% of the copy
bandwidth on K2's projections); this kernel reads each weight row once with 16-byte loads,
accumulates in float32, and needs no second pass.

Invariants: w is contiguous [N, K] in x's dtype, K % BLOCK_K == 0 (BLOCK_K from `config`);
no host synchronisation (CUDA-graph safe). Launch configs: the kernel policy's `gemv_bf16`
table (per device kind, kernels/configs/; None where cuBLAS was faster), passed as `table`;
other shapes use `config`'s rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from ._triton import HAS_TRITON, INTERPRET, cdiv, require_triton, tl, triton

_RULE: Mapping[tuple[int, int], dict | None] = MappingProxyType({})


def config(N: int, K: int, table: Mapping = _RULE) -> dict | None:
    """Launch config for an [N, K] weight: `table`'s (the kernel policy's tuned `gemv_bf16`;
    None there: cuBLAS measured faster), else enough programs to fill the GPU, or None when K
    has no block that divides it."""
    if (N, K) in table:
        tuned = table[(N, K)]
        return None if tuned is None else dict(tuned)
    bk = next((b for b in (1024, 512, 256) if K % b == 0), None)
    if bk is None:
        return None
    bn = 8 if N >= 8192 else 4 if N >= 2048 else 2
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4)


def use_gemv(x: torch.Tensor, w: torch.Tensor, table: Mapping = _RULE) -> bool:
    """True for one row on CUDA with a weight this kernel reads (plain bf16/fp16 [N, K])."""
    return (
        HAS_TRITON
        and not INTERPRET
        and x.is_cuda
        and x.numel() == x.shape[-1]
        and w.dim() == 2
        and w.dtype == x.dtype
        and w.dtype in (torch.bfloat16, torch.float16)
        and w.is_contiguous()
        and x.shape[-1] == w.shape[1]
        and config(w.shape[0], w.shape[1], table) is not None
    )


if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + offs_k)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


if HAS_TRITON:

    @triton.jit
    def _gemv_silu_mul_kernel(x_ptr, w_ptr, y_ptr, NI, K, UP_OFF, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):  # fmt: skip
        """y[n] = silu(w[n] . x) * (w[NI + n] . x) for a fused [gate; up] weight [2 NI, K]
        (UP_OFF = NI * K, the up rows' element offset)."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < NI
        g_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
        u_rows = g_rows + UP_OFF
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_k).to(tl.float32)[None, :]
            wg = tl.load(g_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            wu = tl.load(u_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            acc_g += wg.to(tl.float32) * x
            acc_u += wu.to(tl.float32) * x
        # the unfused path rounds the GEMM outputs to the activation dtype before SiLU
        dt = y_ptr.dtype.element_ty
        g = tl.sum(acc_g, 1).to(dt).to(tl.float32)
        u = tl.sum(acc_u, 1).to(dt).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
        tl.store(y_ptr + offs_n, y.to(dt), mask=n_ok)


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor, table: Mapping = _RULE) -> torch.Tensor:
    """x [..., K] holding one row, w [2I, K] (gate rows, then up rows) -> silu(gate) * up
    [..., I] in x's dtype: the dense / shared MLP's first half in one launch (the GEMV reads
    the same bytes as `gemv` on the fused weight; no [2I] intermediate, no elementwise kernels)."""
    require_triton(x)
    N2, K = w.shape
    cfg = config(N2, K, table)
    if cfg is None or x.numel() != K or N2 % 2:
        raise ValueError(f"gemv_silu_mul: one row of K={K}, an even number of rows and K a "
                         f"multiple of 256 needed, got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")  # fmt: skip
    ni = N2 // 2
    y = torch.empty(*x.shape[:-1], ni, dtype=x.dtype, device=x.device)
    bn = max(1, cfg.pop("BLOCK_N") // 2)  # two rows (gate, up) per output: the same bytes
    _gemv_silu_mul_kernel[(cdiv(ni, bn),)](x.contiguous(), w, y, ni, K, ni * K, BLOCK_N=bn,
                                            **cfg)  # fmt: skip
    return y


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    table: Mapping = _RULE,
) -> torch.Tensor:
    """x [..., K] holding one row, w [N, K] -> [..., N] in out_dtype (default x.dtype); launch
    config from `config(N, K, table)`."""
    require_triton(x)
    N, K = w.shape
    cfg = config(N, K, table)
    if cfg is None or x.numel() != K:
        raise ValueError(f"gemv: one row of K={K} and K a multiple of 256 needed, got x "
                         f"{tuple(x.shape)}, w {tuple(w.shape)}")  # fmt: skip
    y = torch.empty(*x.shape[:-1], N, dtype=out_dtype or x.dtype, device=x.device)
    bn = cfg.pop("BLOCK_N")
    _gemv_kernel[(cdiv(N, bn),)](x.contiguous(), w, y, N, K, BLOCK_N=bn, **cfg)
    return y
