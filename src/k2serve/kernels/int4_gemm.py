# ruff: noqa: E741
"""INT4 W4A16 grouped GEMM for prefill: tensor cores, weights dequantized in registers.

Owns: `int4_moe_gemm` (routed-expert output of a prefill step: two grouped GEMM launches, the
SiLU-and-mul between them in torch, the weighted top-k sum), `PREFILL_TUNED` / `prefill_config`.

Why: the previous prefill path (moe_int4.int4_moe_grouped_mm) dequantizes every hit expert to
bf16 in memory and runs torch._grouped_mm on it, i.e. writes and re-reads 4x the INT4 bytes
(34 GB of bf16 per K2 layer when all 384 experts are hit). Here each program dequantizes one
[BLOCK_N, 8W] weight tile in registers (moe_int4's lop3/bf16x2 PTX: 15 instructions per 8
weights) right before the MMA, so the experts are read once, as INT4.

Layout: compressed-tensors words w int32 [E, N, K/8] (nibble j of word i = column 8i + j, value
+ 8), scales bf16 [E, N, K/group]. The PTX yields nibble pairs (j, j + 4) of each word as one
bf16x2; three levels of `tl.interleave` put the 8 planes back in natural column order, so the
activations are used as they are (no plane permutation).

SWAP=1 computes the transposed tile (weights as the MMA's left operand, tokens as its N): on
Hopper the left operand of a wgmma may come straight from registers, so the dequantized tile
needs no trip through shared memory, and few tokens per expert waste less of a tile.

Invariants: K % (8W) == 0, W % (group / 8) == 0. Rows are the (token, slot) pairs aligned per
expert by moe_align_block_size (padding rows read row 0 and are never stored). No host sync
(the grid is bounded on the host), so it is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton
from .moe_align import max_blocks, moe_align_block_size
from .moe_int4 import permute_planes, use_asm

if HAS_TRITON:
    from .moe_int4 import _planes_bf16

    @triton.jit
    def _tile_bf16(p, s, USE_ASM: tl.constexpr):
        """Words p int32 [BN, W] with per-word scales s [BN, W] -> bf16 [BN, 8W], natural
        column order (column 8i + j = nibble j of word i)."""
        w0, w1, w2, w3, w4, w5, w6, w7 = _planes_bf16(p, s, USE_ASM)
        even = tl.interleave(tl.interleave(w0, w4), tl.interleave(w2, w6))
        odd = tl.interleave(tl.interleave(w1, w5), tl.interleave(w3, w7))
        return tl.interleave(even, odd)

    @triton.jit
    def _dot_plane(acc, w, a_ptrs, J: tl.constexpr, W: tl.constexpr, DOT_DT: tl.constexpr):
        a = tl.load(a_ptrs + J * W)  # [BM, W]: plane J of the plane-permuted activations
        return tl.dot(w.to(DOT_DT), tl.trans(a.to(DOT_DT)), acc)

    @triton.jit
    def _dot_pair(acc, wa, wb, a_ptrs, J: tl.constexpr, W: tl.constexpr, DOT_DT: tl.constexpr):
        """Planes J and J + 4 (one bf16x2 register of the PTX) as one [BN, 2W] operand, column
        2i + h = plane J + 4h of word i, against the pair-permuted activations."""
        a = tl.load(a_ptrs + J * 2 * W)  # [BM, 2W]
        w = tl.reshape(tl.join(wa, wb), [wa.shape[0], 2 * W])
        return tl.dot(w.to(DOT_DT), tl.trans(a.to(DOT_DT)), acc)

    @triton.jit
    def _int4_gemm_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, MUL_W: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr, DOT_DT: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] * dequant(w[e, n, k]) (* tw[pair]) for one
        aligned block of BLOCK_M pairs of expert e and BLOCK_N outputs, as the transposed tile
        acc[n, pair] (weights = the MMA's left operand). MODE 0: the 8 nibble planes
        interleaved back to natural order; 1: one MMA per plane against plane-permuted
        activations (block 8W); 2: each weight element shifted out of its word (redundant
        word loads, natural order); 3: one MMA per plane pair (J, J + 4) against pair-permuted
        activations (`permute_pairs`)."""
        # the N tiles of one row block are adjacent in launch order: the block's activation
        # rows stay in L2 while every tile reads them; the row blocks of one expert follow
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pair < num_pairs
        rows = tl.where(pair_ok, pair // A_DIV, 0).to(tl.int64)
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + e * w_stride_e + offs_n[:, None] * w_stride_n
        s_base = s_ptr + e * s_stride_e + offs_n[:, None] * s_stride_n
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        if MODE == 1:
            a_ptrs = a_ptr + rows[:, None] * a_stride + tl.arange(0, W)[None, :]
        elif MODE == 3:
            a_ptrs = a_ptr + rows[:, None] * a_stride + tl.arange(0, 2 * W)[None, :]
        else:
            a_ptrs = a_ptr + rows[:, None] * a_stride + tl.arange(0, 8 * W)[None, :]
        if MODE == 2:
            offs_k = tl.arange(0, 8 * W)
            w_ptrs = w_base + (offs_k // 8)[None, :]
            s_ptrs = s_base + (offs_k // (8 * WPG))[None, :]
            shift = ((offs_k % 8) * 4)[None, :]
        else:
            offs_w = tl.arange(0, W)
            w_ptrs = w_base + offs_w[None, :]
            s_ptrs = s_base + (offs_w // WPG)[None, :]
        for _ in range(0, K // (8 * W)):
            p = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            s = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0)
            if MODE == 0:
                a = tl.load(a_ptrs)
                w = _tile_bf16(p, s, USE_ASM)
                acc = tl.dot(w.to(DOT_DT), tl.trans(a.to(DOT_DT)), acc)
            elif MODE == 1:
                w0, w1, w2, w3, w4, w5, w6, w7 = _planes_bf16(p, s, USE_ASM)
                acc = _dot_plane(acc, w0, a_ptrs, 0, W, DOT_DT)
                acc = _dot_plane(acc, w1, a_ptrs, 1, W, DOT_DT)
                acc = _dot_plane(acc, w2, a_ptrs, 2, W, DOT_DT)
                acc = _dot_plane(acc, w3, a_ptrs, 3, W, DOT_DT)
                acc = _dot_plane(acc, w4, a_ptrs, 4, W, DOT_DT)
                acc = _dot_plane(acc, w5, a_ptrs, 5, W, DOT_DT)
                acc = _dot_plane(acc, w6, a_ptrs, 6, W, DOT_DT)
                acc = _dot_plane(acc, w7, a_ptrs, 7, W, DOT_DT)
            elif MODE == 3:
                w0, w1, w2, w3, w4, w5, w6, w7 = _planes_bf16(p, s, USE_ASM)
                acc = _dot_pair(acc, w0, w4, a_ptrs, 0, W, DOT_DT)
                acc = _dot_pair(acc, w1, w5, a_ptrs, 1, W, DOT_DT)
                acc = _dot_pair(acc, w2, w6, a_ptrs, 2, W, DOT_DT)
                acc = _dot_pair(acc, w3, w7, a_ptrs, 3, W, DOT_DT)
            else:
                a = tl.load(a_ptrs)
                bits = ((p >> shift) & 0xF) | 0x4B000000  # fp32 2^23 + n
                wf = (bits.to(tl.float32, bitcast=True) - 8388616.0) * s.to(tl.float32)
                acc = tl.dot(wf.to(DOT_DT), tl.trans(a.to(DOT_DT)), acc)
            a_ptrs += 8 * W
            w_ptrs += W
            s_ptrs += W // WPG
        acc = tl.trans(acc)
        if MUL_W:
            acc = acc * tl.load(tw_ptr + pair, mask=pair_ok, other=0.0)[:, None]
        tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])  # fmt: skip


def permute_pairs(x: torch.Tensor, W: int) -> torch.Tensor:
    """[M, K] -> [M, K]: inside each block of 8W columns, column 8i + 4h + j goes to
    j * 2W + 2i + h (MODE 3's operand order)."""
    M, K = x.shape
    return x.reshape(M, K // (8 * W), W, 2, 4).permute(0, 1, 4, 2, 3).reshape(M, K)


# Prefill configs by pairs per expert (T * k / E), the smallest threshold first; keys are
# kernel meta-parameters. Chosen by bench/prefill_moe.py on one H200 (bench/RESULTS.md).
PREFILL_TUNED = [
    (32, dict(MODE=0, BLOCK_M=32, BLOCK_N=128, W=8, num_warps=4, num_stages=3)),
    (1 << 30, dict(MODE=0, BLOCK_M=64, BLOCK_N=128, W=8, num_warps=4, num_stages=3)),
]


def prefill_config(T: int, k: int, E: int) -> dict:
    per_expert = T * k / E
    for limit, cfg in PREFILL_TUNED:
        if per_expert <= limit:
            return dict(cfg)
    return dict(PREFILL_TUNED[-1][1])


def _gemm(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, cfg, group):
    """One launch (MODE 1 reads a plane-permuted copy of a)."""
    cfg = dict(cfg)
    W = cfg.pop("W")
    while K % (8 * W) and W > group // 8:  # small test models: a K block that fits
        W //= 2
    if K % (8 * W) or W % (group // 8):
        raise ValueError(f"int4_moe_gemm: K={K} is not a multiple of 8*W={8 * W} or group "
                         f"{group} does not divide it")  # fmt: skip
    mode = cfg["MODE"]
    if mode == 1:
        a = permute_planes(a, 8 * W)
    elif mode == 3:
        a = permute_pairs(a, W)
    else:
        a = a.contiguous()
    grid = (eids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    _int4_gemm_kernel[grid](
        a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a.stride(0), c.stride(0),
        w.stride(0), w.stride(1), s.stride(0), s.stride(1), A_DIV=a_div, MUL_W=mul_w, W=W,
        WPG=group // 8, DOT_DT=dot_dtype(), USE_ASM=use_asm(), **cfg,
    )  # fmt: skip


def int4_moe_gemm(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4"
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    config: dict | None = None,
) -> torch.Tensor:  # [T, D]
    """Routed-expert output: gate+up grouped GEMM, SiLU(gate) * up, down grouped GEMM scaled by
    the routing weights, sum over the top-k. No host synchronisation."""
    require_triton(x)
    T, D = x.shape
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    cfg = config or prefill_config(T, k, E)
    M = T * k
    sorted_ids, eids, npost = moe_align_block_size(topk_ids, E, cfg["BLOCK_M"])
    assert eids.shape[0] == max_blocks(M, E, cfg["BLOCK_M"])
    tw = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty(M, 2 * I, dtype=x.dtype, device=x.device)
    _gemm(x, ew.w13, ew.w13_scale, h, tw, sorted_ids, eids, npost, 2 * I, D, M, k, False, cfg,
          ew.group_size)  # fmt: skip
    act = F.silu(h[:, :I]) * h[:, I:]
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    _gemm(act, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1, True, cfg,
          ew.group_size)  # fmt: skip
    return out.view(T, k, D).sum(1)
