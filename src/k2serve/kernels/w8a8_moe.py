# ruff: noqa: E741
"""Prompts on FP8 tensor cores: grouped MoE GEMMs with FP8 activations (W8A8, DeepSeek's recipe).

Owns: `w8a8_moe` (routed-expert output of one step: gate+up GEMM with SiLU-and-mul and the
intermediate's fp8 quantization in its epilogue, down GEMM scaled by the routing weights, the
weighted top-k sum), `quant_fp8_groups` (activations [T, K] -> e4m3 [T, K] + fp32 scales
[T, K/128], one scale per token per 128 columns), `w8a8_moe_ref` (float32 oracle of the same
quantized math), `PREFILL_CONFIG` and `check_config`.

Math (DeepSeek-V3 / vLLM / SGLang "fp8 w8a8 block"): activations are quantized per token and
128-column group, a8 = e4m3(a / sa) with sa = amax / 448; the product is accumulated one K block
at a time on the FP8 tensor cores and promoted to fp32 with both scales,
    acc[m, n] += dot(a8[m, kb], w8[n, kb]) * sa[m, kb / 128] * sw[n, kb],
so each MMA chain is at most one 128-wide K block (Hopper's fp8 MMA keeps fewer accumulator
bits than fp32; DeepSeek promotes every 128 K for that reason).
- FP8-block experts (128x128 block scales as DeepSeek-V3 / Kimi-K2 ship): sw = scale[n/128, k/128]
  (BLOCK_K 128: one scale per row tile and K step).
- INT4 experts (group 32): the nibbles n - 8 (-8..7) are exact in e4m3, converted in registers;
  the group scale is per output row and 32 columns, so the K step is 32 and every step pays a
  [BLOCK_M, BLOCK_N] multiply-add on the CUDA cores (sw = scale[n, k/32]).
The intermediate h = silu(gate) * up is quantized in the first GEMM's epilogue from its fp32
value (BLOCK_N = 128: a program holds whole 128-column groups of its rows), so the second GEMM
reads 1 byte per value and no separate pass runs.

Rounding to e4m3 is done in fp32 arithmetic (`_e4m3_round`: round-to-nearest-even on the fp32
bits, sub-normals by an add-and-subtract, clamp to +-448), then the exact value is cast: one code
path for the GPU and the CPU interpreter (whose own fp32 -> fp8 cast rounds wrongly: 126 -> 64).

Invariants: rows are the (token, slot) pairs aligned per expert by moe_align_block_size (padding
rows read row 0 and are never stored); hidden and intermediate sizes multiples of 128; no host
sync (the grid is bounded on the host): CUDA-graph safe. Under TRITON_INTERPRET the dots run in
fp32 on the exact fp8 values (the interpreter has no fp8 dot).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, INTERPRET, cdiv, require_triton, tl, triton
from .fused_moe import expert_dense
from .moe_align import moe_align_block_size

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # activation scale group (columns)

if HAS_TRITON:
    from .moe_align import aligned_block, grouped_tile

    @triton.jit
    def _e4m3_round(x):
        """x (fp32, already divided by its scale) rounded to the nearest e4m3 value (ties to
        even), clamped to +-448: exact fp32 values that the cast to fp8 keeps unchanged."""
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576  # 3 mantissa bits, RNE
        normal = b.to(tl.float32, bitcast=True)
        sub = (x + 24576.0) - 24576.0  # multiples of 2^-9 (e4m3's sub-normal step), RNE
        q = tl.where(tl.abs(x) < 0.015625, sub, normal)
        return tl.minimum(tl.maximum(q, -448.0), 448.0)

    @triton.jit
    def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, R, x_stride, q_stride, s_stride,
                             BLOCK_R: tl.constexpr):  # fmt: skip
        """Rows [BLOCK_R] x one 128-column group: scale = amax / 448, q = e4m3(x / scale)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        g = tl.program_id(1)
        cols = g * 128 + tl.arange(0, 128)
        ok = rows < R
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + cols[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)  # fmt: skip
        s = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
        q = _e4m3_round(x / s[:, None])
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * q_stride + cols[None, :],
                 q.to(q_ptr.dtype.element_ty), mask=ok[:, None])  # fmt: skip
        tl.store(s_ptr + rows * s_stride + g, s, mask=ok)

    @triton.jit
    def _w_tile(w_ptr, offs_n, n_ok, k0, w_stride_n, INT4: tl.constexpr, BLOCK_K: tl.constexpr):
        """The weight tile [BLOCK_K, BLOCK_N] at column k0 as e4m3 (INT4: the nibbles - 8)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        if INT4:
            p = tl.load(w_ptr + offs_n[None, :] * w_stride_n + (kk // 8)[:, None],
                        mask=n_ok[None, :], other=0)  # fmt: skip
            nib = (p >> ((kk % 8) * 4)[:, None]) & 0xF
            w = (nib - 8).to(tl.float16).to(tl.float8e4nv)
        else:  # one return: Triton 3.6 rejects a return per branch with different types
            w = tl.load(w_ptr + offs_n[None, :] * w_stride_n + kk[:, None], mask=n_ok[None, :],
                        other=0.0)  # fmt: skip
        return w

    @triton.jit
    def _w8a8_moe_kernel(
        a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, cs_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, as_stride, c_stride, cs_stride,
        w_stride_e, w_stride_n, ws_stride_e, ws_stride_n, up_off, up_s_off,
        A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr, INT4: tl.constexpr,
        WS_N: tl.constexpr, WS_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, F32_DOT: tl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] W[e, n, k] for one aligned block of BLOCK_M
        pairs of expert e and BLOCK_N outputs, from e4m3 activations (scales as_ptr [rows,
        K/128]) and e4m3 / INT4 weights (scales ws[e, n // WS_N, k // WS_K]). GATED: up's rows
        at n + up_off (scale rows at n // WS_N + up_s_off); c = silu(gate) * up quantized to
        e4m3 per 128 columns (cs_ptr: its scales). MUL_W: c *= tw[pair]."""
        pid_m, pid_n = grouped_tile(N, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair, pair_ok, rows, e = aligned_block(sorted_ptr, eid_ptr, pid_m, num_pairs, A_DIV,
                                               BLOCK_M)  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + e * w_stride_e
        ws_rows = ws_ptr + e * ws_stride_e + (offs_n // WS_N) * ws_stride_n  # [BLOCK_N]
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * a_stride + offs_k[None, :]
        as_row = as_ptr + rows * as_stride
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if GATED:
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs)
            sa = tl.load(as_row + k0 // 128)  # [BLOCK_M]
            w = _w_tile(w_base, offs_n, n_ok, k0, w_stride_n, INT4, BLOCK_K)
            sw = tl.load(ws_rows + k0 // WS_K, mask=n_ok, other=0.0).to(tl.float32)
            if GATED:
                w_u = _w_tile(w_base + up_off * w_stride_n, offs_n, n_ok, k0, w_stride_n, INT4,
                              BLOCK_K)  # fmt: skip
                sw_u = tl.load(ws_rows + up_s_off * ws_stride_n + k0 // WS_K, mask=n_ok,
                               other=0.0).to(tl.float32)  # fmt: skip
            if F32_DOT:
                p = tl.dot(a.to(tl.float32), w.to(tl.float32))
            else:
                p = tl.dot(a, w)
            if GATED:
                if F32_DOT:
                    p_u = tl.dot(a.to(tl.float32), w_u.to(tl.float32))
                else:
                    p_u = tl.dot(a, w_u)
                acc_u += p_u * sa[:, None] * sw_u[None, :]
            acc += p * sa[:, None] * sw[None, :]
            a_ptrs += BLOCK_K
        if GATED:  # h = silu(gate) * up, quantized per row and 128 columns (BLOCK_N == 128)
            h = acc / (1.0 + tl.exp(-acc)) * acc_u
            s = tl.maximum(tl.max(tl.abs(h), 1), 1e-12) / 448.0
            q = _e4m3_round(h / s[:, None])
            c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :]
            tl.store(c_ptrs, q.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])
            tl.store(cs_ptr + pair * cs_stride + pid_n, s, mask=pair_ok)
        else:
            if MUL_W:
                acc = acc * tl.load(tw_ptr + pair, mask=pair_ok, other=0.0)[:, None]
            c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])


# One config for prompts (many rows per expert). w13's BLOCK_N is 128 (the epilogue quantizes
# whole 128-column groups); BLOCK_K is 128 for FP8-block weights, 32 for INT4 (one group scale
# per K step). benchmarks/w8a8_moe.py --sweep times alternatives.
PREFILL_CONFIG: Mapping[str, Any] = {
    "BLOCK_M": 64,
    "w13": {"BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "w2": {"BLOCK_N": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
}
_TILE_KEYS = {"BLOCK_N", "GROUP_M", "num_warps", "num_stages"}


def check_config(cfg: Mapping[str, Any]) -> None:
    """Raise ValueError when a config breaks the kernel's invariants."""
    bm = cfg.get("BLOCK_M")
    if not isinstance(bm, int) or bm < 16 or bm & (bm - 1):
        raise ValueError(f"w8a8_moe: BLOCK_M={bm!r} must be a power of two >= 16")
    for part in ("w13", "w2"):
        t = cfg.get(part)
        if not isinstance(t, Mapping) or set(t) != _TILE_KEYS:
            raise ValueError(f"w8a8_moe: config {part} must have the keys {sorted(_TILE_KEYS)}")
        bn = t["BLOCK_N"]
        if not isinstance(bn, int) or bn < 16 or bn > 256 or bn & (bn - 1):
            raise ValueError(f"w8a8_moe: {part} BLOCK_N={bn!r} must be a power of two <= 256")
    if cfg["w13"]["BLOCK_N"] != 128:
        raise ValueError("w8a8_moe: w13 BLOCK_N must be 128 (the epilogue quantizes 128 columns)")


def supported(ew) -> bool:
    """Whether these experts run here: FP8-block or INT4 group 32, sizes multiples of 128."""
    ok = ew.hidden % GROUP == 0 and ew.intermediate % GROUP == 0
    return ok and (ew.quant == "fp8" or (ew.quant == "int4" and ew.group_size == 32))


def quant_fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (K % 128 == 0) -> (e4m3 [R, K], fp32 scales [R, K/128]), x ~ q * scale."""
    require_triton(x)
    R, K = x.shape
    if K % GROUP:
        raise ValueError(f"quant_fp8_groups: K={K} is not a multiple of {GROUP}")
    q = torch.empty(R, K, dtype=FP8, device=x.device)
    s = torch.empty(R, K // GROUP, dtype=torch.float32, device=x.device)
    block_r = 16
    _quant_groups_kernel[(cdiv(R, block_r), K // GROUP)](
        x, q, s, R, x.stride(0), q.stride(0), s.stride(0), BLOCK_R=block_r, num_warps=4
    )
    return q, s


def quant_fp8_groups_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of quant_fp8_groups (float32 math, the cast rounds to nearest even)."""
    R, K = x.shape
    g = x.float().view(R, K // GROUP, GROUP)
    s = g.abs().amax(-1).clamp_min(1e-12) / FP8_MAX  # [R, K/128]
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(R, K), s


def _gemm(a, a_s, w, w_s, c, c_s, tw, sorted_ids, eids, npost, N, K, M, a_div, gated, mul_w,
          int4, block_m, t, up_off=0, up_s_off=0):  # fmt: skip
    grid = (eids.shape[0] * cdiv(N, t["BLOCK_N"]),)
    ws_n, ws_k = (1, 32) if int4 else (128, 128)
    cs = c_s if c_s is not None else a_s  # unused unless gated
    _w8a8_moe_kernel[grid](
        a, a_s, w, w_s, c, cs, tw, sorted_ids, eids, npost, N, K, M, a.stride(0),
        a_s.stride(0), c.stride(0), cs.stride(0), w.stride(0), w.stride(1), w_s.stride(0),
        w_s.stride(1), up_off, up_s_off, A_DIV=a_div, GATED=gated, MUL_W=mul_w, INT4=int4,
        WS_N=ws_n, WS_K=ws_k, BLOCK_M=block_m, BLOCK_K=32 if int4 else 128, F32_DOT=INTERPRET,
        **t,
    )  # fmt: skip


def w8a8_moe(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "fp8" (128x128 blocks) or "int4" (group 32)
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:  # [T, D]
    """Routed-expert output sum_j w_tj * expert_{e_tj}(x_t) with FP8 activations (per token and
    128 columns) on the FP8 tensor cores; no host synchronisation."""
    require_triton(x)
    if not supported(ew):
        raise ValueError(
            f"w8a8_moe: experts {ew.quant!r} group {ew.group_size} with hidden {ew.hidden} / "
            f"intermediate {ew.intermediate} are not supported"
        )
    T, D = x.shape
    if D != ew.hidden:
        raise ValueError(f"w8a8_moe: hidden size {D} != experts' {ew.hidden}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError("w8a8_moe: topk_ids / topk_weights must both be [T, top_k]")
    cfg = dict(PREFILL_CONFIG if config is None else config)
    check_config(cfg)
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    M = T * k
    int4 = ew.quant == "int4"
    bm = cfg["BLOCK_M"]
    sorted_ids, eids, npost = moe_align_block_size(topk_ids, E, bm)
    tw = topk_weights.reshape(-1).float().contiguous()
    x8, xs = quant_fp8_groups(x.contiguous())
    h8 = torch.empty(M, I, dtype=FP8, device=x.device)
    hs = torch.empty(M, I // GROUP, dtype=torch.float32, device=x.device)
    up_s = I if int4 else cdiv(I, 128)
    _gemm(x8, xs, ew.w13, ew.w13_scale, h8, hs, tw, sorted_ids, eids, npost, I, D, M, k, True,
          False, int4, bm, cfg["w13"], up_off=I, up_s_off=up_s)  # fmt: skip
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    _gemm(h8, hs, ew.w2, ew.w2_scale, out, None, tw, sorted_ids, eids, npost, D, I, M, 1, False,
          True, int4, bm, cfg["w2"])  # fmt: skip
    return out.view(T, k, D).sum(1)


def w8a8_moe_ref(x, ew, topk_weights, topk_ids) -> torch.Tensor:
    """Float32 oracle of w8a8_moe's math: x and h quantized per token and 128 columns exactly as
    the kernel does, the products in float32 with dequantized weights. x [T, D] -> [T, D]."""
    T, D = x.shape
    I = ew.intermediate
    x8, xs = quant_fp8_groups_ref(x)
    xq = (x8.float().view(T, D // GROUP, GROUP) * xs[..., None]).view(T, D)
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = expert_dense(ew, e)  # float32 [2I, D], [D, I]
        gu = xq[tok] @ w13.t()  # [n, 2I]
        h = F.silu(gu[:, :I]) * gu[:, I:]
        h8, hs = quant_fp8_groups_ref(h)
        hq = (h8.float().view(-1, I // GROUP, GROUP) * hs[..., None]).view(-1, I)
        y = hq @ w2.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out
