# ruff: noqa: E741
"""FP8-block (128x128) grouped MoE GEMM written in Gluon for Hopper, for prompts (many pairs per
expert): the fp8 weights converted to bf16 in the wgmma's register operand, the conversion of
one sub-step overlapping the previous sub-step's MMA.

Owns: `fp8_moe_gluon` (the routed-expert output, the contract and outputs of
fp8_moe.fp8_moe: gate_up launch with the SiLU-and-mul epilogue, down launch with the routing
weights, the weighted top-k sum), `gemm_fp8_gluon` (one launch), its configs (`CONFIG_KEYS`,
`FP8_GLUON_TABLE` by pair count, `check_config`, `smem_bytes`, `pick`), `supported`; config
WS runs the warp-specialized variant (fp8_gemm_gluon_ws.py). Whether
it can run is int4_gemm_gluon's `gluon_usable` (Triton 3.6's Gluon on sm_90); the rows, the
SILU and plain stores are int4_gemm_gluon's / int4_gemm_gluon_parts.py's.

Why: kernels/fp8_moe.py (plain Triton) scales the fp32 partial product after every K step
with Triton's own waits (each register-operand wgmma retired before the next tile is
converted) and cannot scale the tile in registers (its docstring); 30% of the bf16 rate at
8K tokens. Here the waits are ours, as in the INT4 Gluon kernel.

Layout: as the INT4 Gluon kernel: the weights are the MMA's left operand (rows = BLOCK_N
outputs, `DotOperandLayout` of an `NVMMADistributedLayout` v3), the tokens its N (BLOCK_M
aligned pairs of one expert, moe_align_block_size's rows). A sub-step is KS columns: the fp8
weight tile [BLOCK_N, KS] cp.async'ed as stored (1 byte a weight) and the activation tile
[BLOCK_M, KS] bf16 (K-major `NVMMASharedLayout`, the wgmma's B through a transposed view),
one commit group each, in a ring of STAGES slots loaded STAGES - 2 ahead (the slot refilled at
sub-step u was read at u - 2, whose MMA every warpgroup has retired). The weight tile is
loaded from shared memory in the operand layout (as int16 k pairs, `_pair_layout`) and
converted to bf16 there by bit ops (`_CVT_ASM`: fp8 e4m3 is exact in bf16; Triton's own
conversion to bf16 goes through F2F, a quarter-rate pipe); CVT32: Triton's conversion through
f16 pairs (F2FP) and fp32 (HADD2.F32) instead, fewer instructions and 4-11% faster on the H100
(benchmarks/RESULTS.md): the shipped configs' (the asm stays for the bf16-scaled mode). The
128x128 block scale (w_scale fp32 [E, cdiv(N, 128), cdiv(K, 128)]): PROMOTE (DeepGEMM-style):
each 128-column K block's MMAs accumulate into an fp32 partial (zero-initialised by the block's
first MMA), which is added to the accumulator times the scales of its rows (a [BLOCK_N]
vector: a tile may span two 128-row blocks, and SILU tiles take gate and up rows) when the next
block's first tile is converted: fp8_moe's numerics (exact bf16 products, fp32 sums, the scale
in fp32, silu(gate) * up in fp32); twice the accumulator registers. Otherwise the scale
multiplies the converted weights in registers (bf16 math: s rounded to bf16; CVT32: fp32
math, one rounding to bf16) and one accumulator holds every K block: larger tiles, 1.8x
fp8_moe's error against the fp32 reference on the H100 (not shipped).

Invariants: Hopper (sm_90) only, Triton 3.6's Gluon API; imports without Triton, Gluon or
CUDA. K % 128 == 0 (whole scale blocks; KS divides 128), any N (partial tiles masked); SILU
(the gate_up launch) needs N / 2 % (BLOCK_N / 2) == 0 or masked halves, and gate / up scale
rows cdiv(N / 2, 128) apart; BLOCK_N % (16 * num_warps) == 0, BLOCK_M in 8..256, a multiple of
8. No host sync; CUDA-graph safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._gluon import HAS_GLUON, async_copy, gl, gluon, triton, warpgroup_mma, warpgroup_mma_wait
from ._triton import cdiv
from .fp8_gemm_gluon_ws import FP8_WS_DEFAULTS, fp8_ws_check, launch_fp8_ws
from .fp8_moe import check_inputs
from .int4_gemm_gluon import gluon_align, gluon_available
from .policy import band_index, check_open_table

# BLOCK_M pairs x BLOCK_N outputs, KS columns a sub-step, STAGES ring slots, warps (4 per 64
# weight rows); PROMOTE: the block scale on an fp32 partial per 128-column K block (else on the
# weights in registers, bf16 math); CVT32: Triton's fp8 -> fp32 conversion (fp32 scale math),
# not the bit-op asm; SILU: the gate_up tiles take gate and up rows in halves and store
# silu(gate) * up; TAIL: an expert's last <= BLOCK_M / 2 pairs in a BLOCK_M / 2 tile (the INT4
# Gluon kernel's: at 8K tokens x top-8 an expert has ~171 pairs, 2/3 of two 128-row tiles).
# WS (1, 2), PW, RELEASE, FENCE: the warp-specialized kernel (fp8_gemm_gluon_ws.py).
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "KS", "STAGES", "num_warps", "PROMOTE", "CVT32", "SILU",
               "TAIL", "WS", "PW", "RELEASE", "FENCE")  # fmt: skip
CONFIG_DEFAULTS = dict(KS=64, PROMOTE=True, CVT32=False, SILU=True, TAIL=False,
                       **FP8_WS_DEFAULTS)  # fmt: skip
# The kernel's own default table, the shipped one's (configs/<kind>.json "fp8_prefill_gluon",
# measured there; the engine takes its configs from the kernel tables): exact weights (PROMOTE)
# converted by Triton's path (CVT32); 32-, 64-, then 128-token blocks. Since wave 13 every entry
# is the warp-specialized kernel (wave 11, from 16385 pairs only) with 128-column sub-steps:
# 1.2-1.3x the plain kernel's 32x128 / 64x128 KS=64 entries at T=256-2048 uniform, 1.05-1.18x
# the KS=64 / 6-stage WS entry at T=4096-16384 (benchmarks/prefill_split.py, H100).
FP8_GLUON_TABLE: tuple[Mapping[str, Any], ...] = (
    dict(max_pairs=4096, BLOCK_M=32, BLOCK_N=128, KS=128, STAGES=4, num_warps=8, PROMOTE=True,
         CVT32=True, WS=2, RELEASE=2),
    dict(max_pairs=16384, BLOCK_M=64, BLOCK_N=128, KS=128, STAGES=4, num_warps=8, PROMOTE=True,
         CVT32=True, WS=2, RELEASE=2),
    dict(max_pairs=None, BLOCK_M=128, BLOCK_N=128, KS=128, STAGES=4, num_warps=8, PROMOTE=True,
         CVT32=True, WS=2, RELEASE=2),
)  # fmt: skip


def smem_bytes(cfg: Mapping[str, Any]) -> int:
    """Shared memory of the ring: activations [BLOCK_M, KS] bf16 + weights [BLOCK_N, KS] fp8
    a slot."""
    return cfg["STAGES"] * cfg["KS"] * (2 * cfg["BLOCK_M"] + cfg["BLOCK_N"])


def check_config(cfg: Mapping[str, Any]) -> None:
    """Raise ValueError for a config the kernel cannot take."""
    bm, bn, nw = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]
    if cfg.get("WS"):
        return fp8_ws_check({**CONFIG_DEFAULTS, **cfg})
    if bm % 8 or not 8 <= bm <= 256:
        raise ValueError(f"gluon fp8 GEMM: BLOCK_M={bm} must be a multiple of 8 in 8..256")
    if nw % 4 or bn % (16 * nw) or bn > 256:
        raise ValueError(f"gluon fp8 GEMM: BLOCK_N={bn} must be a multiple of 16 * num_warps "
                         f"({nw}, a multiple of 4), at most 256")  # fmt: skip
    if cfg.get("TAIL") and bm % 16:
        raise ValueError(f"gluon fp8 GEMM: TAIL needs BLOCK_M={bm} a multiple of 16")
    # KS=128 compiles, but gave NaN outputs on the H100 (wave 9: BLOCK_M 64, BLOCK_N 256, 3
    # stages, exact weights, in tests/kernels/test_fp8_gemm_gluon.py's odd shapes); refused
    # until that is understood (no shipped or swept config uses it)
    if cfg.get("KS", 64) not in (32, 64) or cfg["STAGES"] < 3:
        raise ValueError("gluon fp8 GEMM: KS must be 32 or 64 and STAGES >= 3")
    if smem_bytes({**CONFIG_DEFAULTS, **cfg}) > 227 * 1024:
        raise ValueError(f"gluon fp8 GEMM: {smem_bytes(cfg)} B of shared memory (> 227 KiB)")


def check_table(table: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError for a malformed table: configs by ascending max_pairs, the last null."""
    check_open_table(table, "fp8_prefill_gluon")
    for ent in table:
        try:
            check_config({**CONFIG_DEFAULTS, **{k: ent[k] for k in CONFIG_KEYS if k in ent}})
        except (KeyError, TypeError) as e:
            raise ValueError(f"fp8_prefill_gluon: malformed entry {dict(ent)!r}: {e!r}") from None


def pick(table: Sequence[Mapping[str, Any]], num_pairs: int) -> dict:
    """The first entry of `table` whose max_pairs covers num_pairs (CONFIG_KEYS only)."""
    i = band_index(table, num_pairs)
    if i is not None:
        return {k: table[i][k] for k in CONFIG_KEYS if k in table[i]}
    raise ValueError(f"fp8_prefill_gluon: no entry for {num_pairs} pairs")


def supported(ew) -> bool:
    """Whether the kernel takes these experts: FP8-block, hidden and intermediate multiples of
    128 (whole scale blocks in K)."""
    return ew.quant == "fp8" and ew.hidden % 128 == 0 and ew.intermediate % 128 == 0


if HAS_GLUON:
    from .int4_gemm_gluon_parts import _rows, _silu_epilogue, _store_epilogue

    @gluon.jit
    def _issue(u, NU, a_ptrs, a_ok, w_ptrs, w_ok, a_smem, w_smem, STAGES: gl.constexpr,
               KS: gl.constexpr):  # fmt: skip
        """cp.async sub-step u (columns u * KS..) into ring slot u % STAGES, one commit group.
        Past the last sub-step the last one is loaded again (into a slot nobody reads): the
        masks stay loop-invariant and the group count uniform."""
        slot = u % STAGES
        u = gl.minimum(u, NU - 1)
        async_copy.async_copy_global_to_shared(a_smem.index(slot), a_ptrs + u * KS, mask=a_ok)
        async_copy.async_copy_global_to_shared(w_smem.index(slot), w_ptrs + u * KS, mask=w_ok)
        async_copy.commit_group()

    # fp8 e4m3 -> bf16 without the conversion unit (Triton's fp8 -> f16 -> bf16 is two F2F a
    # weight, a quarter-rate pipe): a byte pair b0, b1 to the bf16 pair with the sign at bit
    # 15 and exponent + mantissa at bits 4..10 (an exponent 120 too small: e4m3's bias is 7),
    # then one exact bf16x2 multiply by $3 (2^120, or 2^120 * the scale: the scaled mode's
    # one rounding); zero and subnormals come out exact. $2: bytes (g, k), (g, k + 1),
    # (g + 8, k), (g + 8, k + 1) of the operand layout (two int16 k pairs of rows g, g + 8);
    # $0, $1: their bf16 pairs; $3, $4: the factor pairs of those rows.
    _CVT_ASM = gl.constexpr(
        "{ .reg .b32 t, u, z;\n"
        "mov.b32 z, 0x80008000;\n"
        "prmt.b32 t, $2, 0, 0x1404;\n"
        "shr.u32 u, t, 4;\n"
        "and.b32 u, u, 0x07F007F0;\n"
        "lop3.b32 u, u, t, 0x80008000, 0xF8;\n"
        "fma.rn.bf16x2 $0, u, $3, z;\n"
        "prmt.b32 t, $2, 0, 0x3424;\n"
        "shr.u32 u, t, 4;\n"
        "and.b32 u, u, 0x07F007F0;\n"
        "lop3.b32 u, u, t, 0x80008000, 0xF8;\n"
        "fma.rn.bf16x2 $1, u, $4, z; }"
    )

    @triton.constexpr_function
    def _pair_layout(ll, BLOCK_N, KS):
        """The operand layout's linear layout `ll` over [BLOCK_N, KS] seen as [BLOCK_N, KS / 2]
        k pairs (int16 words of 2 fp8): the first register basis (column + 1) dropped, the
        columns halved. Loaded from the weight tile viewed as int16, a thread's pairs are the
        ones the operand layout gives it."""

        def half(b):
            return [b[0], b[1] // 2]

        assert list(ll.reg_bases[0]) == [0, 1], ll.reg_bases
        return gl.DistributedLinearLayout(
            reg_bases=[half(b) for b in ll.reg_bases[1:]],
            lane_bases=[half(b) for b in ll.lane_bases],
            warp_bases=[half(b) for b in ll.warp_bases],
            block_bases=[half(b) for b in ll.block_bases],
            shape=[BLOCK_N, KS // 2],
        )

    @gluon.jit
    def _fp8_pairs_to_bf16(w16, kf, dl: gl.constexpr, BLOCK_N: gl.constexpr,
                           KS: gl.constexpr):  # fmt: skip
        """k pairs of fp8 weights (int16 [BLOCK_N, KS / 2], `_pair_layout`) -> bf16 [BLOCK_N,
        KS] w * f in the operand layout dl; kf int32: the factor f as a bf16 pair (2^120 for
        the exact weights, 2^120 * scale for the scaled ones). The asm's int32 results are
        the operand's registers; the split into halves and the join are no-ops."""
        y = gl.inline_asm_elementwise(_CVT_ASM, "=r,=r,r,r,r", [w16, kf], dtype=gl.int32,
                                      is_pure=True, pack=2)  # fmt: skip
        lo = y.to(gl.int16).to(gl.bfloat16, bitcast=True)
        hi = (y >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        w = gl.reshape(gl.join(lo, hi), [BLOCK_N, KS])
        return gl.convert_layout(w, dl, assert_trivial=True)

    @gluon.jit
    def _scale_rows(r, pid_n, N, BLOCK_N: gl.constexpr, SILU: gl.constexpr):
        """The 128-row scale block of a tile's local rows r (SILU: the up half's blocks start
        at cdiv(N / 2, 128), as fp8_moe's up_s_row)."""
        if SILU:
            HN: gl.constexpr = BLOCK_N // 2
            j = pid_n * HN + r % HN
            return j // 128 + (r // HN) * ((N // 2 + 127) // 128)
        else:
            return (pid_n * BLOCK_N + r) // 128

    @gluon.jit
    def _tile(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, row0, e, pid_n,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: gl.constexpr, MUL_W: gl.constexpr,
        BM: gl.constexpr, BLOCK_N: gl.constexpr, KS: gl.constexpr, STAGES: gl.constexpr,
        NW: gl.constexpr, PROMOTE: gl.constexpr, CVT32: gl.constexpr, SILU: gl.constexpr,
    ):  # fmt: skip
        """One output tile: the BM aligned pairs at sorted rows row0.. (all of expert e) x the
        BLOCK_N outputs of N tile pid_n (acc[n, pair])."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                      instr_shape=[16, BM, 16])  # fmt: skip
        dl: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        # global -> shared copies, 16-byte pieces
        la: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (KS // 8), KS // 8], [NW, 1], [1, 0])
        lw: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (KS // 16), KS // 16], [NW, 1],
                                            [1, 0])  # fmt: skip
        a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * KS),
                                                  element_bitwidth=16, rank=2)  # fmt: skip
        # weights: 16-byte pieces XOR-swizzled by row pairs (KS 64; by 128 / KS rows): the
        # operand layout's 2-byte loads of a warp (8 rows x 4 lanes) hit distinct banks
        # (gl.bank_conflicts: 0 for KS 32, 64, 128; 1 with one row a phase at KS 32, 64)
        w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=128 // KS,
                                                     max_phase=KS // 16, order=[1, 0])  # fmt: skip
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, KS], a_sl)
        w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, KS], w_sl)
        # the same bytes as int16 k pairs (the same swizzle: 8 pairs = 16 bytes)
        l16: gl.constexpr = _pair_layout(gl.to_linear_layout(dl, [BLOCK_N, KS]), BLOCK_N, KS)
        w16_sl: gl.constexpr = gl.SwizzledSharedLayout(
            vec=8, per_phase=128 // KS, max_phase=KS // 16, order=[1, 0]
        )
        w_smem16 = w_smem._reinterpret(gl.int16, [STAGES, BLOCK_N, KS // 2], w16_sl)

        # activation rows of the pairs (padding pairs: not read, zeros)
        r_a = gl.arange(0, BM, layout=gl.SliceLayout(1, la))
        pair_a = gl.load(sorted_ptr + row0 + r_a)
        rows = gl.where(pair_a < num_pairs, pair_a // A_DIV, 0).to(gl.int64)
        c_a = gl.arange(0, KS, layout=gl.SliceLayout(0, la))
        a_ptrs = a_ptr + gl.expand_dims(rows * a_stride, 1) + gl.expand_dims(c_a, 0)
        a_ok = gl.expand_dims(pair_a < num_pairs, 1) & gl.expand_dims(c_a >= 0, 0)
        n_w, nok_w = _rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lw)), pid_n, N, BLOCK_N,
                           SILU)  # fmt: skip
        c_w = gl.arange(0, KS, layout=gl.SliceLayout(0, lw))
        w_ptrs = (w_ptr + e * w_stride_e + gl.expand_dims(n_w.to(gl.int64) * w_stride_n, 1)
                  + gl.expand_dims(c_w, 0))  # fmt: skip
        w_ok = gl.expand_dims(nok_w, 1) & gl.expand_dims(c_w >= 0, 0)
        # the scale row of each weight row (in the layout the scale is applied in)
        if PROMOTE:
            sv: gl.constexpr = gl.SliceLayout(1, mma)
        elif CVT32:
            sv: gl.constexpr = gl.SliceLayout(1, dl)  # type: ignore[no-redef]
        else:
            sv: gl.constexpr = gl.SliceLayout(1, l16)  # type: ignore[no-redef]
        r_s = gl.arange(0, BLOCK_N, layout=sv)
        n_s, nok_s = _rows(r_s, pid_n, N, BLOCK_N, SILU)
        s_ptrs = s_ptr + e * s_stride_e + _scale_rows(r_s, pid_n, N, BLOCK_N, SILU) * s_stride_n

        NSUB: gl.constexpr = 128 // KS  # sub-steps a 128-column scale block
        NU = K // KS
        NKB = K // 128
        gl.assume(NKB > 0)
        for u0 in gl.static_range(STAGES - 2):
            _issue(u0, NU, a_ptrs, a_ok, w_ptrs, w_ok, a_smem, w_smem, STAGES, KS)
        acc = gl.zeros([BLOCK_N, BM], gl.float32, layout=mma)
        w_prev = gl.zeros([BLOCK_N, KS], gl.bfloat16, layout=dl)
        if PROMOTE:
            part = gl.zeros([BLOCK_N, BM], gl.float32, layout=mma)
            s_prev = gl.zeros([BLOCK_N], gl.float32, layout=sv)
        for kb in range(NKB):
            s = gl.load(s_ptrs + kb, mask=nok_s, other=0.0)  # [BLOCK_N] fp32
            if CVT32:
                if not PROMOTE:
                    s_w = gl.expand_dims(s, 1)
            elif PROMOTE:  # bf16 2^120 twice
                k_w = gl.full([BLOCK_N, KS // 2], 0x7B807B80, gl.int32, layout=l16)
            else:  # 2^120 * s rounded to bf16 (a power of two: the rounding of s), twice
                sb = (s * 2.0**120).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32)
                sb = sb & 0xFFFF
                k_w = gl.broadcast(
                    gl.expand_dims(sb | (sb << 16), 1),
                    gl.full([BLOCK_N, KS // 2], 0, gl.int32, layout=l16),
                )[0]
            for j in gl.static_range(NSUB):
                u = kb * NSUB + j
                # sub-step u landed (this thread's copies; Triton's barrier: everyone's); slot
                # (u - 2) % STAGES is free (its MMA retired by the wait of sub-step u - 1)
                async_copy.wait_group(STAGES - 3)
                _issue(u + STAGES - 2, NU, a_ptrs, a_ok, w_ptrs, w_ok, a_smem, w_smem, STAGES, KS)
                slot = u % STAGES
                if CVT32:  # Triton's conversion (fp8 pairs -> f16 pairs -> f32), fp32 math
                    w32 = w_smem.index(slot).load(dl).to(gl.float32)
                    if PROMOTE:
                        w = w32.to(gl.bfloat16)  # exact
                    else:
                        w = (w32 * s_w).to(gl.bfloat16)  # one rounding
                else:
                    w16 = w_smem16.index(slot).load(l16)
                    w = _fp8_pairs_to_bf16(w16, k_w, dl, BLOCK_N, KS)
                b = a_smem.index(slot).permute((1, 0))  # [KS, BM]
                if PROMOTE:
                    if j == 0:
                        # the previous block's MMAs retired, its partial promoted (the first
                        # block: zeros); the tensor cores wait only for these FMAs
                        part, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(part, w_prev))
                        acc = acc + part * gl.expand_dims(s_prev, 1)
                        s_prev = s
                        part = warpgroup_mma(w, b, part, use_acc=False, is_async=True)
                    else:
                        part = warpgroup_mma(w, b, part, is_async=True)
                    part, w_prev, w = warpgroup_mma_wait(num_outstanding=1,
                                                         deps=(part, w_prev, w))  # fmt: skip
                else:
                    acc = warpgroup_mma(w, b, acc, is_async=True)
                    acc, w_prev, w = warpgroup_mma_wait(num_outstanding=1,
                                                        deps=(acc, w_prev, w))  # fmt: skip
                w_prev = w
        if PROMOTE:
            part, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(part, w_prev))
            acc = acc + part * gl.expand_dims(s_prev, 1)
        else:
            acc, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_prev))
        async_copy.wait_group(0)

        if SILU:
            # fp8_moe's numerics: silu(gate) * up in fp32, one rounding
            _silu_epilogue(acc, c_ptr, sorted_ptr, row0, pid_n, N, num_pairs, c_stride, BM,
                           BLOCK_N, 0, NW, True)  # fmt: skip
        else:
            _store_epilogue(acc, c_ptr, tw_ptr, sorted_ptr, row0, pid_n, N, num_pairs, c_stride,
                            MUL_W, 0, BM, BLOCK_N, NW)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _fp8_gemm_gluon_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr, unit_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        num_blocks,
        A_DIV: gl.constexpr, MUL_W: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KS: gl.constexpr, STAGES: gl.constexpr,
        NW: gl.constexpr, PROMOTE: gl.constexpr, CVT32: gl.constexpr, SILU: gl.constexpr,
        TAIL: gl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] W[e, n, k] (* tw[pair]) for one aligned block
        of BLOCK_M pairs of expert e and BLOCK_N outputs (SILU: c[pair, j] = silu(gate_j) *
        up_j, N = 2 I rows: gate then up). The N tiles of one row block are adjacent in launch
        order (its activation rows stay in L2); the row blocks of one expert follow. TAIL (the
        INT4 Gluon kernel's): rows aligned to BLOCK_M / 2, program row pid // num_n is unit
        unit_ptr[..] (`tail_units`), a BLOCK_M tile of blocks b, b + 1 where both are its
        expert's, else a BLOCK_M / 2 tile (an expert's last pairs waste at most BLOCK_M / 2
        rows)."""
        pid = gl.program_id(0)
        num_n = gl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if TAIL:
            HALF: gl.constexpr = BLOCK_M // 2
            b = gl.load(unit_ptr + pid_m)
            npost = gl.load(npost_ptr)
            if b * HALF >= npost:
                return
            e32 = gl.load(eid_ptr + b)
            e_next = gl.load(eid_ptr + gl.minimum(b + 1, num_blocks - 1))
            e = e32.to(gl.int64)
            if ((b + 1) * HALF < npost) & (e_next == e32):
                _tile(a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, b * HALF, e, pid_n, N, K,
                      num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e,
                      s_stride_n, A_DIV, MUL_W, BLOCK_M, BLOCK_N, KS, STAGES, NW, PROMOTE,
                      CVT32, SILU)  # fmt: skip
            else:
                _tile(a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, b * HALF, e, pid_n, N, K,
                      num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e,
                      s_stride_n, A_DIV, MUL_W, HALF, BLOCK_N, KS, STAGES, NW, PROMOTE, CVT32,
                      SILU)  # fmt: skip
        else:
            if pid_m * BLOCK_M >= gl.load(npost_ptr):
                return
            e = gl.load(eid_ptr + pid_m).to(gl.int64)
            _tile(a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, pid_m * BLOCK_M, e, pid_n, N,
                  K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e,
                  s_stride_n, A_DIV, MUL_W, BLOCK_M, BLOCK_N, KS, STAGES, NW, PROMOTE, CVT32,
                  SILU)  # fmt: skip


def gemm_fp8_gluon(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, silu, cfg,
                   units=None):  # fmt: skip
    """One launch: c[pair, n] = a[pair // a_div] @ (w[e] * s[e])^T (mul_w: * tw[pair]); silu
    (the gate_up launch: N = 2 I, c [M, I]): c = silu(gate) * up. a bf16 [rows, K], w fp8
    [E, N, K], s fp32 [E, cdiv(N, 128), cdiv(K, 128)]; the rows (and TAIL's units) of
    int4_gemm_gluon.gluon_align for cfg."""
    if not gluon_available():
        raise RuntimeError("the Gluon fp8 GEMM needs Triton 3.6 with Gluon")
    cfg = {**CONFIG_DEFAULTS, **{k: cfg[k] for k in CONFIG_KEYS if k in cfg}}
    check_config(cfg)
    if K % 128:
        raise ValueError(f"gluon fp8 GEMM: K={K} is not a multiple of 128")
    cfg["SILU"] = bool(silu)
    if silu and N % 2:
        raise ValueError(f"gluon fp8 GEMM: SILU needs an even N (gate and up rows), got {N}")
    if cfg["TAIL"] and units is None:
        raise ValueError("gluon fp8 GEMM: TAIL needs the units (gluon_align)")
    cfg["TAIL"] = bool(cfg["TAIL"])
    if cfg["WS"]:
        launch_fp8_ws(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, cfg)
        return
    for key in FP8_WS_DEFAULTS:
        cfg.pop(key)
    nw = cfg.pop("num_warps")
    rows = units.shape[0] if cfg["TAIL"] else eids.shape[0]
    grid = (rows * cdiv(N, cfg["BLOCK_N"]),)
    _fp8_gemm_gluon_kernel[grid](
        a, w, s, c, tw, sorted_ids, eids, npost, units if cfg["TAIL"] else eids, N, K, M,
        a.stride(0), c.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        eids.shape[0], A_DIV=a_div, MUL_W=mul_w, NW=nw, num_warps=nw, **cfg,
    )  # fmt: skip


def fp8_moe_gluon(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "fp8"
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int32/int64
    config: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
) -> torch.Tensor:  # [T, D]
    """fp8_moe.fp8_moe's result with the Gluon kernel: `config` one launch config (both GEMMs),
    or a table by pair count (None: FP8_GLUON_TABLE). No host synchronisation. `active` 0:
    every program returns at once (npost 0; the output is left unwritten)."""
    T, k = check_inputs("fp8_moe_gluon", x, ew, topk_weights, topk_ids)
    D = x.shape[1]
    if not supported(ew):
        raise ValueError("fp8_moe_gluon: hidden and intermediate sizes must be multiples of 128")
    I, E = ew.intermediate, ew.num_experts
    M = T * k
    if config is None or not isinstance(config, Mapping):
        cfg = pick(FP8_GLUON_TABLE if config is None else config, M)
    else:
        cfg = dict(config)
    x = x.contiguous()
    sorted_ids, eids, npost, units = gluon_align(topk_ids, E, cfg)
    if active is not None:  # 0 rows in use: every program returns at once (TAIL too)
        npost = npost * active
    tw = topk_weights.reshape(-1).float().contiguous()
    silu = bool(cfg.get("SILU", CONFIG_DEFAULTS["SILU"]))
    # without SILU the GEMM outputs stay fp32 (fp8_moe's rounding: one, of silu(gate) * up)
    h = (
        torch.empty(M, I, dtype=x.dtype, device=x.device)
        if silu
        else x.new_empty(M, 2 * I, dtype=torch.float32)
    )
    gemm_fp8_gluon(x, ew.w13, ew.w13_scale, h, tw, sorted_ids, eids, npost, 2 * I, D, M, k,
                   False, silu, cfg, units)  # fmt: skip
    if not silu:
        h = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]).to(x.dtype)
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    gemm_fp8_gluon(h, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1, True,
                   False, cfg, units)  # fmt: skip
    return out.view(T, k, D).sum(1)
