# ruff: noqa: E741
"""The warp-specialized variant of the Gluon FP8-block grouped GEMM (fp8_gemm_gluon.py, config
key WS=1 or 2): a producer partition streams the sub-steps into a ring of mbarrier-guarded
stages, the consumer warpgroups convert the fp8 weights and issue their wgmmas each at its own
pace. The INT4 WS kernel's design (int4_gemm_gluon_ws.py) on the FP8 kernel's operands.

Owns: `_fp8_gemm_gluon_ws_kernel` (launched by fp8_gemm_gluon.gemm_fp8_gluon when cfg["WS"]),
`launch_fp8_ws`, `fp8_ws_smem_bytes`, `fp8_ws_check`. Shared with the INT4 WS kernel (imported
from int4_gemm_gluon_ws.py, not copied): `ws_split` (the consumer partitions), `ws_regs` (the
register split, given this ring's shared memory), `_release` (how a consumer frees a stage)
and the RELEASE protocol. The
producers differ (INT4: 8 activation planes + words + scale words a sub-step; FP8: one
activation tile + one fp8 weight tile) and so do the consumers' bodies (dequant + 8 planes vs
one conversion + the per-K-block promotion), so those stay per kernel, and so does SILU's row
order (`_ws_rows`: gate / up interleaved by 8 rows, so that the shipped 128-row tiles split
into partitions without a layout conversion; INT4's `_halves` needs 128 rows a warpgroup).

Partitions (`gl.warp_specialize`; the launch's num_warps is the default partition's, CW):
- consumers: NC partitions of CW warps (WS=1: one of num_warps, WS=2: one per warpgroup).
  Partition G owns BLOCK_N / NC weight rows and runs exactly what the shipped kernel's tile of
  BN = BLOCK_N / NC rows, N tile pid_n * NC + G runs with PROMOTE and CVT32 (the shipped
  configs' mode): per 128-column K block, its scales loaded (used one block later: latency
  hidden), per sub-step u: wait full[u % STAGES], load the fp8 tile in the operand layout,
  convert through Triton's fp8 -> fp32 path to bf16 (exact), the block's first MMA into a
  fresh fp32 partial after acc += partial * s_prev (the previous block's, all its MMAs retired
  by a wait(0)), then wait(1). Every output element is the same fp32 sum in the same order:
  bit-identical to the shipped kernel (any BLOCK_N: a row's sums do not depend on the tile).
  Release (`_release`): RELEASE=1 at the end of sub-step u, stage u - 1 (its MMA retired by
  this sub-step's wait(1)); RELEASE=2 a wait(0) at the end of each sub-step and its own stage
  (STAGES - 1 ahead); RELEASE=0 Gluon's one-thread arrive. Epilogue straight from the MMA
  layout (no layout conversion: its shared-memory scratch would sit beside the ring): SILU in
  fp32, one rounding (fp8_moe's numerics, the shipped _silu_epilogue's F32ACT), or the plain
  store (times the routing weights with MUL_W).
- producer: PW warps (1 or 4). Per sub-step: wait empty (the first round passes), cp.async the
  activation tile [BLOCK_M, KS] (a gather by sorted pair rows) and the weight tile [BLOCK_N, KS]
  (every consumer's rows), then `cp.async.mbarrier.arrive.noinc` on full (count 32 * PW: it
  completes when every producer thread's copies landed). int32 offsets, 64-bit bases scalar.

Invariants: as fp8_gemm_gluon (Hopper, Triton 3.6 Gluon, K % 128 == 0), KS 32, 64 or 128 (a
128-column sub-step is one K block: the shipped table's since wave 13; the plain kernel takes
32 or 64), with PROMOTE and CVT32 only; NC in 1..2, BLOCK_N / NC a multiple of 16 * CW; no
TAIL; the activations under 2^31 elements (int32 offsets). No host sync; CUDA-graph safe.
"""

from __future__ import annotations

from ._gluon import (
    HAS_GLUON,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .int4_gemm_gluon_ws import ws_regs, ws_split

FP8_WS_DEFAULTS = dict(WS=0, PW=4, RELEASE=1, FENCE=False)  # WS 0: the shipped kernel


def fp8_ws_smem_bytes(cfg: dict) -> int:
    """Shared memory of the WS ring: STAGES x (activations [BLOCK_M, KS] bf16 + weights
    [BLOCK_N, KS] fp8) + 2 mbarriers a stage."""
    return cfg["STAGES"] * (cfg["KS"] * (2 * cfg["BLOCK_M"] + cfg["BLOCK_N"]) + 16)


def fp8_ws_check(cfg: dict) -> None:
    """Raise ValueError for a config the FP8 WS kernel cannot take."""
    nw, bn = cfg["num_warps"], cfg["BLOCK_N"]
    nc, cw = ws_split(cfg) if nw in (4, 8) else (1, 4)
    if nw not in (4, 8) or cfg.get("WS") not in (True, 1, 2) or (bn // nc) % (16 * cw):
        raise ValueError(f"gluon fp8 GEMM WS: WS 1 or 2, num_warps={nw} (4 or 8) and BLOCK_N="
                         f"{bn} / partitions a multiple of 16 * their warps")  # fmt: skip
    if cfg.get("TAIL") or not cfg.get("PROMOTE", True) or not cfg.get("CVT32"):
        raise ValueError("gluon fp8 GEMM WS: PROMOTE and CVT32 only (the shipped mode), no TAIL")
    if (
        cfg.get("PW", 4) not in (1, 4)
        or cfg["STAGES"] < 2
        or cfg.get("RELEASE", 1) not in (0, 1, 2)
        or cfg.get("KS", 64) not in (32, 64, 128)
    ):
        raise ValueError(
            "gluon fp8 GEMM WS: PW 1 or 4, STAGES >= 2, RELEASE 0..2, KS 32, 64 or 128"
        )
    if fp8_ws_smem_bytes(cfg) > 227 * 1024:
        raise ValueError(f"gluon fp8 GEMM WS: {fp8_ws_smem_bytes(cfg)} B of shared memory")
    maxnreg, creg, preg = ws_regs(cfg, fp8_ws_smem_bytes(cfg))
    if preg < 24 or maxnreg * (nw // 4 + 1) * 128 > 65536:
        raise ValueError(f"gluon fp8 GEMM WS: registers {maxnreg}/{creg}/{preg} do not fit")


if HAS_GLUON:
    from .int4_gemm_gluon_ws import _release

    @gluon.jit
    def _ws_rows(r, tile, N, BN: gl.constexpr, SILU: gl.constexpr):
        """(weight row, output column j, whether it exists, up half or not) of a partition's
        local rows r in N tile `tile`. SILU: gate and up rows interleaved by 8 (in each 16
        rows, 8 gate rows then the same 8 up rows), so gate row and up row of an output sit in
        one thread of the MMA layout (row + 8 is a register basis) for any BN: the epilogue
        needs no layout conversion. (The shipped tile puts the gate rows first: another place
        for the same row sums, the same bits.)"""
        if SILU:
            HN: gl.constexpr = BN // 2
            j = tile * HN + (r // 16) * 8 + r % 8
            up = (r // 8) % 2
            return j + up * (N // 2), j, j < N // 2, up
        else:
            n = tile * BN + r
            return n, n, n < N, n * 0

    @gluon.jit
    def _il_halves(x, BN: gl.constexpr, BM: gl.constexpr):
        """x [BN, BM] in the MMA layout, rows in `_ws_rows`' SILU order -> (gate, up), each
        [BN / 16, 8, BM] (the same threads: no data moves)."""
        x4 = gl.permute(gl.reshape(x, [BN // 16, 2, 8, BM]), (0, 2, 3, 1))
        return gl.split(x4)

    @gluon.jit
    def _fp8_producer(a_ptr, w_ptr, sorted_ptr, row0, e, pid_n, N, K, num_pairs, a_stride,
                      w_stride_e, w_stride_n, a_smem, w_smem, full, empty, A_DIV: gl.constexpr,
                      BM: gl.constexpr, BLOCK_N: gl.constexpr, NC: gl.constexpr,
                      KS: gl.constexpr, STAGES: gl.constexpr, SILU: gl.constexpr,
                      PW: gl.constexpr):  # fmt: skip
        """cp.async every sub-step into the ring: wait its stage empty, copy the activation and
        weight tiles, arrive on full when the copies land."""
        BN: gl.constexpr = BLOCK_N // NC
        la: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (KS // 8), KS // 8], [PW, 1], [1, 0])
        lw: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (KS // 16), KS // 16], [PW, 1],
                                            [1, 0])  # fmt: skip
        r_a = gl.arange(0, BM, layout=gl.SliceLayout(1, la))
        pair_a = gl.load(sorted_ptr + row0 + r_a)
        rows = gl.where(pair_a < num_pairs, pair_a // A_DIV, 0)
        c_a = gl.arange(0, KS, layout=gl.SliceLayout(0, la))
        a_off = gl.expand_dims(rows * a_stride, 1) + gl.expand_dims(c_a, 0)
        a_ok = gl.expand_dims(pair_a < num_pairs, 1) & gl.expand_dims(c_a >= 0, 0)
        # weight rows: partition r // BN's (its N tile pid_n * NC + r // BN)
        r_w = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lw))
        n_w, _j, nok_w, _up = _ws_rows(r_w % BN, pid_n * NC + r_w // BN, N, BN, SILU)
        c_w = gl.arange(0, KS, layout=gl.SliceLayout(0, lw))
        w_off = gl.expand_dims(n_w * w_stride_n, 1) + gl.expand_dims(c_w, 0)
        w_ok = gl.expand_dims(nok_w, 1) & gl.expand_dims(c_w >= 0, 0)
        w_base = w_ptr + e * w_stride_e
        NU = K // KS
        gl.assume(NU > 0)
        for u in range(NU):
            slot = u % STAGES
            mbarrier.wait(empty.index(slot), ((u // STAGES) & 1) ^ 1)
            async_copy.async_copy_global_to_shared(a_smem.index(slot), a_ptr + (a_off + u * KS),
                                                   mask=a_ok)  # fmt: skip
            async_copy.async_copy_global_to_shared(w_smem.index(slot), w_base + (w_off + u * KS),
                                                   mask=w_ok)  # fmt: skip
            async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
        async_copy.wait_group(0)

    @gluon.jit
    def _fp8_substep(u, j: gl.constexpr, acc, part, w_prev, s, s_prev, a_smem, w_smem, full,
                     empty, G: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                     dl: gl.constexpr, FENCE: gl.constexpr, FREE: gl.constexpr,
                     RELEASE: gl.constexpr):  # fmt: skip
        """Sub-step u (number j of its 128-column K block): the shipped kernel's PROMOTE + CVT32
        body on ring stage u % STAGES, guarded by full / empty."""
        slot = u % STAGES
        mbarrier.wait(full.index(slot), (u // STAGES) & 1)
        if FENCE:
            fence_async_shared()
        w = w_smem.index(slot).slice(G * BN, BN).load(dl).to(gl.float32).to(gl.bfloat16)
        b = a_smem.index(slot).permute((1, 0))  # [KS, BM]
        if j == 0:
            # the previous block's MMAs retired, its partial promoted (the first block: zeros)
            part, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(part, w_prev))
            acc = acc + part * gl.expand_dims(s_prev, 1)
            s_prev = s
            part = warpgroup_mma(w, b, part, use_acc=False, is_async=True)
        else:
            part = warpgroup_mma(w, b, part, is_async=True)
        part, w_prev, w = warpgroup_mma_wait(num_outstanding=1, deps=(part, w_prev, w))
        w_prev = w
        if RELEASE == 2:  # retire this sub-step's MMA now: its own stage is free
            part, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(part, w_prev))
            _release(empty.index(slot), RELEASE)
        elif FREE:  # sub-step u - 1's MMA retired (the wait above): its stage is free
            _release(empty.index((u + STAGES - 1) % STAGES), RELEASE)
        return acc, part, w_prev, s_prev

    @gluon.jit
    def _fp8_consumer(a_smem, w_smem, full, empty, s_ptr, c_ptr, tw_ptr, sorted_ptr, row0, e,
                      pid_n, N, K, num_pairs, c_stride, s_stride_e, s_stride_n,
                      MUL_W: gl.constexpr, BM: gl.constexpr, BLOCK_N: gl.constexpr,
                      NC: gl.constexpr, CW: gl.constexpr, G: gl.constexpr, KS: gl.constexpr,
                      STAGES: gl.constexpr, FENCE: gl.constexpr, SILU: gl.constexpr,
                      RELEASE: gl.constexpr):  # fmt: skip
        """Partition G: the shipped kernel's K loop for BN = BLOCK_N / NC rows (N tile
        pid_n * NC + G) on the ring, then its own epilogue."""
        BN: gl.constexpr = BLOCK_N // NC
        tile = pid_n * NC + G
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1],
                                                      instr_shape=[16, BM, 16])  # fmt: skip
        dl: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        sv: gl.constexpr = gl.SliceLayout(1, mma)
        r = gl.arange(0, BN, layout=sv)
        n_s, j_s, nok_s, up_s = _ws_rows(r, tile, N, BN, SILU)
        # the scale block of each row (SILU: the up half's blocks start at cdiv(N / 2, 128),
        # fp8_moe's up_s_row)
        srow = j_s // 128 + up_s * ((N // 2 + 127) // 128)
        s_ptrs = s_ptr + e * s_stride_e + srow * s_stride_n
        NSUB: gl.constexpr = 128 // KS
        NKB = K // 128
        gl.assume(NKB > 0)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        part = gl.zeros([BN, BM], gl.float32, layout=mma)
        w_prev = gl.zeros([BN, KS], gl.bfloat16, layout=dl)
        s_prev = gl.zeros([BN], gl.float32, layout=sv)
        s = gl.load(s_ptrs, mask=nok_s, other=0.0)  # block 0's [BN] fp32
        acc, part, w_prev, s_prev = _fp8_substep(0, 0, acc, part, w_prev, s, s_prev, a_smem,
                                                 w_smem, full, empty, G, BN, STAGES, dl, FENCE,
                                                 False, RELEASE)  # fmt: skip
        for j in gl.static_range(1, NSUB):
            acc, part, w_prev, s_prev = _fp8_substep(j, j, acc, part, w_prev, s, s_prev, a_smem,
                                                     w_smem, full, empty, G, BN, STAGES, dl,
                                                     FENCE, True, RELEASE)  # fmt: skip
        for kb in range(1, NKB):
            s = gl.load(s_ptrs + kb, mask=nok_s, other=0.0)
            for j in gl.static_range(NSUB):
                acc, part, w_prev, s_prev = _fp8_substep(kb * NSUB + j, j, acc, part, w_prev, s,
                                                         s_prev, a_smem, w_smem, full, empty, G,
                                                         BN, STAGES, dl, FENCE, True,
                                                         RELEASE)  # fmt: skip
        part, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(part, w_prev))
        acc = acc + part * gl.expand_dims(s_prev, 1)

        # epilogue in the MMA layout: c[pair, n] for the pairs' rows
        pair = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma)))
        pair_ok = gl.expand_dims(pair < num_pairs, 0)
        prow = gl.expand_dims(pair.to(gl.int64) * c_stride, 0)
        if SILU:  # fp8_moe's numerics: silu(gate) * up in fp32, one rounding
            off = prow + gl.expand_dims(j_s, 1)  # [BN, BM] (the up rows: unused)
            ok = pair_ok & gl.expand_dims(nok_s, 1)
            g, up = _il_halves(acc, BN, BM)
            off_g, _o = _il_halves(off, BN, BM)
            ok_g, _k = _il_halves(ok, BN, BM)
            out = (g / (1.0 + gl.exp(-g)) * up).to(c_ptr.dtype.element_ty)
            gl.store(c_ptr + off_g, out, mask=ok_g)
        else:
            out = acc
            if MUL_W:
                tw = gl.load(tw_ptr + pair, mask=pair < num_pairs, other=0.0)
                out = out * gl.expand_dims(tw, 0)
            ok = pair_ok & gl.expand_dims(nok_s, 1)
            gl.store(c_ptr + (prow + gl.expand_dims(n_s, 1)), out.to(c_ptr.dtype.element_ty),
                     mask=ok)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_pairs"])
    def _fp8_gemm_gluon_ws_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: gl.constexpr, MUL_W: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KS: gl.constexpr, STAGES: gl.constexpr,
        NC: gl.constexpr, CW: gl.constexpr, FENCE: gl.constexpr, SILU: gl.constexpr,
        PW: gl.constexpr, RELEASE: gl.constexpr, CREG: gl.constexpr, PREG: gl.constexpr,
    ):  # fmt: skip
        """The same operands and output as fp8_gemm_gluon._fp8_gemm_gluon_kernel (PROMOTE,
        CVT32, no TAIL): one aligned block of BLOCK_M pairs of one expert x BLOCK_N outputs,
        warp-specialized (module docstring)."""
        pid = gl.program_id(0)
        num_n = gl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if pid_m * BLOCK_M >= gl.load(npost_ptr):
            return
        e = gl.load(eid_ptr + pid_m).to(gl.int64)
        row0 = pid_m * BLOCK_M
        a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * KS),
                                                  element_bitwidth=16, rank=2)  # fmt: skip
        # the shipped kernel's weight swizzle (bank-conflict free operand loads)
        w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=128 // KS,
                                                     max_phase=KS // 16, order=[1, 0])  # fmt: skip
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, KS], a_sl)
        w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, KS], w_sl)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=32 * PW)
            mbarrier.init(empty.index(i), count=32 * CW * NC if RELEASE else NC)
        if NC == 2:
            gl.warp_specialize([
                (_fp8_consumer, (a_smem, w_smem, full, empty, s_ptr, c_ptr, tw_ptr, sorted_ptr,
                                 row0, e, pid_n, N, K, num_pairs, c_stride, s_stride_e,
                                 s_stride_n, MUL_W, BLOCK_M, BLOCK_N, NC, CW, 0, KS, STAGES,
                                 FENCE, SILU, RELEASE)),
                (_fp8_consumer, (a_smem, w_smem, full, empty, s_ptr, c_ptr, tw_ptr, sorted_ptr,
                                 row0, e, pid_n, N, K, num_pairs, c_stride, s_stride_e,
                                 s_stride_n, MUL_W, BLOCK_M, BLOCK_N, NC, CW, 1, KS, STAGES,
                                 FENCE, SILU, RELEASE)),
                (_fp8_producer, (a_ptr, w_ptr, sorted_ptr, row0, e, pid_n, N, K, num_pairs,
                                 a_stride, w_stride_e, w_stride_n, a_smem, w_smem, full, empty,
                                 A_DIV, BLOCK_M, BLOCK_N, NC, KS, STAGES, SILU, PW))],
                [4, PW], [CREG, PREG])  # fmt: skip
        else:
            gl.warp_specialize([
                (_fp8_consumer, (a_smem, w_smem, full, empty, s_ptr, c_ptr, tw_ptr, sorted_ptr,
                                 row0, e, pid_n, N, K, num_pairs, c_stride, s_stride_e,
                                 s_stride_n, MUL_W, BLOCK_M, BLOCK_N, NC, CW, 0, KS, STAGES,
                                 FENCE, SILU, RELEASE)),
                (_fp8_producer, (a_ptr, w_ptr, sorted_ptr, row0, e, pid_n, N, K, num_pairs,
                                 a_stride, w_stride_e, w_stride_n, a_smem, w_smem, full, empty,
                                 A_DIV, BLOCK_M, BLOCK_N, NC, KS, STAGES, SILU, PW))],
                [PW], [PREG])  # fmt: skip


def launch_fp8_ws(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, cfg):
    """The WS kernel's launch (for fp8_gemm_gluon.gemm_fp8_gluon: its operands, cfg with every
    CONFIG_KEYS key, SILU set): the shipped kernel's grid, num_warps the default partition's,
    maxnreg `ws_regs` over this ring's shared memory."""
    fp8_ws_check(cfg)
    if a.shape[0] * a.stride(0) >= 2**31:
        raise ValueError("gluon fp8 GEMM WS: activations over 2^31 elements (int32 offsets)")
    maxnreg, creg, preg = ws_regs(cfg, fp8_ws_smem_bytes(cfg))
    nc, cw = ws_split(cfg)
    grid = (eids.shape[0] * -(-N // cfg["BLOCK_N"]),)
    _fp8_gemm_gluon_ws_kernel[grid](
        a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a.stride(0), c.stride(0), w.stride(0),
        w.stride(1), s.stride(0), s.stride(1), A_DIV=a_div, MUL_W=mul_w,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], KS=cfg["KS"], STAGES=cfg["STAGES"],
        NC=nc, CW=cw, FENCE=bool(cfg.get("FENCE")), SILU=bool(cfg["SILU"]),
        PW=cfg.get("PW", 4), RELEASE=cfg.get("RELEASE", 1), CREG=creg, PREG=preg,
        num_warps=cw, maxnreg=maxnreg,
    )  # fmt: skip
