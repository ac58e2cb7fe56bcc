"""FP8 block-quantized linear layers on the GPU without a dequantized copy of the weight.

Owns: `fp8_block_matmul(x, w, scale_inv)` (y = x @ (w * scale)^T for Kimi-K2-Instruct /
DeepSeek-V3 FP8 weights: float8_e4m3fn [N, K], float32 scales per 128 x 128 block),
`dequant_fp8_block` (one pass fp8 -> bf16 for large batches, where cuBLAS on the bf16 copy is
faster) and `use_fp8_kernel`. The row count up to which the layer runs this kernel, and the
tuned per-shape configs, come from the kernel policy (`fp8_kernel_max_rows`, `fp8_linear`):
above it prefill is compute-bound and cuBLAS on the one-pass bf16 copy is faster.

Why: the reference path (`quant.fp8.dequantize_fp8_block`) builds float32 copies of the weight
and of its expanded scales on every call, ~10x the weight's bytes; decode reads each weight
once here, as fp8. A [BN, 128] weight tile (BN divides 128) lies in one scale block, so the
scale multiplies the tile's partial product: acc += dot(x, w_tile^T) * s (exact up to the
float32 summation order).

Invariants: block (128, 128); K and N any size (partial edge blocks masked); x [M, K] in bf16 or
fp16; no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from ._triton import HAS_TRITON, INTERPRET, cdiv, dot_dtype, require_triton, tl, triton

BLOCK = 128  # the checkpoint's scale block (both dimensions)
_RULE: Mapping[tuple[int, int], tuple[Mapping, Mapping]] = MappingProxyType({})


def _config(M: int, N: int, K: int, table: Mapping = _RULE) -> dict:
    """`table`'s config for (N, K) (the kernel policy's tuned `fp8_linear`: one for up to 16
    rows, one for up to 64), else tiles by rows with K split over SPLIT_K programs when the
    output tiles alone would leave the GPU's SMs idle."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    if (N, K) in table and M <= 64:
        return dict(table[(N, K)][0 if M <= 16 else 1], BLOCK_M=bm)
    bn = 32
    tiles = cdiv(M, bm) * cdiv(N, bn)
    split = max(1, min(256 // tiles, cdiv(K, BLOCK) // 4, 16))
    return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, num_warps=4, num_stages=4)


def use_fp8_kernel(x: torch.Tensor, w: torch.Tensor, block) -> bool:
    return (
        HAS_TRITON
        and (x.is_cuda or INTERPRET)
        and tuple(block) == (BLOCK, BLOCK)
        and w.dtype == torch.float8_e4m3fn
        and w.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.shape[-1] == w.shape[1]
    )


if HAS_TRITON:

    @triton.jit
    def _fp8_block_mm_kernel(
        x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, x_stride, y_stride, s_stride, kb_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, DOT_DT: tl.constexpr,
    ):  # fmt: skip
        """y[m, n] = sum_k x[m, k] w[n, k] s[n // SB, k // SB]; one [BLOCK_M, BLOCK_N] tile,
        K in steps of SB (one scale per weight tile: BLOCK_N divides SB). With K split over
        the grid's third axis: this program's kb_per_split K-blocks into its own float32 slice
        y[split] (summed after, in a fixed order: the result does not depend on scheduling)."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        kb0 = tl.program_id(2) * kb_per_split
        kb1 = tl.minimum(kb0 + kb_per_split, tl.cdiv(K, SB))
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, SB)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride + kb0 * SB + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + kb0 * SB + offs_k[None, :]
        s_row = s_ptr + ((pid_n * BLOCK_N) // SB) * s_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(kb0, kb1):
            k_ok = offs_k < K - kb * SB
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(x.to(DOT_DT), tl.trans(w.to(DOT_DT)))
            acc += part * tl.load(s_row + kb)
            x_ptrs += SB
            w_ptrs += SB
        y_ptr += tl.program_id(2).to(tl.int64) * M * y_stride  # K split: this split's slice
        out = y_ptr + offs_m.to(tl.int64)[:, None] * y_stride + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, o_ptr, N, K, s_stride, SB: tl.constexpr,
                        BLOCK_N: tl.constexpr):  # fmt: skip
        """One [BLOCK_N, SB] tile (in one scale block) -> w * s in o's dtype."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kb = tl.program_id(1)
        offs_k = kb * SB + tl.arange(0, SB)
        m = (offs_n < N)[:, None] & (offs_k < K)[None, :]
        idx = offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        w = tl.load(w_ptr + idx, mask=m, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + ((tl.program_id(0) * BLOCK_N) // SB) * s_stride + kb)
        tl.store(o_ptr + idx, (w * s).to(o_ptr.dtype.element_ty), mask=m)


def fp8_block_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    config: dict | None = None,
    table: Mapping = _RULE,
) -> torch.Tensor:
    """x [..., K] bf16/fp16, w float8_e4m3fn [N, K], scale_inv float32 [ceil(N/128),
    ceil(K/128)] -> [..., N] in x's dtype. Launch config: `config`, else `_config(M, N, K,
    table)`."""
    require_triton(x)
    N, K = w.shape
    if x.shape[-1] != K or tuple(scale_inv.shape) != (cdiv(N, BLOCK), cdiv(K, BLOCK)):
        raise ValueError(f"fp8_block_matmul: x {tuple(x.shape)}, w {tuple(w.shape)}, scales "
                         f"{tuple(scale_inv.shape)} do not fit 128 x 128 blocks")  # fmt: skip
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0:
        return torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    cfg = dict(config or _config(M, N, K, table))
    bm, bn, split = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K", 1)
    if BLOCK % bn:
        raise ValueError(f"fp8_block_matmul: BLOCK_N={bn} must divide {BLOCK}")
    per = cdiv(cdiv(K, BLOCK), split)
    split = cdiv(cdiv(K, BLOCK), per)  # no empty splits
    y = torch.empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    _fp8_block_mm_kernel[(cdiv(N, bn), cdiv(M, bm), split)](
        x2, w.contiguous(), scale_inv.contiguous(), y, M, N, K, x2.stride(0), y.stride(1),
        scale_inv.stride(0), per, BLOCK_M=bm, BLOCK_N=bn, SB=BLOCK, DOT_DT=dot_dtype(), **cfg,
    )  # fmt: skip
    y = y[0] if split == 1 else y.sum(0).to(x.dtype)
    return y.view(*x.shape[:-1], N)


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
    """float8_e4m3fn [N, K] with 128 x 128 block scales -> [N, K] in dtype, one pass."""
    require_triton(w)
    N, K = w.shape
    out = torch.empty(N, K, dtype=dtype, device=w.device)
    sc = scale_inv.contiguous()
    _dequant_kernel[(cdiv(N, 32), cdiv(K, BLOCK))](w.contiguous(), sc, out, N, K, sc.stride(0),
                                                  SB=BLOCK, BLOCK_N=32, num_warps=4)  # fmt: skip
    return out
