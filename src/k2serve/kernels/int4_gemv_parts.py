"""Triton pieces both grouped decode GEMVs use (int4_gemv.py's `_int4_gemv_h2_grouped_kernel`
and int4_gemv_gsum.py's `_int4_gemv_gsum_kernel`): the word dequant to f16x2 (`_dq_h2`: the
inline PTX of int4_dequant.f16x2_dequant_asm), an aligned block's expert and rows (`_g_block`,
each row's pair and activation pointer from `_g_pair`) and a row's epilogue (`_g_out`). Their
own module so that the two kernel files need not import each other (int4_gemv dispatches to
the gsum kernel; the gsum kernel reads these)."""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .int4_dequant import f16x2_dequant_asm, store_rows

    _DQ_H2_ASM = tl.constexpr(f16x2_dequant_asm("$4", ("$0", "$1", "$2", "$3")))

    @triton.jit
    def _dq_h2(p, USE_ASM: tl.constexpr):
        """Word p (8 nibbles) -> 4 int32 lanes holding weights (n_j - 8, n_j+4 - 8), j = 0..3:
        with USE_ASM as f16x2 (the first half of `_word_dot_h2`); else the raw nibble pairs
        (p >> 4j) & 0x000F000F, which `_dot_h2`'s plain path reads."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                asm=_DQ_H2_ASM,
                constraints="=r,=r,=r,=r,r",
                args=[p],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            return (p & 0x000F000F, (p >> 4) & 0x000F000F, (p >> 8) & 0x000F000F,
                    (p >> 12) & 0x000F000F)  # fmt: skip

    @triton.jit
    def _g_pair(sorted_ptr, i, num_pairs, a_ptr, a_stride, A_DIV: tl.constexpr):
        """Row i of the block: (pair id, real?, its activation row's pointer; padding: row 0)."""
        pair = tl.load(sorted_ptr + i)
        ok = pair < num_pairs
        row = tl.where(ok, pair // A_DIV, 0).to(tl.int64)
        return pair, ok, a_ptr + row * a_stride

    @triton.jit
    def _g_out(acc, acc_u, pair, ok, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok,
               A_DIV: tl.constexpr, GATED: tl.constexpr):  # fmt: skip
        """Row epilogue: GATED: silu(gate) * up of the activation row's scale; else times the
        pair's activation scale and top-k weight. Padding rows store nothing."""
        y = tl.sum(acc, 1)
        if GATED:
            rs = tl.load(rs_ptr + tl.where(ok, pair // A_DIV, 0))
            y = y * rs
            u = tl.sum(acc_u, 1) * rs
            y = y / (1.0 + tl.exp(-y)) * u
        else:
            pr = tl.where(ok, pair, 0)
            y = y * (tl.load(rs_ptr + pr) * tl.load(tw_ptr + pr))
        rr = tl.zeros([1], tl.int32) + pair
        rok = (tl.zeros([1], tl.int32) + ok.to(tl.int32)) > 0
        store_rows(c_ptr, c_stride, rr, rok, offs_n, n_ok, y[None, :], 0)

    @triton.jit
    def _g_block(sorted_ptr, eid_ptr, pid_m, num_pairs, a_ptr, a_stride, A_DIV: tl.constexpr,
                 BLOCK_M: tl.constexpr):  # fmt: skip
        """Aligned block pid_m's expert and its up to 8 rows as (pair, real?, activation row
        pointer) triples (`_g_pair`; rows past BLOCK_M repeat row 0 and are never used)."""
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        sb = sorted_ptr + pid_m * BLOCK_M
        p0, ok0, ar0 = _g_pair(sb, 0, num_pairs, a_ptr, a_stride, A_DIV)
        p1, ok1, ar1 = p0, ok0, ar0
        p2, ok2, ar2 = p0, ok0, ar0
        p3, ok3, ar3 = p0, ok0, ar0
        p4, ok4, ar4 = p0, ok0, ar0
        p5, ok5, ar5 = p0, ok0, ar0
        p6, ok6, ar6 = p0, ok0, ar0
        p7, ok7, ar7 = p0, ok0, ar0
        if BLOCK_M > 1:
            p1, ok1, ar1 = _g_pair(sb, 1, num_pairs, a_ptr, a_stride, A_DIV)
        if BLOCK_M > 2:
            p2, ok2, ar2 = _g_pair(sb, 2, num_pairs, a_ptr, a_stride, A_DIV)
            p3, ok3, ar3 = _g_pair(sb, 3, num_pairs, a_ptr, a_stride, A_DIV)
        if BLOCK_M > 4:
            p4, ok4, ar4 = _g_pair(sb, 4, num_pairs, a_ptr, a_stride, A_DIV)
            p5, ok5, ar5 = _g_pair(sb, 5, num_pairs, a_ptr, a_stride, A_DIV)
            p6, ok6, ar6 = _g_pair(sb, 6, num_pairs, a_ptr, a_stride, A_DIV)
            p7, ok7, ar7 = _g_pair(sb, 7, num_pairs, a_ptr, a_stride, A_DIV)
        return (e, p0, ok0, ar0, p1, ok1, ar1, p2, ok2, ar2, p3, ok3, ar3, p4, ok4, ar4,
                p5, ok5, ar5, p6, ok6, ar6, p7, ok7, ar7)  # fmt: skip
