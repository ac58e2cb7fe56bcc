# ruff: noqa: E741
"""INT4 W4A16 grouped MoE GEMM written in Gluon (Triton's explicit-layout dialect) for Hopper:
the dequant of one nibble plane overlaps the wgmma of the previous one.

Owns: `gemm_gluon` (one launch, the drop-in for `int4_gemm._gemm`: same operands, the same
moe_align_block_size rows, A_DIV / MUL_W / PERM_OUT meanings, activations in `to_gemm_order`),
whether it can run (`gluon_available`, `gluon_usable`), its configs (`GLUON_CONFIG`,
`GLUON_TABLE` by pair count, `check_config`, `smem_bytes`), the rows a config runs on
(`gluon_align`, `tail_units`); the dequant, copies and SILU store are
int4_gemm_gluon_parts.py's; config WS runs the warp-specialized variant (int4_gemm_gluon_ws.py).
int4_gemm.int4_moe_gemm picks it with backend="gluon" (argument, config key or
K2SERVE_INT4_GEMM).

Why: Triton 3.6 waits for every register-operand wgmma before dequantizing the next plane
(`warpgroup.wait 0`), so the CUDA-core dequant and the tensor-core MMA never overlap. Here the
waits are ours: `warpgroup_mma(..., is_async=True)` then `warpgroup_mma_wait(1, deps=...)`
retires the previous plane's MMA only, and the in-flight plane's registers stay alive through
the wait's deps (the next wait retires them). SASS (benchmarks/gluon_compile.py): one
`WARPGROUP.DEPBAR.LE gsb0, 0x1` per plane (0x2 per pair with INFLIGHT=2), no ptxas
serialization; `gl.assume(NU > 0)` is what keeps it so (the zero-trip path's accumulator
init made ptxas serialize every wgmma, C7515).

L2: a tile's time follows the 32-byte L2 sectors it reads per MAC (the wave-7 sweep: 64x128,
64x256, 128x256 cost 2.0 / 1.57 / 1 a MAC, the sectors predict 2.0 / 1.55 / 1): activations
2 BLOCK_M bytes a K column, words BLOCK_N (half of each sector a sub-step: the other parity's
half is the next one's), scales BLOCK_N / 4 (half sectors, read twice). Config keys L1 (words
and scales through L1) and KW (a K step's words and scales loaded once, whole sectors) take the
words to BLOCK_N / 2 and the scales to BLOCK_N / 8; TAIL halves the padding rows.

Dequant: planes are made in pairs (2M, 2M + 1: the two nibbles of byte M). fp32 (default):
int4_gemm._plane_w's math, one lop3 + one FFMA per weight, a cvt per two. BF16X2: two
k-adjacent weights per instruction (prmt, lop3, two bf16x2 FMAs per pair of a plane), the same
correctly rounded values, ~20% fewer instructions per sub-step.

Layout: the same order as `_int4_gemm_kernel` (int4_gemm.py's docstring): the weights are
the MMA's left operand (`DotOperandLayout` of an `NVMMADistributedLayout` v3, rows = BLOCK_N
outputs), the tokens its N (BLOCK_M aligned (token, slot) pairs of one expert). A sub-step is
one parity tile of a K step of 16 * W2 columns: words [BLOCK_N, W2] (group pair c // 4, word
c % 4 of the even or odd group), their scale words [BLOCK_N, W2 / 4] and the 8 activation
planes [BLOCK_M, W2] (each K-major, `NVMMASharedLayout`, the wgmma's B through a transposed
view; stored as one [8 * BLOCK_M, W2] tile). Sub-steps are cp.async'ed into a ring of STAGES
slots, one commit group each, loaded STAGES - 2 ahead: the slot refilled at sub-step u was
read at u - 2, whose MMAs every warpgroup has retired (the slack lets several warpgroups
share the ring). Per sub-step two barriers, both Triton's (after the copies landed; between
the refill and the reads of the ring), no proxy fence (FENCE: see the loop). The scale
words are broadcast over their 4 columns by loading them in the plane layout split as
[BLOCK_N, W2 / 4, 4] (a layout conversion that moves no data).

Invariants: Hopper (sm_90) only, Triton 3.6's Gluon API (3.9's differs: `gluon_available`
says whether this Triton has what the kernel uses; the module imports without Triton, Gluon
or CUDA). group 32, K % (16 * W2) == 0, BLOCK_N % (16 * num_warps) == 0 (each warpgroup owns
64-row MMAs), BLOCK_M in 8..256, multiple of 8. No host sync; CUDA-graph safe.
"""

from __future__ import annotations

import functools
import logging

import torch

from ._gluon import (
    HAS_GLUON,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    triton,
    warpgroup_mma_wait,
)
from ._triton import cdiv
from .int4_gemm_gluon_ws import WS_DEFAULTS, launch_ws, ws_check, ws_smem_bytes
from .moe_align import max_blocks, moe_align_block_size, tail_units

logger = logging.getLogger(__name__)

# Configs by (token, expert) pair count: BLOCK_M pairs x BLOCK_N outputs, W2 words per
# parity-tile row, STAGES ring slots, warps (4 per 64-row MMA slice). The engine takes its
# configs from the kernel tables (configs/h100.json "int4_prefill_gluon", measured there; the
# warm-up keys on that table's entries); this is the kernel's own default, the same values.
# The larger tiles win from ~85 rows per expert (T=4096 on K2) although they waste part of a
# tile: each weight and activation tile is re-read from L2 fewer times per FLOP. Wave 8: L1
# (the words and scales through L1) and, above 16384 pairs, SILU. Wave 11: the warp-specialized
# kernel from 32768 pairs (T=4096 at top-8), WS=2 RELEASE=2, from 131072 WS=1 (h100.json).
# Wave 12: 32x256 on 8 warps with L1 up to 4096 pairs (1.3-1.7x the 16x128 / 32x128 it
# replaced at T=256-512, both GPUs, uniform and concentrated routing). Wave 13: the WS kernel
# with 64-token tiles up to 32767 pairs (1.03-1.4x the plain kernel's 32x256, 64x256 and
# 128x256 tiles at T=256-3072, both routings; benchmarks/prefill_split.py, H100).
GLUON_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, W2=16, STAGES=3, num_warps=8, BF16X2=True, L1=True,
                    SILU=True)  # fmt: skip
GLUON_TABLE = (
    dict(max_pairs=32767, **{**GLUON_CONFIG, "BLOCK_M": 64, "STAGES": 4}, WS=2, RELEASE=2),
    dict(max_pairs=131071, **{**GLUON_CONFIG, "STAGES": 4}, WS=2, RELEASE=2),
    dict(max_pairs=None, **{**GLUON_CONFIG, "STAGES": 4}, WS=1),
)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "W2", "STAGES", "num_warps", "BF16X2", "INFLIGHT", "FENCE",
               "TAIL", "L1", "KW", "SILU", "CARVE", "MAXNREG", "WS", "PW", "PREG",
               "CREG", "RELEASE")  # fmt: skip
# BF16X2: the planes made two weights per instruction (bf16x2 PTX), not fp32 math; INFLIGHT:
# wgmmas in flight while the next planes are dequantized (1, 2); FENCE: a proxy fence after each
# sub-step's copies land; TAIL: rows aligned to BLOCK_M / 2, an expert's last <= BLOCK_M / 2
# pairs in a BLOCK_M / 2 tile (`tail_units`); L1: words and scales cp.async'ed through L1 (.ca,
# 8-byte pieces; the activations bypass it), with the carveout that leaves L1 room (a sub-step
# reads half of each 32-byte word sector, the other parity's half is the next one's, and its
# scales twice); KW: each K step's words (both parities) and scales loaded once into K-step
# slots (KW=2: two K steps' scales at once; K a multiple of 32 W2, else 1); SILU: the gate_up
# tiles take gate and up rows in halves and store silu(gate) * up (int4_moe_gemm skips its
# SiLU-and-mul); CARVE: the carveout alone; MAXNREG: ptxas' register cap. Wave-8 device runs
# (RESULTS.md): L1 +11-13% (the carveout alone -7 to -14%, KW +2-3%), SILU +2-5% with L1.
# WS (1, 2), PW, PREG, CREG, RELEASE: the warp-specialized kernel (int4_gemm_gluon_ws.py).
CONFIG_DEFAULTS = dict(BF16X2=False, INFLIGHT=1, FENCE=False, TAIL=False, L1=False, KW=False,
                       SILU=False, CARVE=False, MAXNREG=0, WS=False, **WS_DEFAULTS)  # fmt: skip


def gluon_available() -> bool:
    """Gluon with the Hopper API this kernel is written against (Triton 3.6's)."""
    if not HAS_GLUON:
        return False
    return triton.__version__.startswith("3.6")


def gluon_usable(device: torch.device | str) -> bool:
    """Whether the kernel runs on `device`: Triton 3.6's Gluon and an sm_90 GPU (wgmma)."""
    device = torch.device(device)
    if device.type != "cuda" or not gluon_available() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def smem_bytes(cfg: dict) -> int:
    """Shared memory of the ring (the epilogue's layout conversion reuses it)."""
    if cfg.get("WS"):
        return ws_smem_bytes(cfg)
    bm, bn, w2, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["W2"], cfg["STAGES"]
    if cfg.get("KW"):  # word and scale slots by K step (`_tile`), KW=2: 4 scale slots
        ws = (st + 2) // 2
        scales = (4 if cfg["KW"] == 2 else ws) * bn * (w2 // 4) * 4
        return st * 8 * bm * w2 * 2 + ws * 2 * bn * w2 * 4 + scales
    return st * (8 * bm * w2 * 2 + bn * w2 * 4 + bn * (w2 // 4) * 4)


def check_config(cfg: dict) -> None:
    """Raise ValueError for a config the kernel cannot take."""
    bm, bn, nw = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]
    if cfg.get("WS"):  # (the WS ring needs no slack slots: STAGES >= 2)
        ws_check(cfg)
        cfg = {**cfg, "STAGES": max(3, cfg["STAGES"])}
    if bm % 8 or not 8 <= bm <= 256:
        raise ValueError(f"gluon int4 GEMM: BLOCK_M={bm} must be a multiple of 8 in 8..256")
    if nw % 4 or bn % (16 * nw):
        raise ValueError(f"gluon int4 GEMM: BLOCK_N={bn} must be a multiple of 16 * num_warps "
                         f"({nw}, a multiple of 4)")  # fmt: skip
    if cfg["W2"] not in (16, 32) or cfg["STAGES"] < 3:
        raise ValueError("gluon int4 GEMM: W2 must be 16 or 32 and STAGES >= 3")
    if cfg.get("TAIL") and bm % 16:
        raise ValueError(f"gluon int4 GEMM: TAIL needs BLOCK_M={bm} a multiple of 16")
    if cfg.get("KW", 0) not in (0, 1, 2) or cfg.get("KW") == 2 and cfg["STAGES"] > 5:
        raise ValueError("gluon int4 GEMM: KW must be 0, 1 or 2 (2: STAGES <= 5)")
    if cfg.get("KW") and cfg.get("L1"):
        raise ValueError("gluon int4 GEMM: KW and L1 are two ways to the same end: one of them")
    if cfg.get("INFLIGHT", 1) not in (1, 2):
        raise ValueError("gluon int4 GEMM: INFLIGHT must be 1 or 2")
    if not cfg.get("WS") and smem_bytes(cfg) > 227 * 1024:
        raise ValueError(f"gluon int4 GEMM: {smem_bytes(cfg)} B of shared memory (> 227 KiB)")


def align_m(cfg: dict) -> int:
    """The rows' alignment (moe_align_block_size's block_m) the config runs on."""
    return cfg["BLOCK_M"] // 2 if cfg.get("TAIL") else cfg["BLOCK_M"]


def gluon_align(topk_ids: torch.Tensor, num_experts: int, cfg: dict):
    """moe_align_block_size for the config (`align_m`) and, for TAIL, its `tail_units`:
    (sorted_ids, expert_ids, num_post_padded, units or None)."""
    sid, eids, npost = moe_align_block_size(topk_ids, num_experts, align_m(cfg))
    if not cfg.get("TAIL"):
        return sid, eids, npost, None
    num_units = max_blocks(topk_ids.numel(), num_experts, cfg["BLOCK_M"])
    return sid, eids, npost, tail_units(eids, num_experts, num_units)


if HAS_GLUON:
    from .int4_gemm_gluon_parts import (
        _issue,
        _plane_mma,
        _rows,
        _silu_epilogue,
        _split_cols,
        _store_epilogue,
    )

    @gluon.jit
    def _tile(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, row0, e, pid_n,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: gl.constexpr, MUL_W: gl.constexpr, PERM_OUT: gl.constexpr,
        BM: gl.constexpr, BLOCK_N: gl.constexpr, W2: gl.constexpr, STAGES: gl.constexpr,
        NW: gl.constexpr, BF16X2: gl.constexpr, INFLIGHT: gl.constexpr, FENCE: gl.constexpr,
        L1: gl.constexpr, KW: gl.constexpr, SILU: gl.constexpr,
    ):  # fmt: skip
        """One output tile: the BM aligned pairs at sorted rows row0.. (all of expert e) x the
        BLOCK_N outputs of N tile pid_n (acc[n, pair]), with its own ring (freed before the
        epilogue, whose layout conversion reuses it)."""
        # register layouts: the MMA (acc [BLOCK_N, BM]), its A operand (one plane
        # [BLOCK_N, W2]), the same split [BLOCK_N, W2 / 4, 4] for the scales
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                      instr_shape=[16, BM, 16])  # fmt: skip
        dl: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        l3: gl.constexpr = _split_cols(gl.to_linear_layout(dl, [BLOCK_N, W2]), BLOCK_N, W2)
        sl: gl.constexpr = gl.SliceLayout(2, l3)
        # global -> shared copy layouts (16-byte pieces)
        la: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (W2 // 8), W2 // 8], [NW, 1], [1, 0])
        # (L1: 8-byte pieces, Triton's cp.async of 16 bytes is always .cg, past L1)
        VW: gl.constexpr = 2 if L1 else 4
        lw: gl.constexpr = gl.BlockedLayout([1, VW], [32 // (W2 // VW), W2 // VW], [NW, 1],
                                            [1, 0])  # fmt: skip
        ls: gl.constexpr = gl.BlockedLayout([1, W2 // 4 // (1 + L1)], [32 // (1 + L1), 1 + L1],
                                            [NW, 1], [1, 0])  # fmt: skip
        # shared ring: activation planes (wgmma B, K-major), words, scale words
        a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * W2, element_bitwidth=16,
                                                  rank=2)  # fmt: skip
        # words: 16-byte pieces XOR-swizzled by row; the plane layout's 8-byte loads of a warp
        # then hit distinct banks (gl.bank_conflicts: 0 for BLOCK_N 128, W2 16; 1 with vec=2)
        w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=W2 // 4,
                                                     order=[1, 0])  # fmt: skip
        s_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                     order=[1, 0])  # fmt: skip
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8 * BM, W2], a_sl)
        # KW: word slots by K step [ws, parity], scale slots [ws]; K step ks's are refilled
        # (for ks + WS, at sub-step 2 (ks + WS) - STAGES + 2) once sub-step 2 ks + 1 is 2 behind
        WS: gl.constexpr = (STAGES + 2) // 2 if KW else STAGES
        # (KW: read as [2 * WS, BLOCK_N, W2], slot 2 ws + parity, written as
        # [WS, 2, BLOCK_N, W2]: the same bytes and swizzle)
        w_smem = gl.allocate_shared_memory(gl.int32, [(2 if KW else 1) * WS, BLOCK_N, W2], w_sl)
        if KW:
            w_sl3: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=W2 // 4,
                                                          order=[2, 1, 0])  # fmt: skip
            w_fill = w_smem._reinterpret(gl.int32, [WS, 2, BLOCK_N, W2], w_sl3)
        else:
            w_fill = w_smem
        if KW == 2:  # scales by K-step pair: read as [4, ...], slot 2 (pair % 2) + ks % 2
            s_smem = gl.allocate_shared_memory(gl.int32, [4, BLOCK_N, W2 // 4], s_sl)
            s_sl3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                          order=[2, 1, 0])  # fmt: skip
            s_fill = s_smem._reinterpret(gl.int32, [2, 2, BLOCK_N, W2 // 4], s_sl3)
        else:
            s_smem = gl.allocate_shared_memory(gl.int32, [WS, BLOCK_N, W2 // 4], s_sl)
            s_fill = s_smem

        # activation planes as one [8 * BM, W2] tile per slot: row q = plane q // BM of pair
        # q % BM (padding pairs: not read, zeros)
        q_a = gl.arange(0, 8 * BM, layout=gl.SliceLayout(1, la))
        pair_a = gl.load(sorted_ptr + row0 + q_a % BM)
        rows = gl.where(pair_a < num_pairs, pair_a // A_DIV, 0).to(gl.int64)
        c_a = gl.arange(0, W2, layout=gl.SliceLayout(0, la))
        a_ptrs = (a_ptr + gl.expand_dims(rows * a_stride + (q_a // BM) * W2, 1)
                  + gl.expand_dims(c_a, 0))  # fmt: skip
        a_ok = gl.expand_dims(pair_a < num_pairs, 1) & gl.expand_dims(c_a >= 0, 0)
        # words: column c of a parity tile is word (c // 4) * 8 + c % 4 of the K step (+ 4 odd)
        n_w, nok_w = _rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lw)), pid_n, N, BLOCK_N,
                           SILU)  # fmt: skip
        c_w = gl.arange(0, W2, layout=gl.SliceLayout(0, lw))
        w_ptrs = (w_ptr + e * w_stride_e + gl.expand_dims(n_w * w_stride_n, 1)
                  + gl.expand_dims((c_w // 4) * 8 + c_w % 4, 0))  # fmt: skip
        w_ok = gl.expand_dims(nok_w, 1) & gl.expand_dims(c_w >= 0, 0)
        if KW:  # [2, BLOCK_N, W2]: both parities; a warp's pieces are whole 128-byte rows
            lw3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [2, 32 // (W2 // 2), W2 // 4],
                                                 [1, NW, 1], [2, 0, 1])  # fmt: skip
            par3 = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, lw3)))
            r3 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, lw3)))
            n3, nok3 = _rows(r3, pid_n, N, BLOCK_N, SILU)
            c3 = gl.arange(0, W2, layout=gl.SliceLayout(0, gl.SliceLayout(1, lw3)))
            off3 = (gl.expand_dims(gl.expand_dims(par3 * 4, 1), 2)
                    + gl.expand_dims(gl.expand_dims(n3 * w_stride_n, 0), 2)
                    + gl.expand_dims(gl.expand_dims((c3 // 4) * 8 + c3 % 4, 0), 1))  # fmt: skip
            w_ptrs = w_ptr + e * w_stride_e + off3
            w_ok = (gl.expand_dims(gl.expand_dims(par3 >= 0, 1), 2)
                    & gl.expand_dims(gl.expand_dims(nok3, 0), 2)
                    & gl.expand_dims(gl.expand_dims(c3 >= 0, 0), 1))  # fmt: skip
        n_s, nok_s = _rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ls)), pid_n, N, BLOCK_N,
                           SILU)  # fmt: skip
        c_s = gl.arange(0, W2 // 4, layout=gl.SliceLayout(0, ls))
        s_ptrs = (s_ptr + e * s_stride_e + gl.expand_dims(n_s * s_stride_n, 1)
                  + gl.expand_dims(c_s, 0))  # fmt: skip
        s_ok = gl.expand_dims(nok_s, 1) & gl.expand_dims(c_s >= 0, 0)
        if KW == 2:  # [2, BLOCK_N, W2 / 4]: a row's two K steps in one copy instruction
            ls3: gl.constexpr = gl.BlockedLayout([1, 1, W2 // 4], [2, 16, 1], [1, NW, 1],
                                                 [2, 0, 1])  # fmt: skip
            h3 = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, ls3)))
            rs3 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, ls3)))
            ns3, noks3 = _rows(rs3, pid_n, N, BLOCK_N, SILU)
            cs3 = gl.arange(0, W2 // 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, ls3)))
            s_ptrs = (s_ptr + e * s_stride_e + gl.expand_dims(gl.expand_dims(h3 * (W2 // 4), 1), 2)
                      + gl.expand_dims(gl.expand_dims(ns3 * s_stride_n, 0), 2)
                      + gl.expand_dims(gl.expand_dims(cs3, 0), 1))  # fmt: skip
            s_ok = (gl.expand_dims(gl.expand_dims(h3 >= 0, 1), 2)
                    & gl.expand_dims(gl.expand_dims(noks3, 0), 2)
                    & gl.expand_dims(gl.expand_dims(cs3 >= 0, 0), 1))  # fmt: skip

        NU = K // (8 * W2)  # sub-steps: the even then the odd tile of each K step
        gl.assume(NU > 0)
        for u in gl.static_range(STAGES - 2):
            _issue(u, NU, a_ptrs, a_ok, w_ptrs, w_ok, s_ptrs, s_ok, a_smem, w_fill, s_fill,
                   STAGES, W2, L1, KW)  # fmt: skip
        acc = gl.zeros([BLOCK_N, BM], gl.float32, layout=mma)
        # the planes of the MMAs in flight (kept alive through the waits' deps)
        w_p0 = gl.zeros([BLOCK_N, W2], gl.bfloat16, layout=dl)
        w_p1 = gl.zeros([BLOCK_N, W2], gl.bfloat16, layout=dl)
        for u in range(NU):
            # sub-step u landed (this thread's copies; Triton's barrier: everyone's). Triton
            # also puts a barrier between the refill below and the reads (it cannot tell the
            # slots apart): slot (u - 2) % STAGES is free. No proxy fence by default, as in
            # Triton's own cp.async + wgmma pipelines: fence.proxy.async compiles to
            # MEMBAR.ALL.CTA, which (the suspicion from the first device run) waits for every
            # copy in flight, the whole prefetch; FENCE=True measures it
            async_copy.wait_group(STAGES - 3)
            if FENCE:
                fence_async_shared()
            _issue(u + STAGES - 2, NU, a_ptrs, a_ok, w_ptrs, w_ok, s_ptrs, s_ok, a_smem, w_fill,
                   s_fill, STAGES, W2, L1, KW)  # fmt: skip
            slot = u % STAGES
            if KW:
                w_slot = 2 * ((u // 2) % WS) + u % 2
                if KW == 2:
                    s_slot = 2 * ((u // 4) % 2) + (u // 2) % 2
                else:
                    s_slot = (u // 2) % WS
            else:
                w_slot = slot
                s_slot = slot
            acc, w_p0, w_p1 = _plane_mma(u, acc, w_p0, w_p1, s_smem, s_slot, w_smem, w_slot,
                                         a_smem, slot, None, BM, BLOCK_N, W2, BF16X2, INFLIGHT, dl,
                                         l3, sl)  # fmt: skip
        acc, w_p0, w_p1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_p0, w_p1))
        async_copy.wait_group(0)

        if SILU:
            _silu_epilogue(acc, c_ptr, sorted_ptr, row0, pid_n, N, num_pairs, c_stride, BM,
                           BLOCK_N, W2, NW, False)  # fmt: skip
            return
        # epilogue: (routing weight), store the pairs' rows (PERM_OUT: in gemm order)
        _store_epilogue(acc, c_ptr, tw_ptr, sorted_ptr, row0, pid_n, N, num_pairs, c_stride, MUL_W,
                        W2 if PERM_OUT else 0, BM, BLOCK_N, NW)  # fmt: skip

    # (pair and block counts unspecialized: no recompile per count's divisibility)
    @gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _int4_gemm_gluon_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr, unit_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        num_blocks,
        A_DIV: gl.constexpr, MUL_W: gl.constexpr, PERM_OUT: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, W2: gl.constexpr, STAGES: gl.constexpr,
        NW: gl.constexpr, BF16X2: gl.constexpr, INFLIGHT: gl.constexpr, FENCE: gl.constexpr,
        TAIL: gl.constexpr, L1: gl.constexpr, KW: gl.constexpr, SILU: gl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] * dequant(w[e, n, k]) (* tw[pair]) for one
        aligned block of BLOCK_M pairs of expert e and BLOCK_N outputs (acc[n, pair], weights
        = the wgmma's register operand). s_ptr: the bf16 scales viewed as int32 (a word holds
        the scales of groups 2h, low half, and 2h + 1). TAIL: the rows are aligned to BLOCK_M
        / 2 and program row pid // num_n is unit unit_ptr[pid // num_n] (`tail_units`): a
        block b at an even place in its expert's blocks, run as a BLOCK_M tile with block
        b + 1 where that is the same expert's, else alone as a BLOCK_M / 2 tile (an expert's
        last pairs waste at most BLOCK_M / 2 rows, not BLOCK_M)."""
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
            full = ((b + 1) * HALF < npost) & (e_next == e32)
            e = e32.to(gl.int64)
            if full:
                _tile(a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, b * HALF, e, pid_n, N, K,
                      num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e,
                      s_stride_n, A_DIV, MUL_W, PERM_OUT, BLOCK_M, BLOCK_N, W2, STAGES, NW,
                      BF16X2, INFLIGHT, FENCE, L1, KW, SILU)  # fmt: skip
            else:
                _tile(a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, b * HALF, e, pid_n, N, K,
                      num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e,
                      s_stride_n, A_DIV, MUL_W, PERM_OUT, HALF, BLOCK_N, W2, STAGES, NW,
                      BF16X2, INFLIGHT, FENCE, L1, KW, SILU)  # fmt: skip
        else:
            if pid_m * BLOCK_M >= gl.load(npost_ptr):
                return
            e = gl.load(eid_ptr + pid_m).to(gl.int64)
            _tile(a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, pid_m * BLOCK_M, e, pid_n, N,
                  K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e,
                  s_stride_n, A_DIV, MUL_W, PERM_OUT, BLOCK_M, BLOCK_N, W2, STAGES, NW, BF16X2,
                  INFLIGHT, FENCE, L1, KW, SILU)  # fmt: skip


def gemm_gluon(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, perm_out, cfg,
               units=None):  # fmt: skip
    """One launch of the Gluon kernel; arguments as int4_gemm._gemm (a in gemm order with
    cfg["W2"], s bf16 [E, N, K/32], c [M, N] written at the aligned pairs' rows); cfg holds
    CONFIG_KEYS (others are ignored). TAIL: the rows aligned to BLOCK_M / 2 and `units`
    (`gluon_align` gives both)."""
    if not gluon_available():
        raise RuntimeError("the Gluon int4 GEMM needs Triton 3.6 with Gluon (K2SERVE_INT4_GEMM="
                           "triton selects the Triton kernel)")  # fmt: skip
    cfg = {k: cfg[k] for k in CONFIG_KEYS if k in cfg}
    cfg = {**CONFIG_DEFAULTS, **cfg}
    check_config(cfg)
    if K % (16 * cfg["W2"]):
        raise ValueError(f"gluon int4 GEMM: K={K} is not a multiple of {16 * cfg['W2']}")
    if cfg["KW"] == 2 and K % (32 * cfg["W2"]):  # an odd count of K steps: no scale pairs
        cfg["KW"] = 1
    cfg["KW"] = int(cfg["KW"])
    cfg["SILU"] = bool(cfg["SILU"] and perm_out)  # the gate_up launch only; c is [M, N / 2]
    if perm_out and (N // 2 if cfg["SILU"] else N) % (16 * cfg["W2"]):
        raise ValueError(f"gluon int4 GEMM: gemm-order output (N={N}, SILU={cfg['SILU']}) "
                         "needs whole blocks of 16 * W2 columns (a partial one's land past the "
                         "row)")  # fmt: skip
    if cfg["TAIL"] and units is None:
        raise ValueError("gluon int4 GEMM: TAIL needs the units (gluon_align)")
    s32 = s.view(torch.int32)
    if cfg["WS"]:
        return launch_ws(a, w, s32, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w,
                         perm_out, cfg, _l1_carveout)  # fmt: skip
    for key in ("WS", *WS_DEFAULTS):
        cfg.pop(key)
    nw = cfg.pop("num_warps")
    carve = cfg.pop("CARVE") or cfg["L1"]  # a host-side setting, not the kernel's
    opts = {"maxnreg": mr} if (mr := cfg.pop("MAXNREG")) else {}
    rows = units.shape[0] if cfg["TAIL"] else eids.shape[0]
    grid = (rows * cdiv(N, cfg["BLOCK_N"]),)
    k = _int4_gemm_gluon_kernel[grid](
        a, w, s32, c, tw, sorted_ids, eids, npost, units if cfg["TAIL"] else eids, N, K, M,
        a.stride(0), c.stride(0), w.stride(0), w.stride(1), s32.stride(0), s32.stride(1),
        eids.shape[0], A_DIV=a_div, MUL_W=mul_w, PERM_OUT=perm_out, NW=nw, num_warps=nw, **opts,
        **cfg,
    )  # fmt: skip
    if carve and getattr(k, "function", None):
        _l1_carveout(int(k.function), int(k.metadata.shared), int(k.n_regs) * 32 * nw)


def carveout_pct(shared: int, regs: int) -> int:
    """The shared-memory carveout (percent of sm_90's 228 KiB) for as many CTAs of `shared`
    bytes as `regs` registers a CTA let run on one SM."""
    per_cta, smem = shared + 1024, 228 * 1024  # the driver reserves 1 KiB a CTA
    ctas = max(1, min(65536 // max(regs, 1), smem // per_cta))
    return min(100, -(-ctas * per_cta * 100 // smem))


@functools.lru_cache(maxsize=64)
def _l1_carveout(function: int, shared: int, regs: int) -> None:
    """Once per compiled kernel: ask for the smallest shared-memory carveout that holds as
    many CTAs as the registers let run (the rest of the SM's 256 KiB is L1; Triton asks for
    the largest, 228 KiB: 28 KiB of L1, less than one sub-step's word and scale sectors). A
    hint to the driver; failure only logs (the kernel runs either way)."""
    import ctypes

    pct = carveout_pct(shared, regs)
    try:  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
        rc = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(
            ctypes.c_void_p(function), ctypes.c_int(9), ctypes.c_int(pct)
        )
    except OSError as e:
        rc = str(e)
    if rc != 0:
        logger.warning("gluon int4 GEMM: L1 carveout of %d%% not set (%s)", pct, rc)
