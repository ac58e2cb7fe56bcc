"""Word-pair ("x2") arithmetic of the grouped INT4 decode GEMV (int4_gemv.py, config X2=1).

Owns: `dq_x2` (two packed INT4 words -> f16x2 weights) and `dot_x2` (their dot with the packed
activations), each with its plain-Triton twin for the interpreter and ROCm.

Why. At ~3 tokens per expert (T=128 x top-8 over K2's 384 experts) the grouped GEMV issues per
weight word one dequant (9 instructions, shared by the block's rows) and per row a word dot of
7 (4 f16x2 FMAs, 2 converts, 1 add) plus 2 for the group scale (a multiply per word, the 4
words of a group summed): ~9 per word per row. Read two adjacent words as one int64 element
and both words' products go into one f16x2 chain (8 FMAs, 2 converts, 1 add: 5.5 per word per
row) and the scale is applied per pair (1 per word per row): ~6.5, 28% fewer per row. Weights
[E, N, K/8] int32 and the packed activations (`pack_h2`: 4 planes of W words per K-block) are
read through their int64 views: the kernel runs with W/2 and words-per-group/2 and nothing
else in its indexing changes.

Bound (why fp16 stays exact enough and never overflows): each half of the f16x2 accumulator
sums 8 products (n - 8) * x with |n - 8| <= 8 and |x| < 512 (`pack_h2` scales each activation
row so): |sum| < 8 * 8 * 512 = 32768 < 65504, the same 8-term fp16 sum as `_dot_h2`'s F16SUM.

Layout of one int64 element: low 32 bits = word 2i, high = word 2i + 1 (little-endian views).
"""

from __future__ import annotations

from ._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def dq_x2(p, USE_ASM: tl.constexpr):
        """int64 element p = two words -> 4 int64 lanes j = 0..3, each holding per word the
        f16x2 pair (n_j - 8, n_j+4 - 8) (low 32 bits: the low word); without USE_ASM the raw
        nibble pairs (p >> 4j) & 0x000F000F per word, which `dot_x2`'s plain path reads."""
        if USE_ASM:
            # as int4_gemv._dq_h2 on each word: lop3 0xEA = (a & b) | c with fp16 1024 (0x6400)
            # gives 1024 + n (low nibble) / 1024 + 16n (next); minus 1032, or / 16 - 72: n - 8
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 lo, hi, q, t0, t1, t2, t3, u0, u1, u2, u3, k1032, k16, k72;
                mov.b32 k1032, 0x64086408;
                mov.b32 k16, 0x2C002C00;
                mov.b32 k72, 0xD480D480;
                mov.b64 {lo, hi}, $4;
                lop3.b32 t0, lo, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 t1, lo, 0x00F000F0, 0x64006400, 0xEA;
                shr.u32 q, lo, 8;
                lop3.b32 t2, q, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 t3, q, 0x00F000F0, 0x64006400, 0xEA;
                lop3.b32 u0, hi, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 u1, hi, 0x00F000F0, 0x64006400, 0xEA;
                shr.u32 q, hi, 8;
                lop3.b32 u2, q, 0x000F000F, 0x64006400, 0xEA;
                lop3.b32 u3, q, 0x00F000F0, 0x64006400, 0xEA;
                sub.f16x2 t0, t0, k1032;
                fma.rn.f16x2 t1, t1, k16, k72;
                sub.f16x2 t2, t2, k1032;
                fma.rn.f16x2 t3, t3, k16, k72;
                sub.f16x2 u0, u0, k1032;
                fma.rn.f16x2 u1, u1, k16, k72;
                sub.f16x2 u2, u2, k1032;
                fma.rn.f16x2 u3, u3, k16, k72;
                mov.b64 $0, {t0, u0};
                mov.b64 $1, {t1, u1};
                mov.b64 $2, {t2, u2};
                mov.b64 $3, {t3, u3};
                }
                """,
                constraints="=l,=l,=l,=l,l",
                args=[p],
                dtype=(tl.int64, tl.int64, tl.int64, tl.int64),
                is_pure=True,
                pack=1,
            )
        else:
            m = 0x000F000F000F000F
            return p & m, (p >> 4) & m, (p >> 8) & m, (p >> 12) & m

    @triton.jit
    def dot_x2(q0, q1, q2, q3, a0, a1, a2, a3, USE_ASM: tl.constexpr):
        """sum over the 16 weights of two words of (n - 8) * x, as float32: one f16x2 chain of
        8 FMAs over both words (8 products per half, see the module's bound), the two halves
        added in fp32. q_j from `dq_x2`, a_j the int64 view of activation plane j."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                asm="""
                {
                .reg .b32 q0l, q0h, q1l, q1h, q2l, q2h, q3l, q3h;
                .reg .b32 a0l, a0h, a1l, a1h, a2l, a2h, a3l, a3h, acc;
                .reg .f16 lo, hi;
                .reg .f32 flo, fhi;
                mov.b64 {q0l, q0h}, $1;
                mov.b64 {q1l, q1h}, $2;
                mov.b64 {q2l, q2h}, $3;
                mov.b64 {q3l, q3h}, $4;
                mov.b64 {a0l, a0h}, $5;
                mov.b64 {a1l, a1h}, $6;
                mov.b64 {a2l, a2h}, $7;
                mov.b64 {a3l, a3h}, $8;
                mul.f16x2 acc, q0l, a0l;
                fma.rn.f16x2 acc, q1l, a1l, acc;
                fma.rn.f16x2 acc, q2l, a2l, acc;
                fma.rn.f16x2 acc, q3l, a3l, acc;
                fma.rn.f16x2 acc, q0h, a0h, acc;
                fma.rn.f16x2 acc, q1h, a1h, acc;
                fma.rn.f16x2 acc, q2h, a2h, acc;
                fma.rn.f16x2 acc, q3h, a3h, acc;
                mov.b32 {lo, hi}, acc;
                cvt.f32.f16 flo, lo;
                cvt.f32.f16 fhi, hi;
                add.f32 $0, flo, fhi;
                }
                """,
                constraints="=r,l,l,l,l,l,l,l,l",
                args=[q0, q1, q2, q3, a0, a1, a2, a3],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        else:
            acc = _pair_term(q0, a0) + _pair_term(q1, a1)
            acc += _pair_term(q2, a2) + _pair_term(q3, a3)
            return acc

    @triton.jit
    def _pair_term(q, a):
        """Both words' (n_lo - 8) x_lo + (n_hi - 8) x_hi of one lane j, float32 (plain)."""
        return _word_term(q & 0xFFFFFFFF, a & 0xFFFFFFFF) + _word_term(
            (q >> 32) & 0xFFFFFFFF, (a >> 32) & 0xFFFFFFFF
        )

    @triton.jit
    def _word_term(q, a):
        """One word's lane: raw nibble pair q (bits 0-3, 16-19), f16x2 activation pair a."""
        x_lo = (a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x_hi = ((a >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        n_lo = (q & 0xF).to(tl.float32) - 8.0
        n_hi = ((q >> 16) & 0xF).to(tl.float32) - 8.0
        return n_lo * x_lo + n_hi * x_hi
