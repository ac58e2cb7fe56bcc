# ruff: noqa: E741
"""INT4 W4A16 fused-MoE kernels that dequantize with bit tricks instead of int->float converts.

Owns: `int4_moe` (the entry point: by config kind, int4_gemv.py's f16x2 decode GEMV "h2", the
default up to GEMV_MAX_PAIRS pairs; the plane GEMV "gemv"; the plane tensor-core grouped GEMM
"mma"), `TUNED` / `default_config`, `permute_planes` (the activation layout of the plane
kernels), `dequant_int4_planes` and `int4_moe_grouped_mm` (prefill: chunk-wise dequant to bf16 +
torch._grouped_mm).

Weights are compressed-tensors pack-quantized (see fused_moe.py): w int32 [E, N, K/8], 8 nibbles
per word (lowest nibble = lowest column, value + 8), scale bf16 [E, N, K/group].

Nibble planes. A word p holds columns 8i..8i+7 of one row. Instead of unpacking each word into 8
neighbouring columns (a reshape, i.e. a shuffle through shared memory), the kernels treat nibble
j of every word of a K-block as one "plane" [N, PB/8] and multiply it with the matching columns
of the activation. The activation is therefore stored plane-major inside each block of PB
columns: `permute_planes(x, PB)[m, b*PB + j*PB/8 + i] = x[m, b*PB + 8i + j]`. A dot product does
not care about the order of its terms, so results equal the natural-order product.

Dequant without I2F: for nibble j < 4 of p (j >= 4: of p >> 16), `(p & (0xF << 4j)) |
((150 - 4j) << 23)` read as float32 is exactly 2^(23-4j) + n; subtracting 2^(23-4j) + 8 gives
n - 8 (GEMV path, fp32 FMA). The tensor-core path builds bf16 pairs with one lop3
(`(p >> 4j) & 0x000F000F | 0x43004300` = two bf16 of value 128 + n), then one bf16x2 FMA for -136
and one for the scale (inline PTX; a plain-Triton version runs under the interpreter).

Invariants: K % PB == 0, PB % 128 == 0 for the tensor-core path, group % 8 == 0 and
(PB/8) % (group/8) == 0. No host synchronisation in `int4_moe` (CUDA-graph safe);
`int4_moe_grouped_mm` syncs once per call (prefill only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, INTERPRET, cdiv, dot_dtype, require_triton, tl, triton
from .moe_align import moe_align_block_size


def pick_pb(*ks: int) -> int | None:
    """Largest plane block in (256, 128) dividing every K, or None."""
    for pb in (256, 128):
        if all(k % pb == 0 for k in ks):
            return pb
    return None


def permute_planes(x: torch.Tensor, pb: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[M, K] -> [M, K] plane-major inside each block of pb columns (module docstring)."""
    M, K = x.shape
    if K % pb:
        raise ValueError(f"permute_planes: K={K} is not a multiple of the plane block {pb}")
    y = x.reshape(M, K // pb, pb // 8, 8).transpose(2, 3).reshape(M, K)
    return y.to(dtype) if dtype is not None else y.contiguous()


if HAS_TRITON:
    from .moe_align import aligned_block

    @triton.jit
    def _plane_f32(p, q, J: tl.constexpr):
        """Nibble J of each word as float32 n - 8 (exact), no int->float convert."""
        SH: tl.constexpr = 4 * (J % 4)
        EXP: tl.constexpr = (150 - SH) << 23
        if J < 4:
            bits = (p & (0xF << SH)) | EXP
        else:
            bits = (q & (0xF << SH)) | EXP
        base = tl.full([1, 1], EXP | (8 << SH), tl.int32).to(tl.float32, bitcast=True)
        return bits.to(tl.float32, bitcast=True) - base

    @triton.jit
    def _planes_bf16(p, s, USE_ASM: tl.constexpr):
        """8 planes (n - 8) * scale in bf16 from words p [BN, W] and per-word scales s [BN, W]."""
        if USE_ASM:
            w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 t0, t1, t2, t3, u, s2, one, m136, nz;
                mov.b32 s2, {$9, $9};
                mov.b32 one, 0x3F803F80;
                mov.b32 m136, 0xC308C308;
                mov.b32 nz, 0x80008000;
                lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 u, $8, 4;
                lop3.b32 t1, u, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 u, $8, 8;
                lop3.b32 t2, u, 0x000F000F, 0x43004300, 0xEA;
                shr.u32 u, $8, 12;
                lop3.b32 t3, u, 0x000F000F, 0x43004300, 0xEA;
                fma.rn.bf16x2 t0, t0, one, m136;
                fma.rn.bf16x2 t1, t1, one, m136;
                fma.rn.bf16x2 t2, t2, one, m136;
                fma.rn.bf16x2 t3, t3, one, m136;
                fma.rn.bf16x2 t0, t0, s2, nz;
                fma.rn.bf16x2 t1, t1, s2, nz;
                fma.rn.bf16x2 t2, t2, s2, nz;
                fma.rn.bf16x2 t3, t3, s2, nz;
                mov.b32 {$0, $4}, t0;
                mov.b32 {$1, $5}, t1;
                mov.b32 {$2, $6}, t2;
                mov.b32 {$3, $7}, t3;
                }
                """,
                constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                args=[p, s],
                dtype=(tl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
        else:
            q = p >> 16
            sf = s.to(tl.float32)
            w0 = (_plane_f32(p, q, 0) * sf).to(tl.bfloat16)
            w1 = (_plane_f32(p, q, 1) * sf).to(tl.bfloat16)
            w2 = (_plane_f32(p, q, 2) * sf).to(tl.bfloat16)
            w3 = (_plane_f32(p, q, 3) * sf).to(tl.bfloat16)
            w4 = (_plane_f32(p, q, 4) * sf).to(tl.bfloat16)
            w5 = (_plane_f32(p, q, 5) * sf).to(tl.bfloat16)
            w6 = (_plane_f32(p, q, 6) * sf).to(tl.bfloat16)
            w7 = (_plane_f32(p, q, 7) * sf).to(tl.bfloat16)
        return w0, w1, w2, w3, w4, w5, w6, w7

    @triton.jit
    def _load_ws(w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n,
                 W: tl.constexpr, WPG: tl.constexpr):  # fmt: skip
        """Words [BN, W] of K-block kb and the scale of each word's group [BN, W]."""
        offs_w = kb * W + tl.arange(0, W)
        p = tl.load(w_base + offs_n[:, None] * w_stride_n + offs_w[None, :],
                    mask=n_ok[:, None], other=0)  # fmt: skip
        s = tl.load(s_base + offs_n[:, None] * s_stride_n + (offs_w // WPG)[None, :],
                    mask=n_ok[:, None], other=0.0)  # fmt: skip
        return p, s

    @triton.jit
    def _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w, J: tl.constexpr,
                   W: tl.constexpr, DOT_DT: tl.constexpr):  # fmt: skip
        offs = kb * 8 * W + J * W + tl.arange(0, W)
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + offs[None, :], mask=row_ok[:, None],
                    other=0.0)  # fmt: skip
        return acc + tl.dot(a.to(DOT_DT), tl.trans(w.to(DOT_DT)))

    @triton.jit
    def _dot_planes(acc, a_ptr, a_rows, a_stride, row_ok, kb, p, s,
                    W: tl.constexpr, DOT_DT: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
        w0, w1, w2, w3, w4, w5, w6, w7 = _planes_bf16(p, s, USE_ASM)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w0, 0, W, DOT_DT)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w1, 1, W, DOT_DT)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w2, 2, W, DOT_DT)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w3, 3, W, DOT_DT)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w4, 4, W, DOT_DT)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w5, 5, W, DOT_DT)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w6, 6, W, DOT_DT)
        acc = _dot_plane(acc, a_ptr, a_rows, a_stride, row_ok, kb, w7, 7, W, DOT_DT)
        return acc

    @triton.jit
    def _store_out(c_ptr, c_stride, pair, pair_ok, offs_n, n_ok, acc, PERM_OUT: tl.constexpr):
        """Store rows (bf16-rounded); PERM_OUT > 0: columns plane-permuted with block PERM_OUT."""
        if PERM_OUT > 0:
            cols = (
                (offs_n // PERM_OUT) * PERM_OUT
                + (offs_n % 8) * (PERM_OUT // 8)
                + (offs_n % PERM_OUT) // 8
            )
        else:
            cols = offs_n
        val = acc.to(tl.bfloat16).to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + cols[None, :], val,
                 mask=pair_ok[:, None] & n_ok[None, :])  # fmt: skip

    @triton.jit
    def _int4_mma_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr, PERM_OUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr,
        DOT_DT: tl.constexpr, USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """Tensor-core grouped GEMM over aligned blocks of BLOCK_M rows of one expert."""
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair, pair_ok, a_rows, e = aligned_block(sorted_ptr, eid_ptr, pid_m, num_pairs, A_DIV,
                                                 BLOCK_M)  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + e * w_stride_e
        s_base = s_ptr + e * s_stride_e
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, K // (8 * W)):
            p, s = _load_ws(w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n, W, WPG)
            acc = _dot_planes(acc, a_ptr, a_rows, a_stride, pair_ok, kb, p, s, W, DOT_DT,
                              USE_ASM)  # fmt: skip
            if GATED:
                pu, su = _load_ws(w_base, s_base, offs_n + N, n_ok, kb, w_stride_n, s_stride_n,
                                  W, WPG)  # fmt: skip
                acc_u = _dot_planes(acc_u, a_ptr, a_rows, a_stride, pair_ok, kb, pu, su, W,
                                    DOT_DT, USE_ASM)  # fmt: skip
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        if MUL_W:
            acc = acc * tl.load(tw_ptr + pair, mask=pair_ok, other=0.0)[:, None]
        _store_out(c_ptr, c_stride, pair, pair_ok, offs_n, n_ok, acc, PERM_OUT)

    @triton.jit
    def _xplane(a_ptr, a_row, a_stride, kb, J: tl.constexpr, W: tl.constexpr):
        """Plane J of activation row a_row for K-block kb, fp32 [1, W] (row always valid:
        padding rows are clamped to row 0 by the caller, their results are never stored)."""
        offs = a_row * a_stride + kb * 8 * W + J * W + tl.arange(0, W)
        return tl.load(a_ptr + offs).to(tl.float32)[None, :]

    @triton.jit
    def _gemv_rows(acc, acc_u, a_ptr, a_row, a_stride, ok, kb, p, q, s, pu, qu, su,
                   GATED: tl.constexpr, W: tl.constexpr):  # fmt: skip
        """acc [BN, W] += scale * sum_j plane_j * x[plane j] (fp32 FMA); with GATED the same
        activation planes also feed the up-projection words (pu, qu, su) into acc_u."""
        x = _xplane(a_ptr, a_row, a_stride, kb, 0, W)
        ws = _plane_f32(p, q, 0) * x
        if GATED:
            wu = _plane_f32(pu, qu, 0) * x
        x = _xplane(a_ptr, a_row, a_stride, kb, 1, W)
        ws += _plane_f32(p, q, 1) * x
        if GATED:
            wu += _plane_f32(pu, qu, 1) * x
        x = _xplane(a_ptr, a_row, a_stride, kb, 2, W)
        ws += _plane_f32(p, q, 2) * x
        if GATED:
            wu += _plane_f32(pu, qu, 2) * x
        x = _xplane(a_ptr, a_row, a_stride, kb, 3, W)
        ws += _plane_f32(p, q, 3) * x
        if GATED:
            wu += _plane_f32(pu, qu, 3) * x
        x = _xplane(a_ptr, a_row, a_stride, kb, 4, W)
        ws += _plane_f32(p, q, 4) * x
        if GATED:
            wu += _plane_f32(pu, qu, 4) * x
        x = _xplane(a_ptr, a_row, a_stride, kb, 5, W)
        ws += _plane_f32(p, q, 5) * x
        if GATED:
            wu += _plane_f32(pu, qu, 5) * x
        x = _xplane(a_ptr, a_row, a_stride, kb, 6, W)
        ws += _plane_f32(p, q, 6) * x
        if GATED:
            wu += _plane_f32(pu, qu, 6) * x
        x = _xplane(a_ptr, a_row, a_stride, kb, 7, W)
        ws += _plane_f32(p, q, 7) * x
        acc += ws * s.to(tl.float32)
        if GATED:
            wu += _plane_f32(pu, qu, 7) * x
            acc_u += wu * su.to(tl.float32)
        return acc, acc_u

    @triton.jit
    def _gemv_finish(c_ptr, c_stride, tw_ptr, pair, ok, offs_n, n_ok, acc, acc_u,
                     GATED: tl.constexpr, MUL_W: tl.constexpr, PERM_OUT: tl.constexpr):  # fmt: skip
        y = tl.sum(acc, 1)
        if GATED:
            u = tl.sum(acc_u, 1)
            y = y / (1.0 + tl.exp(-y)) * u
        if MUL_W:
            y = y * tl.load(tw_ptr + pair, mask=ok, other=0.0)
        pr = tl.zeros([1], tl.int32) + pair
        okr = tl.zeros([1], tl.int1) | ok
        _store_out(c_ptr, c_stride, pr, okr, offs_n, n_ok, y[None, :], PERM_OUT)

    @triton.jit
    def _int4_gemv_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr, PERM_OUT: tl.constexpr,
        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr,
        PREFETCH: tl.constexpr, UNROLL: tl.constexpr,
    ):  # fmt: skip
        """CUDA-core GEMV: ROWS (1, 2 or 4) rows of one expert, weights dequantized once.
        UNROLL=2 issues the loads of two K-blocks before computing either (more bytes in
        flight per program; needs an even number of K-blocks)."""
        # row blocks innermost: blocks of one expert (adjacent in sorted order) read the same
        # weight tile at about the same time, so repeats come from L2, not DRAM
        pid = tl.program_id(0)
        num_m = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
        pid_m = pid % num_m
        pid_n = pid // num_m
        if pid_m * ROWS >= tl.load(npost_ptr):
            return
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        r0 = tl.load(sorted_ptr + pid_m * ROWS)
        ok0 = r0 < num_pairs
        r1 = r0
        r2 = r0
        r3 = r0
        ok1 = ok0
        ok2 = ok0
        ok3 = ok0
        if ROWS >= 2:
            r1 = tl.load(sorted_ptr + pid_m * ROWS + 1)
            ok1 = r1 < num_pairs
        if ROWS >= 4:
            r2 = tl.load(sorted_ptr + pid_m * ROWS + 2)
            ok2 = r2 < num_pairs
            r3 = tl.load(sorted_ptr + pid_m * ROWS + 3)
            ok3 = r3 < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + e * w_stride_e
        s_base = s_ptr + e * s_stride_e
        z = tl.zeros([BLOCK_N, W], tl.float32)
        g0, g1, g2, g3, u0, u1, u2, u3 = z, z, z, z, z, z, z, z
        nk = K // (8 * W)
        p, s = _load_ws(w_base, s_base, offs_n, n_ok, 0, w_stride_n, s_stride_n, W, WPG)
        pu, su = p, s
        if GATED:
            pu, su = _load_ws(w_base, s_base, offs_n + N, n_ok, 0, w_stride_n, s_stride_n, W, WPG)
        if UNROLL == 2:
            for kb2 in range(0, nk, 2):
                p, s = _load_ws(w_base, s_base, offs_n, n_ok, kb2, w_stride_n, s_stride_n, W,
                                WPG)  # fmt: skip
                pb, sb = _load_ws(w_base, s_base, offs_n, n_ok, kb2 + 1, w_stride_n, s_stride_n,
                                  W, WPG)  # fmt: skip
                pu, su, pub, sub = p, s, pb, sb
                if GATED:
                    pu, su = _load_ws(w_base, s_base, offs_n + N, n_ok, kb2, w_stride_n,
                                      s_stride_n, W, WPG)  # fmt: skip
                    pub, sub = _load_ws(w_base, s_base, offs_n + N, n_ok, kb2 + 1, w_stride_n,
                                        s_stride_n, W, WPG)  # fmt: skip
                r = tl.where(ok0, r0 // A_DIV, 0).to(tl.int64)
                g0, u0 = _gemv_rows(g0, u0, a_ptr, r, a_stride, ok0, kb2, p, p >> 16, s, pu,
                                    pu >> 16, su, GATED, W)  # fmt: skip
                g0, u0 = _gemv_rows(g0, u0, a_ptr, r, a_stride, ok0, kb2 + 1, pb, pb >> 16, sb,
                                    pub, pub >> 16, sub, GATED, W)  # fmt: skip
                if ROWS >= 2:
                    r = tl.where(ok1, r1 // A_DIV, 0).to(tl.int64)
                    g1, u1 = _gemv_rows(g1, u1, a_ptr, r, a_stride, ok1, kb2, p, p >> 16, s,
                                        pu, pu >> 16, su, GATED, W)  # fmt: skip
                    g1, u1 = _gemv_rows(g1, u1, a_ptr, r, a_stride, ok1, kb2 + 1, pb, pb >> 16,
                                        sb, pub, pub >> 16, sub, GATED, W)  # fmt: skip
                if ROWS >= 4:
                    r = tl.where(ok2, r2 // A_DIV, 0).to(tl.int64)
                    g2, u2 = _gemv_rows(g2, u2, a_ptr, r, a_stride, ok2, kb2, p, p >> 16, s,
                                        pu, pu >> 16, su, GATED, W)  # fmt: skip
                    g2, u2 = _gemv_rows(g2, u2, a_ptr, r, a_stride, ok2, kb2 + 1, pb, pb >> 16,
                                        sb, pub, pub >> 16, sub, GATED, W)  # fmt: skip
                    r = tl.where(ok3, r3 // A_DIV, 0).to(tl.int64)
                    g3, u3 = _gemv_rows(g3, u3, a_ptr, r, a_stride, ok3, kb2, p, p >> 16, s,
                                        pu, pu >> 16, su, GATED, W)  # fmt: skip
                    g3, u3 = _gemv_rows(g3, u3, a_ptr, r, a_stride, ok3, kb2 + 1, pb, pb >> 16,
                                        sb, pub, pub >> 16, sub, GATED, W)  # fmt: skip
        if UNROLL == 1:
            for kb in range(0, nk):
                if PREFETCH:  # next K-block's words in flight while this one is computed
                    kn = (kb + 1) % nk
                    pn, sn = _load_ws(
                        w_base, s_base, offs_n, n_ok, kn, w_stride_n, s_stride_n, W, WPG
                    )
                    pun, sun = pn, sn
                    if GATED:
                        pun, sun = _load_ws(w_base, s_base, offs_n + N, n_ok, kn, w_stride_n,
                                            s_stride_n, W, WPG)  # fmt: skip
                else:
                    p, s = _load_ws(
                        w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n, W, WPG
                    )
                    if GATED:
                        pu, su = _load_ws(w_base, s_base, offs_n + N, n_ok, kb, w_stride_n,
                                          s_stride_n, W, WPG)  # fmt: skip
                q = p >> 16
                qu = pu >> 16
                r = tl.where(ok0, r0 // A_DIV, 0).to(tl.int64)
                g0, u0 = _gemv_rows(g0, u0, a_ptr, r, a_stride, ok0, kb, p, q, s, pu, qu, su,
                                    GATED, W)  # fmt: skip
                if ROWS >= 2:
                    r = tl.where(ok1, r1 // A_DIV, 0).to(tl.int64)
                    g1, u1 = _gemv_rows(g1, u1, a_ptr, r, a_stride, ok1, kb, p, q, s, pu, qu, su,
                                        GATED, W)  # fmt: skip
                if ROWS >= 4:
                    r = tl.where(ok2, r2 // A_DIV, 0).to(tl.int64)
                    g2, u2 = _gemv_rows(g2, u2, a_ptr, r, a_stride, ok2, kb, p, q, s, pu, qu, su,
                                        GATED, W)  # fmt: skip
                    r = tl.where(ok3, r3 // A_DIV, 0).to(tl.int64)
                    g3, u3 = _gemv_rows(g3, u3, a_ptr, r, a_stride, ok3, kb, p, q, s, pu, qu, su,
                                        GATED, W)  # fmt: skip
                if PREFETCH:
                    p, s, pu, su = pn, sn, pun, sun
        _gemv_finish(c_ptr, c_stride, tw_ptr, r0, ok0, offs_n, n_ok, g0, u0, GATED, MUL_W, PERM_OUT)
        if ROWS >= 2:
            _gemv_finish(c_ptr, c_stride, tw_ptr, r1, ok1, offs_n, n_ok, g1, u1, GATED, MUL_W,
                         PERM_OUT)  # fmt: skip
        if ROWS >= 4:
            _gemv_finish(c_ptr, c_stride, tw_ptr, r2, ok2, offs_n, n_ok, g2, u2, GATED, MUL_W,
                         PERM_OUT)  # fmt: skip
            _gemv_finish(c_ptr, c_stride, tw_ptr, r3, ok3, offs_n, n_ok, g3, u3, GATED, MUL_W,
                         PERM_OUT)  # fmt: skip

    @triton.jit
    def _dequant_planes_kernel(w_ptr, s_ptr, o_ptr, n_rows, KW, W: tl.constexpr,
                               WPG: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
        """[R, K/8] int32 + [R, K/G] -> [R, K] bf16, columns plane-permuted (block 8W)."""
        offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        kb = tl.program_id(1)
        r_ok = offs_r < n_rows
        rows = offs_r.to(tl.int64)
        offs_w = kb * W + tl.arange(0, W)
        p = tl.load(w_ptr + rows[:, None] * KW + offs_w[None, :], mask=r_ok[:, None], other=0)
        s = tl.load(s_ptr + rows[:, None] * (KW // WPG) + (offs_w // WPG)[None, :],
                    mask=r_ok[:, None], other=0.0).to(tl.float32)  # fmt: skip
        q = p >> 16
        base = o_ptr + rows[:, None] * (8 * KW) + kb * 8 * W + tl.arange(0, W)[None, :]
        m = r_ok[:, None]
        tl.store(base, (_plane_f32(p, q, 0) * s).to(tl.bfloat16), mask=m)
        tl.store(base + W, (_plane_f32(p, q, 1) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 2 * W, (_plane_f32(p, q, 2) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 3 * W, (_plane_f32(p, q, 3) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 4 * W, (_plane_f32(p, q, 4) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 5 * W, (_plane_f32(p, q, 5) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 6 * W, (_plane_f32(p, q, 6) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 7 * W, (_plane_f32(p, q, 7) * s).to(tl.bfloat16), mask=m)


def use_asm() -> bool:
    """Inline-PTX dequant on an NVIDIA GPU (disable with K2SERVE_INT4_ASM=0); never in the
    interpreter or on ROCm (PTX does not compile there: the plain-Triton paths run instead)."""
    import os

    return (
        not INTERPRET
        and torch.version.hip is None
        and os.environ.get("K2SERVE_INT4_ASM", "1") == "1"
    )


# Tuned GEMV configs (benchmarks/model_speed.py may replace them with its sweep's winners). A config
# may hold "w2": {...}, overrides for the down-projection launch (BLOCK_N, W, num_warps, ...).
TUNED = {
    # the f16x2 GEMV with group scales (about twice as fast as the plane GEMV at T=1 and T=8)
    "r1": dict(
        kind="h2", BLOCK_N=8, W=64, num_warps=4, GS=1, w2=dict(BLOCK_N=8, W=128, num_warps=4, GS=1)
    ),  # fmt: skip
}
# T * top_k up to which the decode GEMV is used. The h2 GEMV dequantizes per (token, expert)
# pair, so its cost grows with the pairs, the grouped kernel's with the distinct experts: on
# uniform routing h2 wins at every T up to 128, but under concentrated routing (few experts, many
# pairs each) it loses above 256 pairs; 256 (T <= 32 at top-8) wins under both (RESULTS.md).
GEMV_MAX_PAIRS = 256


def default_config(T: int, k: int, E: int) -> dict:
    """Kernel choice by rows per expert (T * k pairs): the h2 GEMV up to GEMV_MAX_PAIRS, then
    the plane tensor-core kernel by rows per expert."""
    M = T * k
    if M <= GEMV_MAX_PAIRS:
        return dict(TUNED["r1"])
    if M <= 4 * E:
        return dict(kind="mma", BLOCK_M=16, BLOCK_N=64, W=32, num_warps=4, num_stages=3)
    if M <= 16 * E:
        return dict(kind="mma", BLOCK_M=32, BLOCK_N=128, W=32, num_warps=4, num_stages=3)
    return dict(kind="mma", BLOCK_M=64, BLOCK_N=128, W=32, num_warps=4, num_stages=3)


def _launch(kind, a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, gated, mul_w,
            perm_out, cfg, group):  # fmt: skip
    cfg = dict(cfg)
    cfg.pop("w2", None)
    W = cfg.pop("W")
    bm = cfg.pop("ROWS") if kind == "gemv" else cfg["BLOCK_M"]
    grid = (eids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    args = (a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a.stride(0), c.stride(0),
            w.stride(0), w.stride(1), s.stride(0), s.stride(1))  # fmt: skip
    common = dict(A_DIV=a_div, GATED=gated, MUL_W=mul_w, PERM_OUT=perm_out, W=W, WPG=group // 8)
    if kind == "gemv":
        cfg.setdefault("PREFETCH", 0)
        unroll = cfg.pop("UNROLL", 1)
        if (K // (8 * W)) % 2 or cfg["PREFETCH"]:
            unroll = 1
        _int4_gemv_kernel[grid](*args, ROWS=bm, UNROLL=unroll, **common, **cfg)
    else:
        _int4_mma_kernel[grid](*args, **common, DOT_DT=dot_dtype(), USE_ASM=use_asm(), **cfg)


def int4_moe(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4"
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    config: dict | None = None,
) -> torch.Tensor:  # [T, D]
    """Routed-expert output with the plane kernels, or (kind "h2") int4_gemv's f16x2 GEMV; no
    host synchronisation."""
    require_triton(x)
    T, D = x.shape
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    cfg = dict(config or default_config(T, k, E))
    kind = cfg.pop("kind")
    cfg2 = {**cfg, **cfg.pop("w2", {})}  # the down projection's launch
    for c in (cfg, cfg2):
        W = c["W"]
        while (D % (8 * W) or I % (8 * W)) and W > 16:  # smaller models: a block that fits
            W //= 2
        c["W"] = W
        pb = 8 * W
        if D % pb or I % pb or ew.group_size % 8 or W % (ew.group_size // 8):
            raise ValueError(f"int4_moe: D={D}, I={I} must be multiples of {pb} and group "
                             f"{ew.group_size} must divide it")  # fmt: skip
    pb, pb2 = 8 * cfg["W"], 8 * cfg2["W"]
    M = T * k
    tw = topk_weights.reshape(-1).float().contiguous()
    if kind == "h2":
        from .int4_gemv import int4_moe_h2  # NOTE: here: int4_gemv imports this module

        return int4_moe_h2(x, ew, tw, topk_ids, cfg, cfg2)
    bm = cfg["ROWS"] if kind == "gemv" else cfg["BLOCK_M"]
    if (cfg2["ROWS"] if kind == "gemv" else cfg2["BLOCK_M"]) != bm:
        raise ValueError("int4_moe: the w2 overrides must keep ROWS / BLOCK_M")
    sorted_ids, eids, npost = moe_align_block_size(topk_ids, E, bm)
    act_dt = torch.float32 if kind == "gemv" else x.dtype
    xp = permute_planes(x, pb, act_dt).contiguous()
    inter = torch.empty(M, I, dtype=act_dt, device=x.device)
    _launch(kind, xp, ew.w13, ew.w13_scale, inter, tw, sorted_ids, eids, npost, I, D, M, k,
            True, False, pb2, cfg, ew.group_size)  # fmt: skip
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    _launch(kind, inter, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1,
            False, True, 0, cfg2, ew.group_size)  # fmt: skip
    return out.view(T, k, D).sum(1)


def dequant_int4_planes(packed: torch.Tensor, scale: torch.Tensor, pb: int) -> torch.Tensor:
    """[..., N, K/8] int32 + [..., N, K/G] -> [..., N, K] bf16, K plane-permuted (block pb)."""
    require_triton(packed)
    KW = packed.shape[-1]
    G = KW * 8 // scale.shape[-1]
    rows = packed.numel() // KW
    out = torch.empty(*packed.shape[:-1], KW * 8, dtype=torch.bfloat16, device=packed.device)
    W = pb // 8
    grid = (cdiv(rows, 16), KW // W)
    _dequant_planes_kernel[grid](packed, scale, out, rows, KW, W=W, WPG=G // 8, BLOCK_R=16,
                                 num_warps=4)  # fmt: skip
    return out


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
