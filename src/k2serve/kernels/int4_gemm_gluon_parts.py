"""Parts of the Gluon grouped GEMM (int4_gemm_gluon.py): the INT4 nibble-plane dequant in the
wgmma's register-operand layout (one plane at a time in fp32 math, `_plane`, or two k-adjacent
weights an instruction in bf16x2 PTX, `_plane_pair_bf16x2`; the scale broadcast over a plane's
columns, `_split_cols` / `_to_plane`: layout conversions that move no data), a sub-step's
dequant and wgmmas (`_plane_mma`, the K loop body of int4_gemm_gluon.py and of its
warp-specialized variant int4_gemm_gluon_ws.py), a sub-step's copies (`_issue`), a tile's
weight rows (`_rows`) and the SILU store (`_silu_epilogue`).

Invariants: imports without Triton or Gluon (then defines nothing); Triton 3.6's Gluon API.
"""

from __future__ import annotations

from ._gluon import HAS_GLUON, async_copy, gl, gluon, triton, warpgroup_mma, warpgroup_mma_wait

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

    @gluon.jit
    def _plane_mma(u, acc, w_p0, w_p1, s_smem, s_slot, w_smem, w_slot, a_smem, slot,
                   R0: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, W2: gl.constexpr,
                   BF16X2: gl.constexpr, INFLIGHT: gl.constexpr, dl: gl.constexpr,
                   l3: gl.constexpr, sl: gl.constexpr):  # fmt: skip
        """A sub-step's MMAs, the K loop body of int4_gemm_gluon.py's kernel and of each WS
        consumer (int4_gemm_gluon_ws.py): load the scale words [BN, W2 / 4] of ring slot s_slot
        (parity u % 2's halves) and the words [BN, W2] of slot w_slot, then per plane pair
        dequantize (dl: the wgmma's register-operand layout; l3, sl: `_split_cols`'s) and issue
        its wgmmas against the 8 activation planes [8 * BM, W2] of slot `slot`, waiting as
        INFLIGHT says. R0: the first of the slots' rows to read (a WS warpgroup's BN rows), None:
        all of them (BN = the tile's). w_p0, w_p1: the in-flight planes, alive through the waits'
        deps. Returns (acc, w_p0, w_p1).
        The words' view is made where each kernel made it before this helper existed (R0 None:
        before the scales are loaded; else right before the words' load): the same IR order,
        so ptxas schedules both kernels exactly as before (benchmarks/gluon_compile.py --sass)."""
        if R0 is None:
            w_tile = w_smem.index(w_slot)
            sp = s_smem.index(s_slot).load(sl)
        else:
            sp = s_smem.index(s_slot).slice(R0, BN).load(sl)
        sb = gl.where((u % 2) == 0, sp << 16, sp & -65536).to(gl.float32, bitcast=True)
        s = _to_plane(sb, l3, dl, BN, W2)
        if BF16X2:
            s2 = s.to(gl.bfloat16)  # exact: the scales are bf16
        else:
            c15 = _to_plane(sb * -32776.0, l3, dl, BN, W2)  # -(2^15 + 8) * s
            c11 = _to_plane(sb * -2056.0, l3, dl, BN, W2)  # -(2^11 + 8) * s
        if R0 is not None:
            w_tile = w_smem.index(w_slot).slice(R0, BN)
        p = w_tile.load(dl)
        a_slot = a_smem.index(slot)
        for M in gl.static_range(4):  # planes 2M (low nibble of byte M) and 2M + 1
            if BF16X2:
                w0, w1 = _plane_pair_bf16x2(p, s2, M)
            else:
                w0 = _plane(p, s, c15, 2 * M)
                w1 = _plane(p, s, c11, 2 * M + 1)
            b0 = a_slot.slice(2 * M * BM, BM).permute((1, 0))  # [W2, BM]
            b1 = a_slot.slice((2 * M + 1) * BM, BM).permute((1, 0))
            if INFLIGHT == 1:
                # retire the previous plane's MMA; this one's registers live to the next wait
                acc = warpgroup_mma(w0, b0, acc, is_async=True)
                acc, w_p1, w0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w_p1, w0))
                acc = warpgroup_mma(w1, b1, acc, is_async=True)
                acc, w0, w1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w0, w1))
                w_p1 = w1
            else:
                # both planes' MMAs in flight while the next pair is dequantized
                acc = warpgroup_mma(w0, b0, acc, is_async=True)
                acc = warpgroup_mma(w1, b1, acc, is_async=True)
                acc, w_p0, w_p1, w0, w1 = warpgroup_mma_wait(
                    num_outstanding=2, deps=(acc, w_p0, w_p1, w0, w1))  # fmt: skip
                w_p0 = w0
                w_p1 = w1
        return acc, w_p0, w_p1

    @gluon.jit
    def _rows(r, pid_n, N, BLOCK_N: gl.constexpr, SILU: gl.constexpr):
        """Weight rows of tile pid_n's local rows r, and which exist. SILU: the first half of
        the tile is gate rows, the second the same up rows (N / 2 on), so the epilogue holds
        both halves of its BLOCK_N / 2 outputs."""
        if SILU:
            HN: gl.constexpr = BLOCK_N // 2
            j = pid_n * HN + r % HN
            return j + (r // HN) * (N // 2), j < N // 2
        else:
            n = pid_n * BLOCK_N + r
            return n, n < N

    @gluon.jit
    def _issue(u, NU, a_ptrs, a_ok, w_ptrs, w_ok, s_ptrs, s_ok, a_smem, w_smem, s_smem,
               STAGES: gl.constexpr, W2: gl.constexpr, L1: gl.constexpr,
               KW: gl.constexpr):  # fmt: skip
        """cp.async sub-step u (parity u % 2 of K step u // 2) into ring slot u % STAGES, one
        commit group (KW: the words and scales go to the K step's word slot, `_tile`). Past
        the last sub-step the last one is loaded again (into a slot nobody reads): the masks
        stay loop-invariant and the group count uniform."""
        slot = u % STAGES
        u = gl.minimum(u, NU - 1)
        ks = u // 2
        par = u % 2
        async_copy.async_copy_global_to_shared(a_smem.index(slot), a_ptrs + u * (8 * W2), mask=a_ok)
        if KW:  # a K step's words (both parities: whole sectors) and scales with its even half
            WS: gl.constexpr = (STAGES + 2) // 2
            if par == 0:  # (the reloads past the end are odd: no word slot is touched)
                ws = ks % WS
                async_copy.async_copy_global_to_shared(w_smem.index(ws), w_ptrs + ks * 2 * W2,
                                                       mask=w_ok)  # fmt: skip
                if KW == 1:
                    async_copy.async_copy_global_to_shared(s_smem.index(ws),
                                                           s_ptrs + ks * (W2 // 4),
                                                           mask=s_ok)  # fmt: skip
            if KW == 2:  # the scales of K steps ks, ks + 1 (a whole sector a row) with ks's
                if u % 4 == 0:
                    async_copy.async_copy_global_to_shared(s_smem.index((ks // 2) % 2),
                                                           s_ptrs + ks * (W2 // 4),
                                                           mask=s_ok)  # fmt: skip
        elif L1:  # through L1 (cp.async.ca): the other parity's half sectors hit there
            async_copy.async_copy_global_to_shared(w_smem.index(slot),
                                                   w_ptrs + (ks * 2 * W2 + par * 4), mask=w_ok,
                                                   cache_modifier=".ca")  # fmt: skip
            async_copy.async_copy_global_to_shared(s_smem.index(slot), s_ptrs + ks * (W2 // 4),
                                                   mask=s_ok, cache_modifier=".ca")  # fmt: skip
        else:
            async_copy.async_copy_global_to_shared(w_smem.index(slot),
                                                   w_ptrs + (ks * 2 * W2 + par * 4),
                                                   mask=w_ok)  # fmt: skip
            async_copy.async_copy_global_to_shared(s_smem.index(slot), s_ptrs + ks * (W2 // 4),
                                                   mask=s_ok)  # fmt: skip
        async_copy.commit_group()

    @gluon.jit
    def _out_cols(offs, W2: gl.constexpr):
        """Output column n -> its place in gemm order for W2 (int4_gemm.to_gemm_order); W2 = 0:
        natural order (the FP8 GEMM)."""
        if W2 == 0:
            return offs
        r = offs % (16 * W2)
        return offs - r + ((r // 32) % 2) * 8 * W2 + (r % 8) * W2 + (r // 64) * 4 + (r // 8) % 4

    @gluon.jit
    def _store_epilogue(acc, c_ptr, tw_ptr, sorted_ptr, row0, pid_n, N, num_pairs, c_stride,
                        MUL_W: gl.constexpr, W2: gl.constexpr, BM: gl.constexpr,
                        BLOCK_N: gl.constexpr, NW: gl.constexpr):  # fmt: skip
        """The plain store: acc [BLOCK_N, BM] in an n-contiguous layout, (times the pairs'
        routing weights tw, MUL_W), to c[pair, n] at the pairs' rows (columns `_out_cols`)."""
        TN: gl.constexpr = min(32, BLOCK_N // 8)
        lo: gl.constexpr = gl.BlockedLayout([8, 1], [TN, 32 // TN], [1, NW], [0, 1])
        out = gl.convert_layout(acc, lo)
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lo))
        pair = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, lo)))
        pair_ok = pair < num_pairs
        if MUL_W:
            out = out * gl.expand_dims(gl.load(tw_ptr + pair, mask=pair_ok, other=0.0), 0)
        cols = _out_cols(offs_n, W2)
        c_ptrs = (c_ptr + gl.expand_dims(pair.to(gl.int64) * c_stride, 0)
                  + gl.expand_dims(cols, 1))  # fmt: skip
        ok = gl.expand_dims(pair_ok, 0) & gl.expand_dims(offs_n < N, 1)
        gl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=ok)

    @gluon.jit
    def _silu_epilogue(acc, c_ptr, sorted_ptr, row0, pid_n, N, num_pairs, c_stride,
                       BM: gl.constexpr, BLOCK_N: gl.constexpr, W2: gl.constexpr,
                       NW: gl.constexpr, F32ACT: gl.constexpr):  # fmt: skip
        """SILU's store: acc [BLOCK_N, BM] = gate rows then the same up rows -> c[pair, j] =
        silu(gate) * up for the tile's BLOCK_N / 2 outputs j in gemm order (W2 = 0: natural
        order), rounded as the torch path does (each GEMM output to bf16, silu in fp32 to
        bf16, the product); F32ACT: in fp32 from the accumulators, one rounding (fp8_moe's
        epilogue: the FP8 GEMM's reference)."""
        HN: gl.constexpr = BLOCK_N // 2
        TN: gl.constexpr = min(32, HN // 8)
        lo3: gl.constexpr = gl.BlockedLayout([8, 1, 2], [TN, 32 // TN, 1], [1, NW, 1], [2, 0, 1])
        x3 = gl.convert_layout(gl.permute(gl.reshape(acc, [2, HN, BM]), (1, 2, 0)), lo3)
        g, up = gl.split(x3)  # [HN, BM] each
        if F32ACT:
            out = (g / (1.0 + gl.exp(-g)) * up).to(c_ptr.dtype.element_ty)
        else:
            g = g.to(gl.bfloat16).to(gl.float32)
            up = up.to(gl.bfloat16).to(gl.float32)
            sg = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
            out = (sg * up).to(c_ptr.dtype.element_ty)
        lo: gl.constexpr = gl.SliceLayout(2, lo3)
        offs_j = pid_n * HN + gl.arange(0, HN, layout=gl.SliceLayout(1, lo))
        pair = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, lo)))
        cols = _out_cols(offs_j, W2)
        c_ptrs = (c_ptr + gl.expand_dims(pair.to(gl.int64) * c_stride, 0)
                  + gl.expand_dims(cols, 1))  # fmt: skip
        ok = gl.expand_dims(pair < num_pairs, 0) & gl.expand_dims(offs_j < N // 2, 1)
        gl.store(c_ptrs, out, mask=ok)
