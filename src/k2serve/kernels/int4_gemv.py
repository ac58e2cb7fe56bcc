"""INT4 W4A16 decode GEMV for the fused MoE with f16x2 arithmetic ("h2"), for few tokens.

Over 500 lines on purpose: two Triton kernels (per pair, grouped by expert) that share the
inline-PTX word dot, its plain-Triton twin for the interpreter and ROCm, and the activation
packing; split, the arithmetic argument below would have to be read across files.

Owns: `int4_moe_decode` (the routed-expert output of a decode step: both projections, the
SiLU-and-mul and the weighted top-k sum in two launches), `pack_h2` (the activation layout the
kernel reads) and `_int4_gemv_h2_kernel`; `int4_moe_decode_grouped`, the same arithmetic with
the pairs grouped by expert (`_int4_gemv_h2_grouped_kernel`: each weight tile loaded and
dequantized once per block of up to 8 rows; config keys F16SUM 2: a group's 32 products per
row summed in f16x2, activations packed into [64, 128); CG: words loaded past L1; GSUM: the
kernel of int4_gemv_gsum.py). The MoE backend runs the grouped one for the
kernel policy's `int4_decode_grouped_min_pairs..max_pairs` (token, expert) pairs, else the
per-pair one up to `int4_decode_max_pairs`; above, the grouped GEMM of int4_gemm.py.

Weights are compressed-tensors pack-quantized (int4_dequant.py) (w int32 [E, N, K/8], lowest
nibble = lowest column, value + 8; scale bf16 [E, N, K/group]), read in their natural layout.

Arithmetic. Each activation row is scaled by a power of two so that its largest magnitude lies
in [256, 512) and stored as fp16 pairs (x_j, x_j+4) for j = 0..3 of every 8 columns: the
nibbles that one lop3 leaves in the low and high half of a register. Per word of 8 weights the
kernel runs one inline-PTX block (`_word_dot_h2`): 4 lop3 + 1 shift, 4 sub/fma to n - 8 (exact),
4 f16x2 FMAs with the activations, the two halves added in fp32; the 8-term fp16 sum is at most
8 * 8 * 512 < 65504. Group sums are scaled in fp32 and accumulated in fp32.

Invariants: K % (8 W) == 0, (W / (group / 8)) a power of two; no host synchronisation (CUDA-graph
safe); under Triton's interpreter (or with the policy's int4_asm off, or on ROCm) the same sums
run in plain Triton in fp32.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, cdiv, require_triton, tl, triton
from .int4_dequant import use_asm

if HAS_TRITON:
    from .int4_dequant import f16x2_dequant_asm, store_rows
    from .int4_gemv_parts import _dq_h2, _g_block, _g_out

    # the word's 8 weights (f16x2 pairs t0..t3) times the activation pairs $2..$5, summed
    _WORD_DOT_H2_ASM = tl.constexpr(
        f16x2_dequant_asm(
            "$1",
            ("t0", "t1", "t2", "t3"),
            decl=".reg .b32 t0, t1, t2, t3, acc; .reg .f16 lo, hi; .reg .f32 flo, fhi;",
            then="""
            mul.f16x2 acc, t0, $2;
            fma.rn.f16x2 acc, t1, $3, acc;
            fma.rn.f16x2 acc, t2, $4, acc;
            fma.rn.f16x2 acc, t3, $5, acc;
            mov.b32 {lo, hi}, acc;
            cvt.f32.f16 flo, lo;
            cvt.f32.f16 fhi, hi;
            add.f32 $0, flo, fhi;
            """,
        )
    )

    @triton.jit
    def _word_dot_h2(p, a0, a1, a2, a3, USE_ASM: tl.constexpr):
        """sum_j (n_j - 8) * x_j over the 8 nibbles of each word p, as float32. a_j holds the
        activation pair (x_j, x_j+4) as f16x2: the nibbles that one lop3 leaves in the low and
        high half of a register (j = 0..3, see `pack_h2`)."""
        if USE_ASM:
            # the f16x2 dequant (int4_dequant.f16x2_dequant_asm: n - 8 exactly, two weights
            # an instruction), then the 8 products summed in fp16 (the activation is scaled so
            # that the sum cannot overflow) and the two halves added in fp32: 16 instructions
            # per 8 weights.
            return tl.inline_asm_elementwise(
                asm=_WORD_DOT_H2_ASM,
                constraints="=r,r,r,r,r,r",
                args=[p, a0, a1, a2, a3],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        else:  # the interpreter: the same sum in float32
            acc = _h2_term(p, a0, 0)
            acc += _h2_term(p, a1, 1)
            acc += _h2_term(p, a2, 2)
            acc += _h2_term(p, a3, 3)
            return acc

    @triton.jit
    def _h2_term(p, a, J: tl.constexpr):
        """(n_J - 8) * x_J + (n_J+4 - 8) * x_J+4 in float32 (plain Triton)."""
        x_lo = (a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x_hi = ((a >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        n_lo = ((p >> (4 * J)) & 0xF).to(tl.float32) - 8.0
        n_hi = ((p >> (4 * J + 16)) & 0xF).to(tl.float32) - 8.0
        return n_lo * x_lo + n_hi * x_hi

    @triton.jit
    def _pack_h2_kernel(x_ptr, a_ptr, rs_ptr, K, x_stride, a_stride, W: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                        TOP: tl.constexpr):  # fmt: skip
        """One row: x [K] -> a [K/2] int32 f16x2 pairs, x scaled by 2^-e so that its largest
        magnitude lies in [2^TOP, 2^(TOP+1)) (TOP 8: [256, 512)); rs = 2^e. Layout: in each
        block of W words (8W columns), 4 planes of W:
        a[b*4W + j*W + w] = (x[b*8W + 8w + j], x[b*8W + 8w + j + 4])."""
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        xr = tl.load(x_ptr + r * x_stride + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(xr), 0)
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - TOP  # floor(log2 amax) - TOP
        e = tl.where(amax > 0, tl.minimum(tl.maximum(e, -100), 100), 0)
        down = ((127 - e) << 23).to(tl.float32, bitcast=True)
        tl.store(rs_ptr + r, ((127 + e) << 23).to(tl.float32, bitcast=True))
        ow = tl.arange(0, BLOCK_W)
        ok = ow < K // 8
        src = x_ptr + r * x_stride + 8 * ow
        dst = a_ptr + r * a_stride + (ow // W) * (4 * W) + ow % W
        for j in tl.static_range(4):
            lo = (tl.load(src + j, mask=ok, other=0.0).to(tl.float32) * down).to(tl.float16)
            hi = (tl.load(src + j + 4, mask=ok, other=0.0).to(tl.float32) * down).to(tl.float16)
            lo_b = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            hi_b = hi.to(tl.int16, bitcast=True).to(tl.int32) << 16
            tl.store(dst + j * W, lo_b | hi_b, mask=ok)

    @triton.jit
    def _load_words(w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n,
                    W: tl.constexpr, WPG: tl.constexpr, GS: tl.constexpr,
                    CG: tl.constexpr = 0):  # fmt: skip
        """Words [BN, W] of K-block kb and their scales: one per group of WPG words
        [BN, W // WPG] with GS, else each word's group scale [BN, W]. CG: the words loaded
        with ld.global.cg (L2 only: streamed once, no L1 lines allocated)."""
        offs_w = kb * W + tl.arange(0, W)
        pp = w_base + offs_n[:, None] * w_stride_n + offs_w[None, :]
        if CG:
            p = tl.load(pp, mask=n_ok[:, None], other=0, cache_modifier=".cg")
        else:
            p = tl.load(pp, mask=n_ok[:, None], other=0)
        if GS:
            offs_s = kb * (W // WPG) + tl.arange(0, W // WPG)
        else:
            offs_s = offs_w // WPG
        s = tl.load(s_base + offs_n[:, None] * s_stride_n + offs_s[None, :],
                    mask=n_ok[:, None], other=0.0)  # fmt: skip
        return p, s

    @triton.jit
    def _h2_sum(acc, p, a0, a1, a2, a3, s, GS: tl.constexpr, WPG: tl.constexpr,
                USE_ASM: tl.constexpr):  # fmt: skip
        """acc += scale * word sums; GS: the WPG words of a group are summed before the scale
        (acc [BN, W // WPG]), else each word is scaled (acc [BN, W])."""
        ws = _word_dot_h2(p, a0, a1, a2, a3, USE_ASM)
        if GS:
            BN: tl.constexpr = ws.shape[0]
            W: tl.constexpr = ws.shape[1]
            ws = tl.sum(tl.reshape(ws, [BN, W // WPG, WPG]), 2)
        return acc + ws * s

    @triton.jit
    def _h2_fetch(it, r, nk, a_ptr, rs_ptr, w_ptr, s_ptr, tw_ptr, ids_ptr, offs_n,
                  n_ok, N, a_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
                  A_DIV: tl.constexpr, GATED: tl.constexpr, TOPK: tl.constexpr,
                  W: tl.constexpr, WPG: tl.constexpr, GS: tl.constexpr):  # fmt: skip
        """Loads of iteration `it`: words and scales of the expert's K-block, the 4
        activation planes, and the factor c that this iteration's products get (TOPK > 0: the
        pair's top-k weight times its activation scale; else 1)."""
        if TOPK > 0:
            pair = r * TOPK + it // nk
            kb = it % nk
            a_row = pair
            c = tl.load(rs_ptr + pair) * tl.load(tw_ptr + pair)
        else:
            pair = r
            kb = it
            a_row = r // A_DIV
            c = 1.0
        e = tl.load(ids_ptr + pair).to(tl.int64)
        w_base = w_ptr + e * w_stride_e
        s_base = s_ptr + e * s_stride_e
        p, s = _load_words(w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n, W, WPG, GS)
        pu, su = p, s
        if GATED:
            pu, su = _load_words(w_base, s_base, offs_n + N, n_ok, kb, w_stride_n, s_stride_n,
                                 W, WPG, GS)  # fmt: skip
        ab = a_ptr + a_row.to(tl.int64) * a_stride + kb * 4 * W + tl.arange(0, W)
        BN: tl.constexpr = offs_n.shape[0]
        a0 = tl.broadcast_to(tl.load(ab)[None, :], [BN, W])
        a1 = tl.broadcast_to(tl.load(ab + W)[None, :], [BN, W])
        a2 = tl.broadcast_to(tl.load(ab + 2 * W)[None, :], [BN, W])
        a3 = tl.broadcast_to(tl.load(ab + 3 * W)[None, :], [BN, W])
        return p, s.to(tl.float32) * c, pu, su.to(tl.float32), a0, a1, a2, a3

    @triton.jit
    def _int4_gemv_h2_kernel(
        a_ptr, rs_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, ids_ptr, act_ptr,
        N, K, num_rows, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, GATED: tl.constexpr, TOPK: tl.constexpr,
        BLOCK_N: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr, USE_ASM: tl.constexpr,
        GS: tl.constexpr, HAS_ACT: tl.constexpr,
    ):  # fmt: skip
        """Decode GEMV over BLOCK_N output rows with activations as f16x2 pairs (`pack_h2`),
        two weights per dequant / FMA instruction (`_word_dot_h2`). Experts come straight from
        the flat top-k ids (no alignment pass).
        TOPK == 0: a program per (pair, N-block): c[pair] = W_e a[pair // A_DIV], with GATED
        silu(gate) * up, in float32.
        TOPK > 0: a program per (token, N-block): c[t] = sum_j tw[t, j] W_e(t,j) a[t*TOPK + j],
        the top-k weighted sum done in the kernel (one program per output block: splitting the
        experts over more programs was not faster at T=1).
        Rows are innermost in the grid, so the programs that share an expert read each weight
        tile at about the same time and the repeats come from L2. GS: one scale load and
        multiply per group of words. HAS_ACT: every program returns at once when act_ptr[0]
        is 0 (the MoE dispatch chose another path on the device: moe_select.py)."""
        if HAS_ACT:
            if tl.load(act_ptr) == 0:
                return
        pid = tl.program_id(0)
        r = pid % num_rows
        pid_n = pid // num_rows
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        nk = K // (8 * W)
        n_it = nk * tl.maximum(TOPK, 1)
        AW: tl.constexpr = W // WPG if GS else W
        acc = tl.zeros([BLOCK_N, AW], tl.float32)
        acc_u = tl.zeros([BLOCK_N, AW], tl.float32)
        for it in range(0, n_it):
            p, s, pu, su, a0, a1, a2, a3 = _h2_fetch(
                it, r, nk, a_ptr, rs_ptr, w_ptr, s_ptr, tw_ptr, ids_ptr,
                offs_n, n_ok, N, a_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
                A_DIV, GATED, TOPK, W, WPG, GS)  # fmt: skip
            acc = _h2_sum(acc, p, a0, a1, a2, a3, s, GS, WPG, USE_ASM)
            if GATED:
                acc_u = _h2_sum(acc_u, pu, a0, a1, a2, a3, su, GS, WPG, USE_ASM)
        y = tl.sum(acc, 1)
        if TOPK == 0:
            rs = tl.load(rs_ptr + r // A_DIV)
            y = y * rs
            if GATED:
                u = tl.sum(acc_u, 1) * rs
                y = y / (1.0 + tl.exp(-y)) * u
        rr = tl.zeros([1], tl.int32) + r
        store_rows(c_ptr, c_stride, rr, rr >= 0, offs_n, n_ok, y[None, :], 0)


def pack_h2(x: torch.Tensor, W: int, top: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (f16x2 pairs [M, K/2] int32 in the layout `_int4_gemv_h2_kernel` reads, the
    per-row scale [M] float32 that undoes the activation's power-of-two scaling; each row's
    largest magnitude scaled into [2^top, 2^(top+1)))."""
    if x.stride(-1) != 1:  # the kernel steps along a row one element at a time
        x = x.contiguous()
    M, K = x.shape
    a = torch.empty(M, K // 2, dtype=torch.int32, device=x.device)
    rs = torch.empty(M, dtype=torch.float32, device=x.device)
    bk = triton.next_power_of_2(K)
    _pack_h2_kernel[(M,)](x, a, rs, K, x.stride(0), a.stride(0), W=W, BLOCK_K=bk,
                          BLOCK_W=max(bk // 8, 1), TOP=top,
                          num_warps=8 if K >= 4096 else 4)  # fmt: skip
    return a, rs


def _launch_h2(x, w, s, c, tw, ids, N, K, rows, a_div, gated, topk, cfg, group, asm,
               active=None):  # fmt: skip
    a, rs = pack_h2(x, cfg["W"])
    grid = (rows * cdiv(N, cfg["BLOCK_N"]),)
    _int4_gemv_h2_kernel[grid](
        a, rs, w, s, c, tw, ids, ids if active is None else active, N, K, rows, a.stride(0),
        c.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), A_DIV=a_div,
        GATED=gated, TOPK=topk, BLOCK_N=cfg["BLOCK_N"], W=cfg["W"], WPG=group // 8,
        USE_ASM=use_asm(asm), GS=cfg.get("GS", 0), HAS_ACT=active is not None,
        num_warps=cfg["num_warps"],
    )  # fmt: skip


def int4_moe_decode(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4"
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    config: dict,
    asm: bool = True,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
) -> torch.Tensor:  # [T, D]
    """Routed-expert output with the h2 GEMV; no host synchronisation. `config`: BLOCK_N, W,
    num_warps, GS of the gate+up launch, and optionally "w2": overrides for the down launch
    (the kernel policy's `int4_decode`). W is halved for models too small for it. `active`
    0: the GEMV programs return at once (the output is then undefined)."""
    require_triton(x)
    T, D = x.shape
    I = ew.intermediate  # noqa: E741
    cfg = {key: v for key, v in config.items() if key != "w2"}
    cfg2 = {**cfg, **config.get("w2", {})}  # the down projection's launch
    for c in (cfg, cfg2):
        W = c["W"]
        while (D % (8 * W) or I % (8 * W)) and W > 16:  # smaller models: a block that fits
            W //= 2
        c["W"] = W
        pb = 8 * W
        if D % pb or I % pb or ew.group_size % 8 or W % (ew.group_size // 8):
            raise ValueError(f"int4_moe_decode: D={D}, I={I} must be multiples of {pb} and "
                             f"group {ew.group_size} must divide it")  # fmt: skip
    tw = topk_weights.reshape(-1).float().contiguous()
    return int4_moe_h2(x, ew, tw, topk_ids, cfg, cfg2, asm, active)


def int4_moe_h2(x, ew, tw, topk_ids, cfg: dict, cfg2: dict, asm: bool = True,
                active: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, D] -> routed-expert output [T, D] (x's dtype). tw: the flat top-k weights [T*k]
    float32; cfg / cfg2: the gate+up / down launches (BLOCK_N, W, num_warps, GS)."""
    T, D = x.shape
    k = topk_ids.shape[1]
    n_inter, M = ew.intermediate, T * k
    ids = topk_ids.reshape(-1).contiguous()
    inter = torch.empty(M, n_inter, dtype=torch.float32, device=x.device)
    _launch_h2(x, ew.w13, ew.w13_scale, inter, tw, ids, n_inter, D, M, k, True, 0, cfg,
               ew.group_size, asm, active)  # fmt: skip
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    _launch_h2(inter, ew.w2, ew.w2_scale, out, tw, ids, D, n_inter, T, 1, False, k, cfg2,
               ew.group_size, asm, active)  # fmt: skip
    return out


# ------------------------------------------------------------------------ grouped decode GEMV
# Rows grouped by expert (moe_align_block_size, blocks of BLOCK_M rows of one expert): one
# program per (aligned block, N-block) loads each weight word tile once, dequantizes it once to
# f16x2 registers (`_dq_h2`) and runs the f16x2 dot (`_dot_h2`) for each of the block's rows:
# at T >= 32 tokens x top-8 the experts are hit by several pairs each and the per-pair GEMV
# above reads (and dequantizes) every weight once per pair.
if HAS_TRITON:

    @triton.jit
    def _dot_h2(q0, q1, q2, q3, a0, a1, a2, a3, USE_ASM: tl.constexpr, F16SUM: tl.constexpr):
        """sum_j q_j . a_j over the two halves, float32: the second half of `_word_dot_h2`
        (4 products per half summed in fp16 as there, the two halves added in fp32; F16SUM:
        the halves added in fp16, all 8 products of the word in fp16 (the same overflow
        bound), one conversion instead of two)."""
        if USE_ASM and F16SUM:
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 acc;
                .reg .f16 lo, hi;
                mul.f16x2 acc, $1, $5;
                fma.rn.f16x2 acc, $2, $6, acc;
                fma.rn.f16x2 acc, $3, $7, acc;
                fma.rn.f16x2 acc, $4, $8, acc;
                mov.b32 {lo, hi}, acc;
                add.rn.f16 lo, lo, hi;
                cvt.f32.f16 $0, lo;
                }
                """,
                constraints="=r,r,r,r,r,r,r,r,r",
                args=[q0, q1, q2, q3, a0, a1, a2, a3],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        elif USE_ASM:
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 acc;
                .reg .f16 lo, hi;
                .reg .f32 flo, fhi;
                mul.f16x2 acc, $1, $5;
                fma.rn.f16x2 acc, $2, $6, acc;
                fma.rn.f16x2 acc, $3, $7, acc;
                fma.rn.f16x2 acc, $4, $8, acc;
                mov.b32 {lo, hi}, acc;
                cvt.f32.f16 flo, lo;
                cvt.f32.f16 fhi, hi;
                add.f32 $0, flo, fhi;
                }
                """,
                constraints="=r,r,r,r,r,r,r,r,r",
                args=[q0, q1, q2, q3, a0, a1, a2, a3],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        else:
            acc = _nib_term(q0, a0)
            acc += _nib_term(q1, a1)
            acc += _nib_term(q2, a2)
            acc += _nib_term(q3, a3)
            return acc

    @triton.jit
    def _nib_term(q, a):
        """(n_lo - 8) * x_lo + (n_hi - 8) * x_hi in float32 from raw nibble pairs q."""
        x_lo = (a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x_hi = ((a >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return ((q & 0xF).to(tl.float32) - 8.0) * x_lo + ((q >> 16).to(tl.float32) - 8.0) * x_hi

    @triton.jit
    def _hadd2(a, b):
        """f16x2 a + b (int32 lanes): the combine of `_g_sum16`'s group reduction."""
        return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _g_sum16(q0, q1, q2, q3, a0, a1, a2, a3, WPG: tl.constexpr, USE_ASM: tl.constexpr):
        """Group sums [BN, W // WPG, 1] float32 of one row (F16SUM 2): each word's 4 f16x2
        products chained as in `_dot_h2`, the WPG words of a group added in f16x2 (in-thread
        reduction), the halves added in fp16, one conversion: 32 products per fp16 sum, so the
        activations are packed into [64, 128) (`_top`). Plain path: the same sums in fp16."""
        BN: tl.constexpr = q0.shape[0]
        W: tl.constexpr = q0.shape[1]
        if USE_ASM:
            wh = tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 acc;
                mul.f16x2 acc, $1, $5;
                fma.rn.f16x2 acc, $2, $6, acc;
                fma.rn.f16x2 acc, $3, $7, acc;
                fma.rn.f16x2 $0, $4, $8, acc;
                }
                """,
                constraints="=r,r,r,r,r,r,r,r,r",
                args=[q0, q1, q2, q3, a0, a1, a2, a3],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
            gh = tl.reduce(tl.reshape(wh, [BN, W // WPG, WPG]), 2, _hadd2, keep_dims=True)
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .f16 lo, hi;
                mov.b32 {lo, hi}, $1;
                add.rn.f16 lo, lo, hi;
                cvt.f32.f16 $0, lo;
                }
                """,
                constraints="=r,r",
                args=[gh],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        else:
            lo, hi = _nib_h(q0, a0)
            l1, h1 = _nib_h(q1, a1)
            l2, h2 = _nib_h(q2, a2)
            l3, h3 = _nib_h(q3, a3)
            lo = ((lo + l1) + l2) + l3
            hi = ((hi + h1) + h2) + h3
            gl = tl.reduce(tl.reshape(lo, [BN, W // WPG, WPG]), 2, _add, keep_dims=True)
            gu = tl.reduce(tl.reshape(hi, [BN, W // WPG, WPG]), 2, _add, keep_dims=True)
            return (gl + gu).to(tl.float32)

    @triton.jit
    def _nib_h(q, a):
        """(n_lo - 8) * x_lo, (n_hi - 8) * x_hi in fp16 from raw nibble pairs q."""
        x_lo = (a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        x_hi = ((a >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        return ((q & 0xF) - 8).to(tl.float16) * x_lo, ((q >> 16) - 8).to(tl.float16) * x_hi

    @triton.jit
    def _g_sum(acc, q0, q1, q2, q3, a0, a1, a2, a3, s, GS: tl.constexpr, WPG: tl.constexpr,
               USE_ASM: tl.constexpr, F16SUM: tl.constexpr):  # fmt: skip
        """acc += scale * word sums of one row (as `_h2_sum`, weights already dequantized).
        GS: s is the group scale as [BN, W // WPG, 1] (`_g_scales`), multiplied before the
        in-thread group sum so that acc stays in that sum's layout (no layout conversion per
        row)."""
        if F16SUM == 2:  # GS: whole group sums in f16x2 (activations in [64, 128): _top)
            return acc + tl.sum(_g_sum16(q0, q1, q2, q3, a0, a1, a2, a3, WPG, USE_ASM) * s, 2)
        ws = _dot_h2(q0, q1, q2, q3, a0, a1, a2, a3, USE_ASM, F16SUM)
        if GS:
            BN: tl.constexpr = ws.shape[0]
            W: tl.constexpr = ws.shape[1]
            acc = acc + tl.sum(tl.reshape(ws, [BN, W // WPG, WPG]) * s, 2)
        else:
            acc = acc + ws * s
        return acc

    @triton.jit
    def _g_row(acc, acc_u, a_row_ptr, ok, q0, q1, q2, q3, s, u0, u1, u2, u3, su, a_off,
               W: tl.constexpr, GATED: tl.constexpr, GS: tl.constexpr, WPG: tl.constexpr,
               USE_ASM: tl.constexpr, SKIP: tl.constexpr, F16SUM: tl.constexpr):  # fmt: skip
        """One row of the block: its 4 activation planes of this K-block (loaded whether or
        not the row is real: padding rows read row 0), then with SKIP the products only for a
        real row (`ok`: uniform over the program, a branch), else always."""
        BN: tl.constexpr = q0.shape[0]
        ab = a_row_ptr + a_off
        a0 = tl.broadcast_to(tl.load(ab)[None, :], [BN, W])
        a1 = tl.broadcast_to(tl.load(ab + W)[None, :], [BN, W])
        a2 = tl.broadcast_to(tl.load(ab + 2 * W)[None, :], [BN, W])
        a3 = tl.broadcast_to(tl.load(ab + 3 * W)[None, :], [BN, W])
        if SKIP:
            if ok:
                acc = _g_sum(acc, q0, q1, q2, q3, a0, a1, a2, a3, s, GS, WPG, USE_ASM, F16SUM)
                if GATED:
                    acc_u = _g_sum(acc_u, u0, u1, u2, u3, a0, a1, a2, a3, su, GS, WPG,
                                   USE_ASM, F16SUM)  # fmt: skip
        else:
            acc = _g_sum(acc, q0, q1, q2, q3, a0, a1, a2, a3, s, GS, WPG, USE_ASM, F16SUM)
            if GATED:
                acc_u = _g_sum(acc_u, u0, u1, u2, u3, a0, a1, a2, a3, su, GS, WPG, USE_ASM,
                               F16SUM)  # fmt: skip
        return acc, acc_u

    @triton.jit
    def _g_scales(s, GS: tl.constexpr):
        """Scales as `_g_sum` reads them: float32, GS: [BN, W // WPG, 1]."""
        s = s.to(tl.float32)
        if GS:
            s = s[:, :, None]
        return s

    @triton.jit
    def _int4_gemv_h2_grouped_kernel(
        a_ptr, rs_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr, USE_ASM: tl.constexpr,
        GS: tl.constexpr, SKIP: tl.constexpr, PREFETCH: tl.constexpr, F16SUM: tl.constexpr,
        CG: tl.constexpr,
    ):  # fmt: skip
        """Grouped decode GEMV: a program per (aligned block of BLOCK_M <= 8 rows of one
        expert, N-block). c[pair] = W_e a[pair // A_DIV] for each real pair of the block:
        GATED: silu(gate) * up (w rows n and N + n); else times the pair's top-k weight (the
        caller sums the top-k). Each weight word is loaded and dequantized once per program.
        N-blocks are innermost in the grid (one expert's programs read adjacent memory);
        blocks past the alignment's rows in use return at once."""
        pid = tl.program_id(0)
        nbn = tl.cdiv(N, BLOCK_N)
        pid_m = pid // nbn
        pid_n = pid % nbn
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        (e, p0, ok0, ar0, p1, ok1, ar1, p2, ok2, ar2, p3, ok3, ar3, p4, ok4, ar4, p5, ok5, ar5,
         p6, ok6, ar6, p7, ok7, ar7) = _g_block(sorted_ptr, eid_ptr, pid_m, num_pairs, a_ptr,
                                                a_stride, A_DIV, BLOCK_M)  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + e * w_stride_e
        s_base = s_ptr + e * s_stride_e
        AW: tl.constexpr = W // WPG if GS else W
        z = tl.zeros([BLOCK_N, AW], tl.float32)
        c0, c1, c2, c3, c4, c5, c6, c7 = z, z, z, z, z, z, z, z
        u0, u1, u2, u3, u4, u5, u6, u7 = z, z, z, z, z, z, z, z
        nk = K // (8 * W)
        p, s = _load_words(w_base, s_base, offs_n, n_ok, 0, w_stride_n, s_stride_n, W, WPG, GS, CG)
        pu, su = p, s
        if GATED:
            pu, su = _load_words(w_base, s_base, offs_n + N, n_ok, 0, w_stride_n, s_stride_n,
                                 W, WPG, GS, CG)  # fmt: skip
        for kb in range(0, nk):
            pc, sc, puc, suc = p, s, pu, su
            if PREFETCH:  # the next K-block's loads in flight during this one's products
                kn = tl.minimum(kb + 1, nk - 1)
                p, s = _load_words(w_base, s_base, offs_n, n_ok, kn, w_stride_n, s_stride_n,
                                   W, WPG, GS, CG)  # fmt: skip
                if GATED:
                    pu, su = _load_words(w_base, s_base, offs_n + N, n_ok, kn, w_stride_n,
                                         s_stride_n, W, WPG, GS, CG)  # fmt: skip
            else:
                pc, sc = _load_words(w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n,
                                     W, WPG, GS, CG)  # fmt: skip
                if GATED:
                    puc, suc = _load_words(w_base, s_base, offs_n + N, n_ok, kb, w_stride_n,
                                           s_stride_n, W, WPG, GS, CG)  # fmt: skip
            sg = _g_scales(sc, GS)
            q0, q1, q2, q3 = _dq_h2(pc, USE_ASM)
            sug = sg
            g0, g1, g2, g3 = q0, q1, q2, q3
            if GATED:
                sug = _g_scales(suc, GS)
                g0, g1, g2, g3 = _dq_h2(puc, USE_ASM)
            a_off = kb * 4 * W + tl.arange(0, W)
            c0, u0 = _g_row(c0, u0, ar0, ok0, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug, a_off,
                            W, GATED, GS, WPG, USE_ASM, False, F16SUM)  # fmt: skip
            if BLOCK_M > 1:
                c1, u1 = _g_row(c1, u1, ar1, ok1, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug,
                                a_off, W, GATED, GS, WPG, USE_ASM, SKIP, F16SUM)  # fmt: skip
            if BLOCK_M > 2:
                c2, u2 = _g_row(c2, u2, ar2, ok2, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug,
                                a_off, W, GATED, GS, WPG, USE_ASM, SKIP, F16SUM)  # fmt: skip
                c3, u3 = _g_row(c3, u3, ar3, ok3, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug,
                                a_off, W, GATED, GS, WPG, USE_ASM, SKIP, F16SUM)  # fmt: skip
            if BLOCK_M > 4:
                c4, u4 = _g_row(c4, u4, ar4, ok4, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug,
                                a_off, W, GATED, GS, WPG, USE_ASM, SKIP, F16SUM)  # fmt: skip
                c5, u5 = _g_row(c5, u5, ar5, ok5, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug,
                                a_off, W, GATED, GS, WPG, USE_ASM, SKIP, F16SUM)  # fmt: skip
                c6, u6 = _g_row(c6, u6, ar6, ok6, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug,
                                a_off, W, GATED, GS, WPG, USE_ASM, SKIP, F16SUM)  # fmt: skip
                c7, u7 = _g_row(c7, u7, ar7, ok7, q0, q1, q2, q3, sg, g0, g1, g2, g3, sug,
                                a_off, W, GATED, GS, WPG, USE_ASM, SKIP, F16SUM)  # fmt: skip
        _g_out(c0, u0, p0, ok0, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
        if BLOCK_M > 1:
            _g_out(c1, u1, p1, ok1, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
        if BLOCK_M > 2:
            _g_out(c2, u2, p2, ok2, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
            _g_out(c3, u3, p3, ok3, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
        if BLOCK_M > 4:
            _g_out(c4, u4, p4, ok4, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
            _g_out(c5, u5, p5, ok5, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
            _g_out(c6, u6, p6, ok6, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
            _g_out(c7, u7, p7, ok7, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)


GROUPED_BLOCK_M = (1, 2, 4, 8)


def _top(cfg: dict) -> int:
    """pack_h2's range for a grouped launch: GSUM sums 32 products in fp16 (GSUM_TOP)."""
    if cfg.get("GSUM") or cfg.get("F16SUM") == 2:
        from .int4_gemv_gsum import GSUM_TOP

        return GSUM_TOP
    return 8


def _launch_grouped(a, rs, w, s, c, tw, sorted_ids, expert_ids, npost, N, K, num_pairs, a_div,
                    gated, cfg, group, asm):  # fmt: skip
    if cfg.get("GSUM") and group == 32 and cfg["W"] % 4 == 0:  # int4_gemv_gsum.py; other
        from .int4_gemv_gsum import launch_gsum  # group sizes: the kernel below (top 6 is safe)

        return launch_gsum(a, rs, w, s, c, tw, sorted_ids, expert_ids, npost, N, K, num_pairs,
                           a_div, gated, cfg, group, asm)  # fmt: skip
    bm = cfg["BLOCK_M"]
    grid = (expert_ids.numel() * cdiv(N, cfg["BLOCK_N"]),)
    _int4_gemv_h2_grouped_kernel[grid](
        a, rs, w, s, c, tw, sorted_ids, expert_ids, npost, N, K, num_pairs, a.stride(0),
        c.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), A_DIV=a_div,
        GATED=gated, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], W=cfg["W"], WPG=group // 8,
        USE_ASM=use_asm(asm), GS=cfg.get("GS", 1), SKIP=cfg.get("SKIP", 1),
        PREFETCH=cfg.get("PREFETCH", 0), F16SUM=cfg.get("F16SUM", 0), CG=cfg.get("CG", 0),
        num_warps=cfg["num_warps"],
    )  # fmt: skip


def int4_moe_decode_grouped(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4"
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    config: dict,
    asm: bool = True,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
) -> torch.Tensor:  # [T, D]
    """Routed-expert output with the grouped h2 GEMV (rows grouped by expert, each weight tile
    read and dequantized once per block of BLOCK_M rows); no host synchronisation. `config`:
    BLOCK_M (1, 2, 4 or 8), BLOCK_N, W, num_warps, optionally GS (default 1) and SKIP (default
    1: padding rows skip their products) of the gate+up launch, and optionally "w2": overrides
    for the down launch (the kernel policy's `int4_decode_grouped`); GSUM 1: the f16 group-sum
    kernel of int4_gemv_gsum.py (GS, PREFETCH, F16SUM ignored; optional maxnreg). W is halved
    for models too small for it."""
    from .moe_align import moe_align_block_size

    require_triton(x)
    T, D = x.shape
    I = ew.intermediate  # noqa: E741
    k = topk_ids.shape[1]
    cfg = {key: v for key, v in config.items() if key != "w2"}
    cfg2 = {**cfg, **config.get("w2", {})}
    if cfg2["BLOCK_M"] != cfg["BLOCK_M"]:
        raise ValueError("int4_moe_decode_grouped: one BLOCK_M for both launches (one alignment)")
    if cfg["BLOCK_M"] not in GROUPED_BLOCK_M:
        raise ValueError(f"int4_moe_decode_grouped: BLOCK_M={cfg['BLOCK_M']}: use one of "
                         f"{GROUPED_BLOCK_M}")  # fmt: skip
    for c in (cfg, cfg2):
        W = c["W"]
        while (D % (8 * W) or I % (8 * W)) and W > 16:
            W //= 2
        c["W"] = W
        pb = 8 * W
        if D % pb or I % pb or ew.group_size % 8 or W % (ew.group_size // 8):
            raise ValueError(f"int4_moe_decode_grouped: D={D}, I={I} must be multiples of {pb} "
                             f"and group {ew.group_size} must divide it")  # fmt: skip
    M = T * k
    tw = topk_weights.reshape(-1).float().contiguous()
    sorted_ids, expert_ids, npost = moe_align_block_size(topk_ids, ew.num_experts, cfg["BLOCK_M"])
    if active is not None:  # 0 rows in use: every program returns at once
        npost = npost * active
    inter = torch.empty(M, I, dtype=torch.float32, device=x.device)
    a, rs = pack_h2(x, cfg["W"], _top(cfg))
    _launch_grouped(a, rs, ew.w13, ew.w13_scale, inter, tw, sorted_ids, expert_ids, npost, I, D,
                    M, k, True, cfg, ew.group_size, asm)  # fmt: skip
    a2, rs2 = pack_h2(inter, cfg2["W"], _top(cfg2))
    out = torch.empty(M, D, dtype=torch.float32, device=x.device)
    _launch_grouped(a2, rs2, ew.w2, ew.w2_scale, out, tw, sorted_ids, expert_ids, npost, D, I,
                    M, 1, False, cfg2, ew.group_size, asm)  # fmt: skip
    return out.view(T, k, D).sum(1).to(x.dtype)
