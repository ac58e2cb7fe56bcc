"""Shared pieces of the INT4 MoE kernels: the weight format, its bit-trick dequantization, the
plane layout, and a standalone dequant pass.

Owns: `use_asm` (whether the inline-PTX dequant runs), `f16x2_dequant_asm` (the inline PTX of
the f16x2 dequant, for any operand positions), `pick_pb` / `permute_planes` (the plane-major
activation layout), `dequant_int4_planes` (weights to bf16 in plane order, for the dequant +
torch._grouped_mm prefill path) and the Triton helpers the kernels share: `plane_f32`,
`planes_bf16` and `store_rows`. The decode GEMV lives in int4_gemv.py, the prefill grouped GEMM
and the dequant + grouped_mm path in int4_gemm.py.

Weights are compressed-tensors pack-quantized (see fused_moe.py): w int32 [E, N, K/8], 8 nibbles
per word (lowest nibble = lowest column, value + 8), scale bf16 [E, N, K/group].

Nibble planes. A word p holds columns 8i..8i+7 of one row. Instead of unpacking each word into 8
neighbouring columns (a reshape, i.e. a shuffle through shared memory), nibble j of every word of
a K-block is one "plane" [N, PB/8] matching a strided set of activation columns. Stored
plane-major inside each block of PB columns:
`permute_planes(x, PB)[m, b*PB + j*PB/8 + i] = x[m, b*PB + 8i + j]`.

Dequant without I2F: for nibble j < 4 of p (j >= 4: of p >> 16), `(p & (0xF << 4j)) |
((150 - 4j) << 23)` read as float32 is exactly 2^(23-4j) + n; subtracting 2^(23-4j) + 8 gives
n - 8 (`plane_f32`). The bf16 path builds pairs with one lop3 (`(p >> 4j) & 0x000F000F |
0x43004300` = two bf16 of value 128 + n), then one bf16x2 FMA for -136 and one for the scale
(inline PTX in `planes_bf16`; a plain-Triton version runs under the interpreter). The f16
path (Marlin's) leaves two nibbles in an f16x2 register with one lop3 and the 0x6400 exponent
(1024 + n, or 1024 + 16 n for the next nibble) and finishes both weights with one f16x2 sub or
fma (`f16x2_dequant_asm`).

Invariants: K % PB == 0, group % 8 == 0 and (PB/8) % (group/8) == 0.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, cdiv, require_triton, tl, triton


def use_asm(enabled: bool = True) -> bool:
    """Inline-PTX dequant on an NVIDIA GPU when `enabled` (the kernel policy's int4_asm,
    K2SERVE_INT4_ASM); never in the interpreter or on ROCm (PTX does not compile there: the
    plain-Triton paths run instead)."""
    return enabled and not INTERPRET and torch.version.hip is None


def f16x2_dequant_asm(word: str, out: tuple[str, str, str, str], decl: str = "",
                      then: str = "") -> str:  # fmt: skip
    """The inline-PTX block (for `tl.inline_asm_elementwise`) of Marlin's INT4 dequant: the 8
    nibbles n_0..n_7 (value + 8) of the 32-bit register `word` to four f16x2 registers
    out[j] = (n_j - 8 low, n_j+4 - 8 high), exact: lop3 0xEA = (a & b) | c puts nibble n with
    the exponent 0x6400 (fp16 1024) as 1024 + n (minus 1032: 0x6408), the next nibble up as
    1024 + 16 n (times 1/16 minus 72: 0x2C00, 0xD480); 4 lop3, 1 shift and 4 f16x2 sub / fma
    for 8 weights. `word`, `out`: asm operands ("$4") or registers that `decl` declares; the
    block's own registers are q, k1032, k16, k72; `then`: PTX run after it in the same block.
    One text for `_word_dot_h2` (int4_gemv.py), `_dq_h2` (int4_gemv_parts.py) and `_dq8`
    (int4_moe_mma16.py), whose operands sit at other positions."""
    t0, t1, t2, t3 = out
    return f"""
    {{
    {decl}
    .reg .b32 q, k1032, k16, k72;
    mov.b32 k1032, 0x64086408;
    mov.b32 k16, 0x2C002C00;
    mov.b32 k72, 0xD480D480;
    lop3.b32 {t0}, {word}, 0x000F000F, 0x64006400, 0xEA;
    lop3.b32 {t1}, {word}, 0x00F000F0, 0x64006400, 0xEA;
    shr.u32 q, {word}, 8;
    lop3.b32 {t2}, q, 0x000F000F, 0x64006400, 0xEA;
    lop3.b32 {t3}, q, 0x00F000F0, 0x64006400, 0xEA;
    sub.f16x2 {t0}, {t0}, k1032;
    fma.rn.f16x2 {t1}, {t1}, k16, k72;
    sub.f16x2 {t2}, {t2}, k1032;
    fma.rn.f16x2 {t3}, {t3}, k16, k72;
    {then}
    }}
    """


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

    @triton.jit
    def plane_f32(p, q, J: tl.constexpr):
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
    def planes_bf16(p, s, USE_ASM: tl.constexpr):
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
            w0 = (plane_f32(p, q, 0) * sf).to(tl.bfloat16)
            w1 = (plane_f32(p, q, 1) * sf).to(tl.bfloat16)
            w2 = (plane_f32(p, q, 2) * sf).to(tl.bfloat16)
            w3 = (plane_f32(p, q, 3) * sf).to(tl.bfloat16)
            w4 = (plane_f32(p, q, 4) * sf).to(tl.bfloat16)
            w5 = (plane_f32(p, q, 5) * sf).to(tl.bfloat16)
            w6 = (plane_f32(p, q, 6) * sf).to(tl.bfloat16)
            w7 = (plane_f32(p, q, 7) * sf).to(tl.bfloat16)
        return w0, w1, w2, w3, w4, w5, w6, w7

    @triton.jit
    def store_rows(c_ptr, c_stride, pair, pair_ok, offs_n, n_ok, acc, PERM_OUT: tl.constexpr):
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
        tl.store(base, (plane_f32(p, q, 0) * s).to(tl.bfloat16), mask=m)
        tl.store(base + W, (plane_f32(p, q, 1) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 2 * W, (plane_f32(p, q, 2) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 3 * W, (plane_f32(p, q, 3) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 4 * W, (plane_f32(p, q, 4) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 5 * W, (plane_f32(p, q, 5) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 6 * W, (plane_f32(p, q, 6) * s).to(tl.bfloat16), mask=m)
        tl.store(base + 7 * W, (plane_f32(p, q, 7) * s).to(tl.bfloat16), mask=m)


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
