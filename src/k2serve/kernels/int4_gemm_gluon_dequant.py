"""The INT4 nibble-plane dequant of the Gluon grouped GEMM (int4_gemm_gluon.py), in the
wgmma's register-operand layout: one plane at a time in fp32 math (`_plane`) or two k-adjacent
weights an instruction in bf16x2 PTX (`_plane_pair_bf16x2`), and the scale broadcast over a
plane's columns (`_split_cols`, `_to_plane`: layout conversions that move no data).

Invariants: imports without Triton or Gluon (then defines nothing); Triton 3.6's Gluon API.
"""

from __future__ import annotations

try:  # pragma: no cover - depends on the installed Triton
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAS_GLUON = True
except Exception:  # noqa: BLE001 - no Triton, no Gluon, or another Gluon API
    HAS_GLUON = False

if HAS_GLUON:

    @triton.constexpr_function
    def _split_cols(ll, BLOCK_N, W2):
        """The plane layout's linear layout over [BLOCK_N, W2] seen as [BLOCK_N, W2 / 4, 4]
        (column c = 4h + r): each basis [n, c] -> [n, c >> 2, c & 3]."""

        def split(b):
            return [b[0], b[1] >> 2, b[1] & 3]

        return gl.DistributedLinearLayout(
            reg_bases=[split(b) for b in ll.reg_bases],
            lane_bases=[split(b) for b in ll.lane_bases],
            warp_bases=[split(b) for b in ll.warp_bases],
            block_bases=[split(b) for b in ll.block_bases],
            shape=[BLOCK_N, W2 // 4, 4],
        )

    @gluon.jit
    def _to_plane(x4, l3: gl.constexpr, dl: gl.constexpr, BLOCK_N: gl.constexpr,
                  W2: gl.constexpr):  # fmt: skip
        """[BLOCK_N, W2 / 4] (layout SliceLayout(2, l3)) -> [BLOCK_N, W2] in the plane layout
        dl, each value repeated over its 4 columns; no data moves."""
        x3 = gl.expand_dims(x4, 2)
        x3 = gl.broadcast(x3, gl.full([BLOCK_N, W2 // 4, 4], 0, x4.dtype, l3))[0]
        return gl.convert_layout(gl.reshape(x3, [BLOCK_N, W2]), dl, assert_trivial=True)

    @gluon.jit
    def _plane(p, s, c, J: gl.constexpr):
        """Nibble plane J of words p as bf16 (n - 8) * s (int4_gemm._plane_w's exact math:
        one and/or to the float bits of 2^E + n, one FMA with c = -(2^E + 8) * s, one
        rounding)."""
        if J < 2:
            r = p << 8
        elif J < 4:
            r = p
        elif J < 6:
            r = p >> 8
        else:
            r = p >> 16
        if J % 2 == 0:  # nibble at bits 8-11: (r & 0xF00) | float bits of 2^15
            bits = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF00, 0x47000000, 0xEA;", "=r,r",
                                             [r], dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip
        else:  # bits 12-15: (r & 0xF000) | float bits of 2^11
            bits = gl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF000, 0x45000000, 0xEA;", "=r,r",
                                             [r], dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip
        return gl.fma(bits.to(gl.float32, bitcast=True), s, c).to(gl.bfloat16)

    @triton.constexpr_function
    def _pair_asm(M):
        """PTX of `_plane_pair_bf16x2` for byte M of the words ($2, $3: the words of a k pair,
        $4: their bf16 scale pair; $0, $1: planes 2M and 2M + 1 as bf16 pairs)."""
        sel = M | (M << 4) | ((4 + M) << 8) | ((4 + M) << 12)
        return (
            "{ .reg .b32 t, lo, hi, one, b, z;\n"
            "mov.b32 one, 0x3F803F80;\n"  # bf16 1.0, 1.0
            "mov.b32 b, 0xC308C308;\n"  # bf16 -136, -136
            "mov.b32 z, 0x80008000;\n"  # bf16 -0, -0
            f"prmt.b32 t, $2, $3, {sel:#x};\n"
            "lop3.b32 lo, t, 0x000F000F, 0x43004300, 0xEA;\n"
            "shr.u32 t, t, 4;\n"
            "lop3.b32 hi, t, 0x000F000F, 0x43004300, 0xEA;\n"
            "fma.rn.bf16x2 lo, lo, one, b;\n"
            "fma.rn.bf16x2 hi, hi, one, b;\n"
            "fma.rn.bf16x2 $0, lo, $4, z;\n"
            "fma.rn.bf16x2 $1, hi, $4, z; }"
        )

    @gluon.jit
    def _plane_pair_bf16x2(p, s2, M: gl.constexpr):
        """Nibble planes 2M and 2M + 1 of words p as bf16 (n - 8) * s, two k-adjacent weights
        per instruction: one prmt puts byte M of both words of a k pair (the plane layout's
        register pair) in bytes 0 and 2, one lop3 per plane makes the bf16 pair 128 + n (the
        odd plane after a shift), an exact bf16x2 fma subtracts 136, one more multiplies by
        the scale pair s2 (one rounding: the same values as `_plane`)."""
        ASM: gl.constexpr = _pair_asm(M)
        return gl.inline_asm_elementwise(ASM, "=r,=r,r,r,r", [p, s2],
                                         dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                         pack=2)  # fmt: skip
