# ruff: noqa: E741
"""Fused MoE: grouped expert GEMMs over aligned (token, expert) blocks, weights dequantized in
the kernel, SiLU-and-mul fused into the first GEMM, routing weights into the second.

Owns: `ExpertWeights` (stacked per-layer expert tensors), `fused_moe(...)` (Triton),
`fused_moe_ref(...)` (torch oracle), `dequant_int4_ref`, `dequant_fp8_ref`.

Weight layouts (stacked over experts E; I = moe_intermediate_size, D = hidden_size):
- "bf16":  w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I].
- "int4":  compressed-tensors pack-quantized: w13 int32 [E, 2I, D/8] (8 nibbles per int32,
           value + 8, lowest nibble = lowest column), w13_scale bf16 [E, 2I, D/group];
           w2 int32 [E, D, I/8], w2_scale bf16 [E, D, I/group]. W = (nibble - 8) * scale.
- "fp8":   float8_e4m3fn w13 [E, 2I, D], w13_scale fp32 [E, 2 cdiv(I,128), cdiv(D,128)]
           (gate's block rows, then up's; multiplied);
           w2 [E, D, I], w2_scale [E, D/128, I/128].
Math: y[t] = sum_j w[t, j] * W2[e_tj] (silu(Wg[e_tj] x[t]) * Wu[e_tj] x[t]).
Activations stay bf16 (W4A16 / W8A16); accumulation is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton
from .moe_align import moe_align_block_size

QUANT_IDS = {"bf16": 0, "int4": 1, "fp8": 2}


@dataclass
class ExpertWeights:
    quant: str  # "bf16" | "int4" | "fp8"
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    group_size: int = 32  # int4 columns per scale; fp8 uses 128x128 blocks

    def __post_init__(self):
        if self.quant not in QUANT_IDS:
            raise ValueError(
                f"ExpertWeights.quant={self.quant!r}; expected one of {list(QUANT_IDS)}"
            )
        if self.quant != "bf16" and (self.w13_scale is None or self.w2_scale is None):
            raise ValueError(f"ExpertWeights.quant={self.quant!r} needs w13_scale and w2_scale")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]


# --------------------------------------------------------------------------------------------
# references


def dequant_int4_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, K/8] int32 + [N, K/G] scale -> [N, K] float32."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * 4
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]
    q = (nib.reshape(packed.shape[0], -1) - 8).float()
    g = q.shape[1] // scale.shape[1]
    return q * scale.float().repeat_interleave(g, dim=1)


def dequant_fp8_ref(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """[N, K] fp8 + [cdiv(N,128), cdiv(K,128)] fp32 -> [N, K] float32."""
    s = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return w.float() * s[: w.shape[0], : w.shape[1]]


def expert_dense(ew: ExpertWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's (w13 [2I, D], w2 [D, I]) in float32."""
    if ew.quant == "bf16":
        return ew.w13[e].float(), ew.w2[e].float()
    assert ew.w13_scale is not None and ew.w2_scale is not None  # int4 / fp8 carry scales
    if ew.quant == "int4":
        return dequant_int4_ref(ew.w13[e], ew.w13_scale[e]), dequant_int4_ref(
            ew.w2[e], ew.w2_scale[e]
        )
    # fp8: gate and up have their own 128-row scale blocks (cdiv(I, 128) rows each)
    I, nb = ew.intermediate, -(-ew.intermediate // 128)  # noqa: E741
    w13, s13 = ew.w13[e], ew.w13_scale[e]
    gate_up = torch.cat(
        [dequant_fp8_ref(w13[:I], s13[:nb]), dequant_fp8_ref(w13[I:], s13[nb:])], dim=0
    )
    return gate_up, dequant_fp8_ref(ew.w2[e], ew.w2_scale[e])


def fused_moe_ref(x, ew: ExpertWeights, topk_weights, topk_ids) -> torch.Tensor:
    """x [T, D], topk_weights [T, k] float, topk_ids [T, k] -> [T, D] in x.dtype (fp32 math)."""
    out = torch.zeros(x.shape[0], ew.hidden, dtype=torch.float32, device=x.device)
    I = ew.intermediate
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = expert_dense(ew, e)
        h = x[tok].float() @ w13.t()
        y = (F.silu(h[:, :I]) * h[:, I:]).to(x.dtype).float() @ w2.t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Triton

if HAS_TRITON:

    @triton.jit
    def _load_w_tile(
        w_ptr, s_ptr, offs_n, n_ok, k0, K, stride_n, s_stride_n,
        QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_DT: tl.constexpr,
    ):  # fmt: skip
        """Weight tile [BLOCK_N, BLOCK_K] of rows offs_n, columns k0.., dequantized to DOT_DT
        (fp8: unscaled; the caller applies the 128x128 block scale to the partial product)."""
        if QUANT == 1:
            offs_p = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            p = tl.load(
                w_ptr + offs_n[:, None] * stride_n + offs_p[None, :],
                mask=n_ok[:, None] & (offs_p < K // 8)[None, :],
                other=0,
            )
            shifts = tl.arange(0, 8) * 4
            nib = (p[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, BK/8, 8]
            q = tl.reshape(nib, [BLOCK_N, BLOCK_K]) - 8
            offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            s = tl.load(
                s_ptr + offs_n[:, None] * s_stride_n + offs_g[None, :],
                mask=n_ok[:, None] & (offs_g < K // GROUP)[None, :],
                other=0.0,
            )
            s = tl.reshape(
                tl.broadcast_to(s[:, :, None], [BLOCK_N, BLOCK_K // GROUP, GROUP]),
                [BLOCK_N, BLOCK_K],
            )
            w = (q.to(tl.float32) * s.to(tl.float32)).to(DOT_DT)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(
                w_ptr + offs_n[:, None] * stride_n + offs_k[None, :],
                mask=n_ok[:, None] & (offs_k < K)[None, :],
                other=0.0,
            ).to(DOT_DT)
        return w

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride,
        w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
        GATED: tl.constexpr, MUL_W: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_DT: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        pair_ok = pair < num_pairs
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        a_rows = (pair // A_DIV).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + e * w_stride_e
        s_base = s_ptr + e * s_stride_e
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + a_rows[:, None] * a_stride + offs_k[None, :],
                mask=pair_ok[:, None] & (offs_k < K)[None, :],
                other=0.0,
            ).to(DOT_DT)
            w = _load_w_tile(
                w_base,
                s_base,
                offs_n,
                n_ok,
                k0,
                K,
                w_stride_n,
                s_stride_n,
                QUANT,
                GROUP,
                BLOCK_N,
                BLOCK_K,
                DOT_DT,
            )
            part = tl.dot(a, tl.trans(w))
            if QUANT == 2:
                sc = tl.load(
                    s_base + (offs_n // 128) * s_stride_n + k0 // 128, mask=n_ok, other=0.0
                )
                part = part * sc[None, :]
            acc += part
            if GATED:
                offs_u = offs_n + N
                wu = _load_w_tile(
                    w_base,
                    s_base,
                    offs_u,
                    n_ok,
                    k0,
                    K,
                    w_stride_n,
                    s_stride_n,
                    QUANT,
                    GROUP,
                    BLOCK_N,
                    BLOCK_K,
                    DOT_DT,
                )
                part_u = tl.dot(a, tl.trans(wu))
                if QUANT == 2:
                    # up's scale rows follow gate's cdiv(N, 128) rows (equal to offs_u // 128
                    # only when N is a multiple of 128)
                    sc_u = tl.load(
                        s_base + (offs_n // 128 + (N + 127) // 128) * s_stride_n + k0 // 128,
                        mask=n_ok,
                        other=0.0,
                    )
                    part_u = part_u * sc_u[None, :]
                acc_u += part_u
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        if MUL_W:
            tw = tl.load(tw_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)
            acc = acc * tw[:, None]
        tl.store(
            c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :],
            acc.to(c_ptr.dtype.element_ty),
            mask=pair_ok[:, None] & n_ok[None, :],
        )


def kernel_config(num_pairs: int, num_experts: int, quant: str, small_max_pairs=None) -> dict:
    """Block sizes: small-M (decode: weight streaming) up to `small_max_pairs` (token, expert)
    pairs (None: 4 an expert), large-M (prefill: tensor cores) above. Picked from config
    sweeps on one H200 (benchmarks/model_speed.py)."""
    if num_pairs <= (4 * num_experts if small_max_pairs is None else small_max_pairs):
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256 if quant == "int4" else 128,
                    num_warps=4, num_stages=4)  # fmt: skip
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _gemm(a, w, s, c, tw, sorted_ids, expert_ids, npost, N, K, num_pairs, a_div, quant, group,
          gated, mul_w, cfg):  # fmt: skip
    grid = (expert_ids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    s_arg = s if s is not None else w
    _moe_gemm_kernel[grid](
        a, w, s_arg, c, tw, sorted_ids, expert_ids, npost, N, K, num_pairs, a.stride(0),
        c.stride(0), w.stride(0), w.stride(1), s_arg.stride(0), s_arg.stride(1),
        A_DIV=a_div, QUANT=QUANT_IDS[quant], GROUP=group, GATED=gated, MUL_W=mul_w,
        DOT_DT=dot_dtype(), **cfg,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, D] bf16
    ew: ExpertWeights,
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int32/int64
    config: dict | None = None,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
) -> torch.Tensor:  # [T, D]
    """Routed-expert output sum_j w_tj * expert_{e_tj}(x_t); no host synchronisation.
    `active` 0: every program returns at once (the output is left unwritten: the caller
    discards it); None: always run."""
    require_triton(x)
    T, D = x.shape
    if D != ew.hidden:
        raise ValueError(f"fused_moe: hidden size {D} != experts' {ew.hidden}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError("fused_moe: topk_ids / topk_weights must both be [T, top_k]")
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    M = T * k
    cfg = dict(config or kernel_config(M, E, ew.quant))
    while ew.quant == "int4" and D % cfg["BLOCK_K"] and cfg["BLOCK_K"] > 32:
        cfg["BLOCK_K"] //= 2  # small test models: the largest block dividing the hidden size
    if ew.quant == "int4" and (cfg["BLOCK_K"] % ew.group_size or ew.group_size % 8):
        raise ValueError(f"int4 group_size={ew.group_size} must divide BLOCK_K={cfg['BLOCK_K']}")
    x = x.contiguous()
    sorted_ids, expert_ids, npost = moe_align_block_size(topk_ids, E, cfg["BLOCK_M"])
    if active is not None:  # 0 rows in use: every program returns at once
        npost = npost * active
    tw = topk_weights.reshape(-1).float().contiguous()
    inter = torch.empty(M, I, dtype=x.dtype, device=x.device)
    _gemm(x, ew.w13, ew.w13_scale, inter, tw, sorted_ids, expert_ids, npost, I, D, M, k,
          ew.quant, ew.group_size, True, False, cfg)  # fmt: skip
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    _gemm(inter, ew.w2, ew.w2_scale, out, tw, sorted_ids, expert_ids, npost, D, I, M, 1,
          ew.quant, ew.group_size, False, True, cfg)  # fmt: skip
    return out.view(T, k, D).sum(1)
