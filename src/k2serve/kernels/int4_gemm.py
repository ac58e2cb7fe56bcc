# ruff: noqa: E741
"""INT4 W4A16 grouped GEMM for prefill: tensor cores, weights dequantized in registers.

Owns: `int4_moe_gemm` (routed-expert output of a prefill step: two grouped GEMM launches, the
SiLU-and-mul between them in torch, the weighted top-k sum), `PREFILL_CONFIG`, and
`int4_moe_grouped_mm`, the path for long prefills: experts dequantized to bf16 chunk-wise, then
torch._grouped_mm (one host sync).

Why: dequant + torch._grouped_mm writes and re-reads 4x the INT4 bytes (34 GB of bf16 per K2
layer when all 384 experts are hit). Here each program dequantizes one [BLOCK_N, 8W] weight
tile in registers (int4_dequant's lop3/bf16x2 PTX: 15 instructions per 8 weights) right before
the MMA, so the experts are read once, as INT4. From a few thousand tokens on, cuBLAS's grouped
GEMM on the dequantized copy wins (the caller picks by token count).

Layout: compressed-tensors words w int32 [E, N, K/8] (nibble j of word i = column 8i + j, value
+ 8), scales bf16 [E, N, K/group]. The PTX yields nibble pairs (j, j + 4) of each word as one
bf16x2; three levels of `tl.interleave` put the 8 planes back in natural column order, so the
activations are used as they are (no plane permutation).

The kernel computes the transposed tile (weights as the MMA's left operand, tokens as its N):
Hopper's wgmma may take its left operand from registers, and few tokens per expert waste less
of a tile. Triton 3.6 still converts the interleaved tile through shared memory (see
PREFILL_CONFIG); the weights-as-right-operand form does not compile (TritonGPUOptimizeDotOperands
fails on the interleave). One MMA per nibble plane or per plane pair, and shifting each element
out of a redundantly loaded word, were slower (benchmarks/RESULTS.md, runs 23-27).

Invariants: K % (8W) == 0, W % (group / 8) == 0. Rows are the (token, slot) pairs aligned per
expert by moe_align_block_size (padding rows read row 0 and are never stored). No host sync
(the grid is bounded on the host), so it is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton
from .int4_dequant import dequant_int4_planes, permute_planes, pick_pb, use_asm
from .moe_align import max_blocks, moe_align_block_size

if HAS_TRITON:
    from .int4_dequant import planes_bf16
    from .moe_align import aligned_block

    @triton.jit
    def _tile_bf16(p, s, USE_ASM: tl.constexpr):
        """Words p int32 [BN, W] with per-word scales s [BN, W] -> bf16 [BN, 8W], natural
        column order (column 8i + j = nibble j of word i)."""
        w0, w1, w2, w3, w4, w5, w6, w7 = planes_bf16(p, s, USE_ASM)
        even = tl.interleave(tl.interleave(w0, w4), tl.interleave(w2, w6))
        odd = tl.interleave(tl.interleave(w1, w5), tl.interleave(w3, w7))
        return tl.interleave(even, odd)

    @triton.jit
    def _int4_gemm_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, MUL_W: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr, DOT_DT: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] * dequant(w[e, n, k]) (* tw[pair]) for one
        aligned block of BLOCK_M pairs of expert e and BLOCK_N outputs, as the transposed tile
        acc[n, pair] (weights = the MMA's left operand)."""
        # the N tiles of one row block are adjacent in launch order: the block's activation
        # rows stay in L2 while every tile reads them; the row blocks of one expert follow
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair, pair_ok, rows, e = aligned_block(sorted_ptr, eid_ptr, pid_m, num_pairs, A_DIV,
                                               BLOCK_M)  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + e * w_stride_e + offs_n[:, None] * w_stride_n
        s_base = s_ptr + e * s_stride_e + offs_n[:, None] * s_stride_n
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        a_ptrs = a_ptr + rows[:, None] * a_stride + tl.arange(0, 8 * W)[None, :]
        offs_w = tl.arange(0, W)
        w_ptrs = w_base + offs_w[None, :]
        s_ptrs = s_base + (offs_w // WPG)[None, :]
        for _ in range(0, K // (8 * W)):
            p = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            s = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0)
            a = tl.load(a_ptrs)
            w = _tile_bf16(p, s, USE_ASM)
            acc = tl.dot(w.to(DOT_DT), tl.trans(a.to(DOT_DT)), acc)
            a_ptrs += 8 * W
            w_ptrs += W
            s_ptrs += W // WPG
        acc = tl.trans(acc)
        if MUL_W:
            acc = acc * tl.load(tw_ptr + pair, mask=pair_ok, other=0.0)[:, None]
        tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])  # fmt: skip


# One config for every size: 32-row blocks win slightly on uniform routing but lose badly when
# routing concentrates many rows on an expert (the k2-slice's 1k prefill). The kernel is bound
# by shared memory, not DRAM: Triton stores the dequantized tile to shared memory and reads it
# back in the wgmma operand layout on every K step.
PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, W=8, num_warps=4, num_stages=3)


def _gemm(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, cfg, group, asm):
    """One launch."""
    cfg = dict(cfg)
    W = cfg.pop("W")
    while K % (8 * W) and W > group // 8:  # small test models: a K block that fits
        W //= 2
    if K % (8 * W) or W % (group // 8):
        raise ValueError(f"int4_moe_gemm: K={K} is not a multiple of 8*W={8 * W} or group "
                         f"{group} does not divide it")  # fmt: skip
    a = a.contiguous()
    grid = (eids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    _int4_gemm_kernel[grid](
        a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a.stride(0), c.stride(0),
        w.stride(0), w.stride(1), s.stride(0), s.stride(1), A_DIV=a_div, MUL_W=mul_w, W=W,
        WPG=group // 8, DOT_DT=dot_dtype(), USE_ASM=use_asm(asm), **cfg,
    )  # fmt: skip


def int4_moe_gemm(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4"
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    config: dict | None = None,
    asm: bool = True,
) -> torch.Tensor:  # [T, D]
    """Routed-expert output: gate+up grouped GEMM, SiLU(gate) * up, down grouped GEMM scaled by
    the routing weights, sum over the top-k. No host synchronisation. `config` None:
    PREFILL_CONFIG; `asm`: the inline-PTX dequant where it compiles (`use_asm`)."""
    require_triton(x)
    T, D = x.shape
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    cfg = config or PREFILL_CONFIG
    M = T * k
    sorted_ids, eids, npost = moe_align_block_size(topk_ids, E, cfg["BLOCK_M"])
    assert eids.shape[0] == max_blocks(M, E, cfg["BLOCK_M"])
    tw = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(M, 2 * I, dtype=x.dtype, device=x.device)
    _gemm(x, ew.w13, ew.w13_scale, h, tw, sorted_ids, eids, npost, 2 * I, D, M, k, False, cfg,
          ew.group_size, asm)  # fmt: skip
    act = F.silu(h[:, :I]) * h[:, I:]
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    _gemm(act, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1, True, cfg,
          ew.group_size, asm)  # fmt: skip
    return out.view(T, k, D).sum(1)


def int4_moe_grouped_mm(x, ew, topk_weights, topk_ids, chunk: int = 32) -> torch.Tensor:
    """Prefill path: experts dequantized `chunk` at a time to bf16, torch._grouped_mm per
    projection. One host sync (expert counts). x [T, D] bf16 -> [T, D]."""
    T, D = x.shape
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    pb = pick_pb(D, I)
    if pb is None:
        raise ValueError(f"int4_moe_grouped_mm: D={D}, I={I} must be multiples of 128")
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    cum = counts.cumsum(0)
    cum_h = [0] + cum.tolist()
    tok = order // k
    xs = permute_planes(x, pb)[tok]  # [M, D], rows grouped by expert
    out_s = torch.empty(flat.numel(), D, dtype=x.dtype, device=x.device)
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        r0, r1 = cum_h[e0], cum_h[e1]
        if r1 == r0:
            continue
        offs = (cum[e0:e1] - r0).to(torch.int32)
        w13 = dequant_int4_planes(ew.w13[e0:e1], ew.w13_scale[e0:e1], pb)  # [C, 2I, D]
        h = torch._grouped_mm(xs[r0:r1], w13.transpose(1, 2), offs=offs)  # [R, 2I]
        del w13
        a = (F.silu(h[:, :I]) * h[:, I:]).to(x.dtype)
        a = permute_planes(a, pb)
        w2 = dequant_int4_planes(ew.w2[e0:e1], ew.w2_scale[e0:e1], pb)  # [C, D, I]
        out_s[r0:r1] = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        del w2
    wsel = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, out_s.float() * wsel[:, None])
    return out.to(x.dtype)
