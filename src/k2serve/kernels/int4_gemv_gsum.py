"""Grouped INT4 decode GEMV that sums a whole quantization group in f16x2 ("GSUM").

Owns: `_int4_gemv_gsum_kernel` and its launcher `launch_gsum`, the `GSUM: 1` variant of the
grouped decode GEMV (`int4_gemv.int4_moe_decode_grouped` picks it by that config key; the
shipped `_int4_gemv_h2_grouped_kernel` stays the default).

Why: the grouped kernel converts every word's 8-product f16 sum to fp32 (2 cvt + 1 add) and
scales and sums the words of a group in fp32: about 9 instructions per word per row beside the
4 HFMA2. Here the 32 products of a group (4 words x 4 f16x2 FMAs) run as one chain of 16 HFMA2
in one f16x2 accumulator, then one add of its halves, one conversion and one fp32 FMA with the
group scale: 19 instructions per 32 weights per row (0.59 a weight) instead of ~36 (1.1).

Arithmetic bound: the activations are packed by `pack_h2` with top=6: each row scaled by a power
of two so that its largest magnitude lies in [64, 128); then |sum| <= 32 * 8 * 128 = 32768 <
65504 for any weights (|n - 8| <= 8), and each half's partial sums (16 products) stay below
16384. The fp16 rounding is relative, so the smaller range costs no precision (values below
2^-14 of the row maximum go subnormal).

Tile: a program per (aligned block of BLOCK_M <= 8 rows of one expert, BLOCK_N output rows)
loads [BLOCK_N, W] words as [BLOCK_N, W/4, 4] (one 16-byte load per group per weight row),
dequantizes them once (`_dq_h2`) and splits the 4 words of each group into 4 tensors
[BLOCK_N, W/4] (`_split4`, register renames), so that each group's chain is one inline-PTX
block per row (`_gdot`). Without inline PTX (interpreter, ROCm, int4_asm off) the same chain
runs in plain Triton in fp16 (`_gdot` plain path: the overflow bound is the same).

Invariants: W % 4 == 0, group size 32 (4 words); no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

from ._triton import HAS_TRITON, cdiv, tl, triton

# f16x2 chain over the 16 (weight, activation) register pairs of one group ($1..$16 the
# dequantized weights, $17..$32 the activations), halves added in fp16, one conversion.
if HAS_TRITON:
    _GDOT_ASM = tl.constexpr(
        "{\n.reg .b32 acc;\n.reg .f16 lo, hi;\nmul.f16x2 acc, $1, $17;\n"
        + "".join(f"fma.rn.f16x2 acc, ${i}, ${i + 16}, acc;\n" for i in range(2, 17))
        + "mov.b32 {lo, hi}, acc;\nadd.rn.f16 lo, lo, hi;\ncvt.f32.f16 $0, lo;\n}"
    )
    # CHAINS 4: one 4-deep chain per word (operands q[j][i] = $(1 + 4j + i)), the 4 added in
    # f16x2 (3 more instructions a group and row, a quarter of the dependency depth)
    _GDOT4_ASM = tl.constexpr(
        "{\n.reg .b32 c0, c1, c2, c3;\n.reg .f16 lo, hi;\n"
        + "".join(f"mul.f16x2 c{i}, ${1 + i}, ${17 + i};\n" for i in range(4))
        + "".join(
            f"fma.rn.f16x2 c{i}, ${1 + 4 * j + i}, ${17 + 4 * j + i}, c{i};\n"
            for j in range(1, 4)
            for i in range(4)
        )  # fmt: skip
        + "add.rn.f16x2 c0, c0, c1;\nadd.rn.f16x2 c2, c2, c3;\nadd.rn.f16x2 c0, c0, c2;\n"
        + "mov.b32 {lo, hi}, c0;\nadd.rn.f16 lo, lo, hi;\ncvt.f32.f16 $0, lo;\n}"
    )
    from .int4_gemv_parts import _dq_h2, _g_block, _g_out

    @triton.jit
    def _split4(t):
        """[BN, G, 4] -> its 4 slices [BN, G] along the last axis (in-thread: no data moves)."""
        BN: tl.constexpr = t.shape[0]
        G: tl.constexpr = t.shape[1]
        lo, hi = tl.split(tl.reshape(t, [BN, G, 2, 2]))  # word i = 2 i1 + i2: lo i2 = 0
        t0, t2 = tl.split(lo)
        t1, t3 = tl.split(hi)
        return t0, t1, t2, t3

    @triton.jit
    def _dq_tile(p, USE_ASM: tl.constexpr):
        """Words [BN, G, 4] -> q[j][i] [BN, G]: plane j (nibbles j, j+4) of word i of each
        group, f16x2 (n - 8) with USE_ASM, else raw nibble pairs (`_dq_h2`)."""
        q0, q1, q2, q3 = _dq_h2(p, USE_ASM)
        return _split4(q0), _split4(q1), _split4(q2), _split4(q3)

    @triton.jit
    def _gdot(q, a, USE_ASM: tl.constexpr, CHAINS: tl.constexpr):
        """Group sums [BN, G] float32: sum over planes j and words i of q[j][i] . a[j][i],
        accumulated in f16x2 (the bound in the module docstring)."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                asm=_GDOT4_ASM if CHAINS == 4 else _GDOT_ASM,
                constraints="=r" + ",r" * 32,
                args=[
                    q[0][0], q[0][1], q[0][2], q[0][3], q[1][0], q[1][1], q[1][2], q[1][3],
                    q[2][0], q[2][1], q[2][2], q[2][3], q[3][0], q[3][1], q[3][2], q[3][3],
                    a[0][0], a[0][1], a[0][2], a[0][3], a[1][0], a[1][1], a[1][2], a[1][3],
                    a[2][0], a[2][1], a[2][2], a[2][3], a[3][0], a[3][1], a[3][2], a[3][3],
                ],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )  # fmt: skip
        else:  # the same chain in fp16, from raw nibble pairs
            lo = tl.zeros(q[0][0].shape, tl.float16)
            hi = tl.zeros(q[0][0].shape, tl.float16)
            for j in tl.static_range(4):
                for i in tl.static_range(4):
                    qq = q[j][i]
                    aa = a[j][i]
                    x_lo = (aa & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
                    x_hi = ((aa >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
                    lo = lo + ((qq & 0xF) - 8).to(tl.float16) * x_lo
                    hi = hi + ((qq >> 16) - 8).to(tl.float16) * x_hi
            return (lo + hi).to(tl.float32)

    @triton.jit
    def _a_plane(ab, s, KT: tl.constexpr):
        """One activation plane [G, 4] (ab) broadcast to the tile ([BN, G, 4], KT [G, BN, 4],
        the shape of the scales s with 4 appended) and split like the words."""
        if KT:
            return _split4(tl.broadcast_to(tl.load(ab)[:, None, :], [s.shape[0], s.shape[1], 4]))
        else:
            return _split4(tl.broadcast_to(tl.load(ab)[None, :, :], [s.shape[0], s.shape[1], 4]))

    @triton.jit
    def _gs_row(acc, acc_u, a_row_ptr, ok, q, g, s, su, a_off, W: tl.constexpr,
                GATED: tl.constexpr, USE_ASM: tl.constexpr, SKIP: tl.constexpr,
                CHAINS: tl.constexpr, KT: tl.constexpr):  # fmt: skip
        """One row of the block: its 4 activation planes of this K-block as [BN, G] per word
        of the group, then (SKIP: only for a real row) acc += group sum * group scale."""
        ab = a_row_ptr + a_off
        a0 = _a_plane(ab, s, KT)
        a1 = _a_plane(ab + W, s, KT)
        a2 = _a_plane(ab + 2 * W, s, KT)
        a3 = _a_plane(ab + 3 * W, s, KT)
        a = (a0, a1, a2, a3)
        if SKIP:
            if ok:
                acc, acc_u = _gs_acc(acc, acc_u, q, g, a, s, su, GATED, USE_ASM, CHAINS)
        else:
            acc, acc_u = _gs_acc(acc, acc_u, q, g, a, s, su, GATED, USE_ASM, CHAINS)
        return acc, acc_u

    @triton.jit
    def _gs_acc(acc, acc_u, q, g, a, s, su, GATED: tl.constexpr, USE_ASM: tl.constexpr,
                CHAINS: tl.constexpr):  # fmt: skip
        """acc += group sums * group scales (gate; GATED: and up)."""
        acc = acc + _gdot(q, a, USE_ASM, CHAINS) * s
        if GATED:
            acc_u = acc_u + _gdot(g, a, USE_ASM, CHAINS) * su
        return acc, acc_u

    @triton.jit
    def _gs_out(acc, acc_u, KT: tl.constexpr, pair, ok, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n,
                n_ok, A_DIV: tl.constexpr, GATED: tl.constexpr):  # fmt: skip
        """`_g_out` of one row, the KT accumulators [G, BN] transposed first."""
        if KT:
            acc = tl.trans(acc)
            acc_u = tl.trans(acc_u)
        _g_out(acc, acc_u, pair, ok, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)

    @triton.jit
    def _gs_load(w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n, W: tl.constexpr,
                 EVEN_N: tl.constexpr, CG: tl.constexpr, KT: tl.constexpr):  # fmt: skip
        """K-block kb: words [BN, W/4, 4] (raw) and the group scales [BN, W/4] float32 in the
        layout of the split words (`_dq_tile`). EVEN_N: N % BN == 0, no row
        mask (no zeroing of the load registers). Triton 3.6 lays the words out with the lanes
        along N, 2 along K (each row's 32 bytes one sector); loaded as [BN, W] and reshaped
        (lanes along K) the scales and activations then need layout conversions (measured:
        benchmarks/gemv_sass.py, +0.25 instructions a weight)."""
        G: tl.constexpr = W // 4
        offs_g = kb * W + tl.arange(0, G)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [G, 4]
        if KT:  # the tile as [G, BN, 4]: Triton then puts the lanes along K
            pp = w_base + offs_n[None, :, None] * w_stride_n + offs_g[:, None, :]
            pm = n_ok[None, :, None]
        else:
            pp = w_base + offs_n[:, None, None] * w_stride_n + offs_g[None, :, :]
            pm = n_ok[:, None, None]
        if CG and EVEN_N:  # ld.global.cg: streamed once, no L1 lines allocated
            p = tl.load(pp, cache_modifier=".cg")
        elif CG:
            p = tl.load(pp, mask=pm, other=0, cache_modifier=".cg")
        elif EVEN_N:
            p = tl.load(pp)
        else:
            p = tl.load(pp, mask=pm, other=0)
        # scales [BN, G]: the column step `one` (1, unknown to Triton's axis analysis) makes the
        # load one scale per thread and group, in the split words' layout: with a contiguous
        # step the coalescing pass picks a vector layout and converts it through shared memory
        # (STS, LDS, 2 BAR.SYNC per K step)
        one = s_stride_n // s_stride_n
        offs_s = kb * G + tl.arange(0, G) * one
        if KT:
            sp = s_base + offs_n[None, :] * s_stride_n + offs_s[:, None]
            sm = n_ok[None, :]
        else:
            sp = s_base + offs_n[:, None] * s_stride_n + offs_s[None, :]
            sm = n_ok[:, None]
        if EVEN_N:
            s = tl.load(sp)
        else:
            s = tl.load(sp, mask=sm, other=0.0)
        return p, s.to(tl.float32)

    @triton.jit
    def _int4_gemv_gsum_kernel(
        a_ptr, rs_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, W: tl.constexpr, USE_ASM: tl.constexpr, SKIP: tl.constexpr,
        EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, CHAINS: tl.constexpr, CG: tl.constexpr,
        KT: tl.constexpr,
    ):  # fmt: skip
        """As `_int4_gemv_h2_grouped_kernel` (same grid, rows, epilogue `_g_out`), with each
        group's 32 products per row summed in f16x2 (`_gdot`); activations from
        `pack_h2(x, W, top=6)`."""
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
        G: tl.constexpr = W // 4
        if KT:
            z = tl.zeros([G, BLOCK_N], tl.float32)
        else:
            z = tl.zeros([BLOCK_N, G], tl.float32)
        c0, c1, c2, c3, c4, c5, c6, c7 = z, z, z, z, z, z, z, z
        u0, u1, u2, u3, u4, u5, u6, u7 = z, z, z, z, z, z, z, z
        a_g = tl.arange(0, G)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [G, 4]
        nk = K // (8 * W)
        p, s = _gs_load(w_base, s_base, offs_n, n_ok, 0, w_stride_n, s_stride_n, W, EVEN_N, CG, KT)
        pu, su = p, s
        if GATED:  # (without PREFETCH these first loads are dead code)
            pu, su = _gs_load(w_base, s_base, offs_n + N, n_ok, 0, w_stride_n, s_stride_n, W,
                              EVEN_N, CG, KT)  # fmt: skip
        for kb in range(0, nk):
            if PREFETCH:  # the next K-block's loads in flight during this one's products
                pc, sc, puc, suc = p, s, pu, su
                kn = tl.minimum(kb + 1, nk - 1)
                p, s = _gs_load(w_base, s_base, offs_n, n_ok, kn, w_stride_n, s_stride_n, W,
                                EVEN_N, CG, KT)  # fmt: skip
                if GATED:
                    pu, su = _gs_load(w_base, s_base, offs_n + N, n_ok, kn, w_stride_n,
                                      s_stride_n, W, EVEN_N, CG, KT)  # fmt: skip
            else:
                pc, sc = _gs_load(w_base, s_base, offs_n, n_ok, kb, w_stride_n, s_stride_n, W,
                                  EVEN_N, CG, KT)  # fmt: skip
                puc, suc = pc, sc
                if GATED:
                    puc, suc = _gs_load(w_base, s_base, offs_n + N, n_ok, kb, w_stride_n,
                                        s_stride_n, W, EVEN_N, CG, KT)  # fmt: skip
            q = _dq_tile(pc, USE_ASM)
            g = q
            if GATED:
                g = _dq_tile(puc, USE_ASM)
            a_off = kb * 4 * W + a_g
            c0, u0 = _gs_row(
                c0, u0, ar0, ok0, q, g, sc, suc, a_off, W, GATED, USE_ASM, False, CHAINS, KT
            )
            if BLOCK_M > 1:
                c1, u1 = _gs_row(
                    c1, u1, ar1, ok1, q, g, sc, suc, a_off, W, GATED, USE_ASM, SKIP, CHAINS, KT
                )
            if BLOCK_M > 2:
                c2, u2 = _gs_row(
                    c2, u2, ar2, ok2, q, g, sc, suc, a_off, W, GATED, USE_ASM, SKIP, CHAINS, KT
                )
                c3, u3 = _gs_row(
                    c3, u3, ar3, ok3, q, g, sc, suc, a_off, W, GATED, USE_ASM, SKIP, CHAINS, KT
                )
            if BLOCK_M > 4:
                c4, u4 = _gs_row(
                    c4, u4, ar4, ok4, q, g, sc, suc, a_off, W, GATED, USE_ASM, SKIP, CHAINS, KT
                )
                c5, u5 = _gs_row(
                    c5, u5, ar5, ok5, q, g, sc, suc, a_off, W, GATED, USE_ASM, SKIP, CHAINS, KT
                )
                c6, u6 = _gs_row(
                    c6, u6, ar6, ok6, q, g, sc, suc, a_off, W, GATED, USE_ASM, SKIP, CHAINS, KT
                )
                c7, u7 = _gs_row(
                    c7, u7, ar7, ok7, q, g, sc, suc, a_off, W, GATED, USE_ASM, SKIP, CHAINS, KT
                )
        _gs_out(c0, u0, KT, p0, ok0, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED)
        if BLOCK_M > 1:
            _gs_out(
                c1, u1, KT, p1, ok1, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED
            )
        if BLOCK_M > 2:
            _gs_out(
                c2, u2, KT, p2, ok2, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED
            )
            _gs_out(
                c3, u3, KT, p3, ok3, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED
            )
        if BLOCK_M > 4:
            _gs_out(
                c4, u4, KT, p4, ok4, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED
            )
            _gs_out(
                c5, u5, KT, p5, ok5, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED
            )
            _gs_out(
                c6, u6, KT, p6, ok6, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED
            )
            _gs_out(
                c7, u7, KT, p7, ok7, c_ptr, c_stride, rs_ptr, tw_ptr, offs_n, n_ok, A_DIV, GATED
            )


def _hip() -> bool:
    import torch

    return torch.version.hip is not None


# the activations' range for the f16 group chain: max |x| in [2^TOP, 2^(TOP+1)) (module doc)
GSUM_TOP = 6


def launch_gsum(a, rs, w, s, c, tw, sorted_ids, expert_ids, npost, N, K, num_pairs, a_div,
                gated, cfg, group, asm):  # fmt: skip
    """One launch of `_int4_gemv_gsum_kernel` (arguments as int4_gemv._launch_grouped; a, rs
    from pack_h2(x, cfg["W"], top=GSUM_TOP))."""
    from .int4_dequant import use_asm

    if group != 32 or cfg["W"] % 4:
        raise ValueError(f"GSUM grouped GEMV: group size 32 and W % 4 == 0 (got {group}, "
                         f"W={cfg['W']})")  # fmt: skip
    grid = (expert_ids.numel() * cdiv(N, cfg["BLOCK_N"]),)
    # maxnreg: a register cap (the CUDA backend's option; HIP has none)
    extra = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not _hip() else {}
    _int4_gemv_gsum_kernel[grid](
        a, rs, w, s, c, tw, sorted_ids, expert_ids, npost, N, K, num_pairs, a.stride(0),
        c.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), A_DIV=a_div,
        GATED=gated, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], W=cfg["W"],
        USE_ASM=use_asm(asm), SKIP=cfg.get("SKIP", 1), EVEN_N=N % cfg["BLOCK_N"] == 0,
        PREFETCH=cfg.get("PREFETCH", 0), CHAINS=cfg.get("CHAINS", 1),
        CG=cfg.get("CG", 0), KT=cfg.get("KT", 0),
        num_warps=cfg["num_warps"], **extra,
    )  # fmt: skip
