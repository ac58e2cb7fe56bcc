# ruff: noqa: E741
"""The warp-specialized variant of the Gluon INT4 grouped GEMM (int4_gemm_gluon.py, config key
WS=1 or 2): a producer partition streams the sub-steps into a ring of mbarrier-guarded stages, the
consumer warpgroups dequantize and issue their wgmmas each at its own pace.

Owns: `_int4_gemm_gluon_ws_kernel` (launched by int4_gemm_gluon.gemm_gluon when cfg["WS"]),
`launch_ws`, `ws_smem_bytes`, `ws_check`, `ws_split` (consumer partitions), `ws_regs`
(registers).

Why: Nsight Compute on the H100 (benchmarks/RESULTS.md, "Where the MoE kernels lose") put the
shipped kernel's 8K gate_up at ~50% tensor pipe with both warpgroups in lockstep: long
scoreboard on the ring's data (the cp.async ring runs 2 sub-steps ahead), two CTA-wide barriers
per sub-step, wgmma dispatch stalls. Here nothing in the main loop is CTA-wide: one warpgroup
may dequantize while the other's wgmmas run (WS=2: ping-pong may emerge), and the producer
refills a stage as soon as every consumer thread released it, independently of the consumers'
pace (STAGES - 2 sub-steps ahead of the one being dequantized; the stages are 52 KB at
128x256, 36 KB at 64x256: 4 and 6 of them fit).

Partitions (`gl.warp_specialize`; the launch's num_warps is the default partition's, CW):
- consumers: NC partitions of CW warps (`ws_split`: WS=1 one of cfg num_warps, WS=2 one per
  warpgroup; the default partition is number 0, the others workers). Partition g owns
  BLOCK_N / NC weight rows: it runs exactly what
  the shipped kernel's tile of BN = BLOCK_N / NC rows and N-tile pid_n * NC + g runs (`_rows`,
  the same dequant functions `_plane` / `_plane_pair_bf16x2`, the same plane order, the same
  wgmma waits), so every output element is the same fp32 sum in the same order: the output is
  bit-identical to the shipped kernel's (the SILU tiles: a warpgroup holds BN / 2 gate rows and
  the same up rows, so its epilogue needs nobody else's accumulators).
  Per sub-step u: wait full[u % STAGES] (phase (u // STAGES) & 1), load the stage's scale words
  and words (ld.shared), dequantize a plane pair, issue, wait as INFLIGHT says; at the end of
  sub-step u (its first wait retired sub-step u - 1's last MMAs) release stage u - 1:
  RELEASE=1 (default) every consumer thread's `cp.async.mbarrier.arrive.noinc` on
  empty[(u - 1) % STAGES] (count: the consumer threads; they have no copies in flight, so it
  is a plain arrive of each thread after its own reads: no barrier), RELEASE=0 Gluon's
  `mbarrier.arrive` (one thread, with two partition-wide barriers Triton puts around it).
  Placed between the wgmmas instead (right after the first wait) the arrive makes ptxas
  serialize every wgmma (C7513); at the end it does not, and the ring still runs STAGES - 2
  sub-steps ahead of the one being dequantized. RELEASE=2: each sub-step ends with a
  wait for all its MMAs and releases its own stage (STAGES - 1 ahead; the warpgroup's
  pipeline drains once a sub-step, which the other warpgroup's MMAs may fill with WS=2).
  WS=1: one consumer partition of num_warps (SASS: one partition barrier a sub-step, Triton's,
  before the full wait); WS=2: one partition per warpgroup (that barrier is the warpgroup's
  own, 128 threads: nothing shared between the warpgroups in the loop).
- producer: PW warps (1 or 4, PREG registers). For each sub-step: wait empty (the first round
  passes: a fresh mbarrier's preceding phase counts as complete), cp.async the stage (the 8
  activation planes: a gather by sorted pair rows; the words and scales of all NC warpgroups'
  rows), then `cp.async.mbarrier.arrive.noinc` on full: the barrier completes when every
  producer thread's copies landed (count 32 * PW). The pointers are rebuilt from int32
  offsets each sub-step (few registers kept alive; 64-bit bases are scalars).
No proxy fence by default (as the shipped kernel; FENCE=True: a fence.proxy.async in the
consumers after the full wait, cheap there: they have no copies in flight).

Epilogue: straight from the MMA layout (no layout conversion: its shared-memory scratch would
sit beside the ring, which lives until every partition is done).

Registers: setmaxnreg per warpgroup; the launch's maxnreg (MAXNREG, default `ws_regs`: 65536
over the warpgroups of as many CTAs as the shared memory holds, e.g. 168 for 3 warpgroups)
times the warpgroups is the pool, workers get CREG / PREG, the default partition the rest.

Invariants: as int4_gemm_gluon (Hopper, Triton 3.6 Gluon, group 32, K % (16 W2) == 0); NC in
1..2, BLOCK_N / NC a multiple of 64, no TAIL, no KW (ws_check). No host sync; CUDA-graph safe.
"""

from __future__ import annotations

from ._gluon import (
    HAS_GLUON,
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma_wait,
)

WS_DEFAULTS = dict(PW=4, PREG=0, CREG=0, RELEASE=1)  # P/CREG 0: the defaults (`ws_regs`)
PREG_DEFAULT = 56


def ws_smem_bytes(cfg: dict) -> int:
    """Shared memory of the WS ring: STAGES x (activation planes, words, scale words) + 2
    mbarriers a stage."""
    bm, bn, w2, st = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["W2"], cfg["STAGES"]
    return st * (8 * bm * w2 * 2 + bn * w2 * 4 + bn * (w2 // 4) * 4 + 16)


def ws_split(cfg: dict) -> tuple[int, int]:
    """(NC consumer partitions, CW warps each): WS=1 one partition of num_warps (its
    warpgroups meet at one partition barrier a sub-step, before the release), WS=2 one
    partition per warpgroup (each at its own pace; ptxas serializes their wgmmas, C7512)."""
    nw = cfg["num_warps"]
    return (nw // 4, 4) if cfg.get("WS") == 2 else (1, nw)


def ws_regs(cfg: dict, smem: int | None = None) -> tuple[int, int, int]:
    """(maxnreg of the launch, the worker consumers' registers, the producer's): as many CTAs
    an SM as the shared memory holds (at most 2; smem: a CTA's ring, default this kernel's
    `ws_smem_bytes`; the FP8 WS kernel passes its own), the registers split evenly among their
    warpgroups at launch; the default partition gets maxnreg * warpgroups - the workers'."""
    wgs = cfg["num_warps"] // 4 + 1
    smem = ws_smem_bytes(cfg) if smem is None else smem
    ctas = max(1, min(2, 232448 // (smem + 1024)))
    maxnreg = cfg.get("MAXNREG") or min(256, (65536 // (wgs * 128 * ctas)) // 8 * 8)
    preg = cfg.get("PREG") or PREG_DEFAULT
    nc = ws_split(cfg)[0]
    creg = cfg.get("CREG") or min(256, ((maxnreg * wgs - preg) // nc) // 8 * 8)
    return maxnreg, creg, preg


def ws_check(cfg: dict) -> None:
    """Raise ValueError for a config the WS kernel cannot take."""
    nw, bn = cfg["num_warps"], cfg["BLOCK_N"]
    nc, cw = ws_split(cfg) if nw in (4, 8) else (1, 4)
    if nw not in (4, 8) or cfg.get("WS") not in (True, 1, 2) or (bn // nc) % (16 * cw):
        raise ValueError(f"gluon int4 GEMM WS: WS 1 or 2, num_warps={nw} (4 or 8) and BLOCK_N="
                         f"{bn} a multiple of 16 * num_warps")  # fmt: skip
    if cfg.get("SILU") and (bn // nc) % (32 * cw):  # the gate / up halves in the same threads
        raise ValueError(f"gluon int4 GEMM WS: SILU needs BLOCK_N={bn} a multiple of 32 * "
                         f"num_warps")  # fmt: skip
    if cfg.get("TAIL") or cfg.get("KW"):
        raise ValueError("gluon int4 GEMM WS: no TAIL or KW")
    if cfg.get("PW", 1) not in (1, 4) or cfg["STAGES"] < 2:
        raise ValueError("gluon int4 GEMM WS: PW must be 1 or 4 and STAGES >= 2")
    if ws_smem_bytes(cfg) > 227 * 1024:
        raise ValueError(f"gluon int4 GEMM WS: {ws_smem_bytes(cfg)} B of shared memory")
    maxnreg, creg, preg = ws_regs(cfg)
    if preg < 24 or maxnreg * (nw // 4 + 1) * 128 > 65536:
        raise ValueError(f"gluon int4 GEMM WS: registers {maxnreg}/{creg}/{preg} do not fit")


if HAS_GLUON:
    from .int4_gemm_gluon_parts import (
        _out_cols,
        _plane_mma,
        _rows,
        _split_cols,
    )

    @gluon.jit
    def _ws_producer(a_ptr, w_ptr, s_ptr, sorted_ptr, row0, e, pid_n, N, K, num_pairs, a_stride,
                     w_stride_e, w_stride_n, s_stride_e, s_stride_n, a_smem, w_smem, s_smem,
                     full, empty, A_DIV: gl.constexpr, BM: gl.constexpr, BLOCK_N: gl.constexpr,
                     NC: gl.constexpr, W2: gl.constexpr, STAGES: gl.constexpr, L1: gl.constexpr,
                     SILU: gl.constexpr, PW: gl.constexpr):  # fmt: skip
        """cp.async every sub-step into the ring: wait its stage empty, copy, arrive on full
        when the copies land (`cp.async.mbarrier.arrive.noinc`)."""
        BN: gl.constexpr = BLOCK_N // NC
        la: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (W2 // 8), W2 // 8], [PW, 1], [1, 0])
        VW: gl.constexpr = 2 if L1 else 4
        lw: gl.constexpr = gl.BlockedLayout([1, VW], [32 // (W2 // VW), W2 // VW], [PW, 1],
                                            [1, 0])  # fmt: skip
        ls: gl.constexpr = gl.BlockedLayout([1, W2 // 4 // (1 + L1)], [32 // (1 + L1), 1 + L1],
                                            [PW, 1], [1, 0])  # fmt: skip
        # activation planes [8 * BM, W2]: row q = plane q // BM of pair q % BM (int32 offsets)
        q_a = gl.arange(0, 8 * BM, layout=gl.SliceLayout(1, la))
        pair_a = gl.load(sorted_ptr + row0 + q_a % BM)
        rows = gl.where(pair_a < num_pairs, pair_a // A_DIV, 0)
        c_a = gl.arange(0, W2, layout=gl.SliceLayout(0, la))
        a_off = gl.expand_dims(rows * a_stride + (q_a // BM) * W2, 1) + gl.expand_dims(c_a, 0)
        a_ok = gl.expand_dims(pair_a < num_pairs, 1) & gl.expand_dims(c_a >= 0, 0)
        # words [BLOCK_N, W2]: warpgroup r // BN's rows (its N tile pid_n * NC + r // BN)
        r_w = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lw))
        n_w, nok_w = _rows(r_w % BN, pid_n * NC + r_w // BN, N, BN, SILU)
        c_w = gl.arange(0, W2, layout=gl.SliceLayout(0, lw))
        w_off = gl.expand_dims(n_w * w_stride_n, 1) + gl.expand_dims((c_w // 4) * 8 + c_w % 4, 0)
        w_ok = gl.expand_dims(nok_w, 1) & gl.expand_dims(c_w >= 0, 0)
        r_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ls))
        n_s, nok_s = _rows(r_s % BN, pid_n * NC + r_s // BN, N, BN, SILU)
        c_s = gl.arange(0, W2 // 4, layout=gl.SliceLayout(0, ls))
        s_off = gl.expand_dims(n_s * s_stride_n, 1) + gl.expand_dims(c_s, 0)
        s_ok = gl.expand_dims(nok_s, 1) & gl.expand_dims(c_s >= 0, 0)
        w_base = w_ptr + e * w_stride_e
        s_base = s_ptr + e * s_stride_e
        CM: gl.constexpr = ".ca" if L1 else ""
        NU = K // (8 * W2)
        gl.assume(NU > 0)
        for u in range(NU):
            slot = u % STAGES
            mbarrier.wait(empty.index(slot), ((u // STAGES) & 1) ^ 1)
            ks = u // 2
            async_copy.async_copy_global_to_shared(a_smem.index(slot), a_ptr + (a_off + u * 8 * W2),
                                                   mask=a_ok)  # fmt: skip
            async_copy.async_copy_global_to_shared(w_smem.index(slot),
                                                   w_base + (w_off + (ks * 2 * W2 + (u % 2) * 4)),
                                                   mask=w_ok, cache_modifier=CM)  # fmt: skip
            async_copy.async_copy_global_to_shared(s_smem.index(slot),
                                                   s_base + (s_off + ks * (W2 // 4)), mask=s_ok,
                                                   cache_modifier=CM)  # fmt: skip
            async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
        async_copy.wait_group(0)

    @gluon.jit
    def _halves(x, BN: gl.constexpr, BM: gl.constexpr):
        """x [BN, BM] in the MMA layout -> its rows :BN/2 and BN/2: (the same threads: the
        64-row repeat is a register basis), no data moves."""
        x3 = gl.permute(gl.reshape(x, [2, BN // 2, BM]), (1, 2, 0))
        return gl.split(x3)

    @gluon.jit
    def _release(bar, RELEASE: gl.constexpr):
        """Free a stage: RELEASE 0: Gluon's arrive (one thread, after Triton's partition
        barrier), 1 / 2: every consumer thread's cp.async.mbarrier.arrive.noinc (it has no
        copies in flight: an arrive of its own, no barrier; the count is the consumer
        threads)."""
        if RELEASE:
            async_copy.mbarrier_arrive(bar, increment_count=False)
        else:
            mbarrier.arrive(bar)

    @gluon.jit
    def _ws_substep(u, acc, w_p0, w_p1, a_smem, w_smem, s_smem, full, empty, BM: gl.constexpr,
                    BN: gl.constexpr, G: gl.constexpr, W2: gl.constexpr, STAGES: gl.constexpr,
                    BF16X2: gl.constexpr, INFLIGHT: gl.constexpr, FENCE: gl.constexpr,
                    dl: gl.constexpr, l3: gl.constexpr, sl: gl.constexpr, FREE: gl.constexpr,
                    RELEASE: gl.constexpr):  # fmt: skip
        """Sub-step u of a consumer (the shipped kernel's loop body on ring stage u % STAGES):
        wait its full barrier, dequantize and issue its 8 planes; FREE: release stage u - 1
        once its last MMAs retired (the first wait here)."""
        slot = u % STAGES
        mbarrier.wait(full.index(slot), (u // STAGES) & 1)
        if FENCE:
            fence_async_shared()
        acc, w_p0, w_p1 = _plane_mma(u, acc, w_p0, w_p1, s_smem, slot, w_smem, slot, a_smem, slot,
                                     G * BN, BM, BN, W2, BF16X2, INFLIGHT, dl, l3,
                                     sl)  # fmt: skip
        if RELEASE == 2:  # retire this sub-step's MMAs now: its own stage is free
            acc, w_p0, w_p1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_p0, w_p1))
            _release(empty.index(slot), RELEASE)
        elif FREE:  # sub-step u - 1's last MMAs retired (the first wait above): its stage is free
            _release(empty.index((u + STAGES - 1) % STAGES), RELEASE)
        return acc, w_p0, w_p1

    @gluon.jit
    def _ws_consumer(a_smem, w_smem, s_smem, full, empty, c_ptr, tw_ptr, sorted_ptr, row0, pid_n,
                     N, K, num_pairs, c_stride, MUL_W: gl.constexpr, PERM_OUT: gl.constexpr,
                     BM: gl.constexpr, BLOCK_N: gl.constexpr, NC: gl.constexpr, CW: gl.constexpr,
                     G: gl.constexpr,
                     W2: gl.constexpr, STAGES: gl.constexpr, BF16X2: gl.constexpr,
                     INFLIGHT: gl.constexpr, FENCE: gl.constexpr, SILU: gl.constexpr,
                     RELEASE: gl.constexpr):  # fmt: skip
        """Warpgroup G: the shipped kernel's K loop for BN = BLOCK_N / NC rows (N tile
        pid_n * NC + G), the stages guarded by full / empty, then its own epilogue."""
        BN: gl.constexpr = BLOCK_N // NC
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1],
                                                      instr_shape=[16, BM, 16])  # fmt: skip
        dl: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        l3: gl.constexpr = _split_cols(gl.to_linear_layout(dl, [BN, W2]), BN, W2)
        sl: gl.constexpr = gl.SliceLayout(2, l3)
        NU = K // (8 * W2)
        gl.assume(NU > 0)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        w_p0 = gl.zeros([BN, W2], gl.bfloat16, layout=dl)
        w_p1 = gl.zeros([BN, W2], gl.bfloat16, layout=dl)
        gl.assume(NU > 1)  # (K % (16 W2) == 0: NU even)
        acc, w_p0, w_p1 = _ws_substep(0, acc, w_p0, w_p1, a_smem, w_smem, s_smem, full, empty,
                                      BM, BN, G, W2, STAGES, BF16X2, INFLIGHT, FENCE, dl, l3, sl,
                                      False, RELEASE)  # fmt: skip
        for u in range(1, NU):
            acc, w_p0, w_p1 = _ws_substep(u, acc, w_p0, w_p1, a_smem, w_smem, s_smem, full,
                                          empty, BM, BN, G, W2, STAGES, BF16X2, INFLIGHT, FENCE,
                                          dl, l3, sl, True, RELEASE)  # fmt: skip
        acc, w_p0, w_p1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_p0, w_p1))

        # epilogue in the MMA layout: c[pair, n] for the pairs' rows
        tile = pid_n * NC + G
        r = gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
        pair = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma)))
        pair_ok = gl.expand_dims(pair < num_pairs, 0)
        prow = gl.expand_dims(pair.to(gl.int64) * c_stride, 0)
        if SILU:
            HN: gl.constexpr = BN // 2
            j = tile * HN + r % HN
            off = prow + gl.expand_dims(_out_cols(j, W2), 1)  # [BN, BM] (the up half: unused)
            ok = pair_ok & gl.expand_dims(j < N // 2, 1)
            g, up = _halves(acc, BN, BM)
            off_g, _o = _halves(off, BN, BM)
            ok_g, _k = _halves(ok, BN, BM)
            g = g.to(gl.bfloat16).to(gl.float32)
            up = up.to(gl.bfloat16).to(gl.float32)
            sg = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
            gl.store(c_ptr + off_g, (sg * up).to(c_ptr.dtype.element_ty), mask=ok_g)
        else:
            n = tile * BN + r
            out = acc
            if MUL_W:
                tw = gl.load(tw_ptr + pair, mask=pair < num_pairs, other=0.0)
                out = out * gl.expand_dims(tw, 0)
            cols = _out_cols(n, W2 if PERM_OUT else 0)
            ok = pair_ok & gl.expand_dims(n < N, 1)
            gl.store(c_ptr + (prow + gl.expand_dims(cols, 1)), out.to(c_ptr.dtype.element_ty),
                     mask=ok)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _int4_gemm_gluon_ws_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr, unit_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        num_blocks,
        A_DIV: gl.constexpr, MUL_W: gl.constexpr, PERM_OUT: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, W2: gl.constexpr, STAGES: gl.constexpr,
        NC: gl.constexpr, CW: gl.constexpr, BF16X2: gl.constexpr, INFLIGHT: gl.constexpr,
        FENCE: gl.constexpr, L1: gl.constexpr, SILU: gl.constexpr, PW: gl.constexpr,
        RELEASE: gl.constexpr, CREG: gl.constexpr,
        PREG: gl.constexpr,
    ):  # fmt: skip
        """The same operands and output as int4_gemm_gluon._int4_gemm_gluon_kernel (no TAIL):
        one aligned block of BLOCK_M pairs of one expert x BLOCK_N outputs, warp-specialized
        (module docstring)."""
        pid = gl.program_id(0)
        num_n = gl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if pid_m * BLOCK_M >= gl.load(npost_ptr):
            return
        e = gl.load(eid_ptr + pid_m).to(gl.int64)
        row0 = pid_m * BLOCK_M
        a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * W2, element_bitwidth=16,
                                                  rank=2)  # fmt: skip
        w_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=W2 // 4,
                                                     order=[1, 0])  # fmt: skip
        s_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                     order=[1, 0])  # fmt: skip
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 8 * BLOCK_M, W2], a_sl)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W2], w_sl)
        s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, W2 // 4], s_sl)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=32 * PW)
            mbarrier.init(empty.index(i), count=32 * CW * NC if RELEASE else NC)
        if NC == 2:
            gl.warp_specialize([
                (_ws_consumer, (a_smem, w_smem, s_smem, full, empty, c_ptr, tw_ptr, sorted_ptr,
                                row0, pid_n, N, K, num_pairs, c_stride, MUL_W, PERM_OUT, BLOCK_M,
                                BLOCK_N, NC, CW, 0, W2, STAGES, BF16X2, INFLIGHT, FENCE, SILU,
                                RELEASE)),
                (_ws_consumer, (a_smem, w_smem, s_smem, full, empty, c_ptr, tw_ptr, sorted_ptr,
                                row0, pid_n, N, K, num_pairs, c_stride, MUL_W, PERM_OUT, BLOCK_M,
                                BLOCK_N, NC, CW, 1, W2, STAGES, BF16X2, INFLIGHT, FENCE, SILU,
                                RELEASE)),
                (_ws_producer, (a_ptr, w_ptr, s_ptr, sorted_ptr, row0, e, pid_n, N, K, num_pairs,
                                a_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n, a_smem,
                                w_smem, s_smem, full, empty, A_DIV, BLOCK_M, BLOCK_N, NC, W2,
                                STAGES, L1, SILU, PW))], [4, PW], [CREG, PREG])  # fmt: skip
        else:
            gl.warp_specialize([
                (_ws_consumer, (a_smem, w_smem, s_smem, full, empty, c_ptr, tw_ptr, sorted_ptr,
                                row0, pid_n, N, K, num_pairs, c_stride, MUL_W, PERM_OUT, BLOCK_M,
                                BLOCK_N, NC, CW, 0, W2, STAGES, BF16X2, INFLIGHT, FENCE, SILU,
                                RELEASE)),
                (_ws_producer, (a_ptr, w_ptr, s_ptr, sorted_ptr, row0, e, pid_n, N, K, num_pairs,
                                a_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n, a_smem,
                                w_smem, s_smem, full, empty, A_DIV, BLOCK_M, BLOCK_N, NC, W2,
                                STAGES, L1, SILU, PW))], [PW], [PREG])  # fmt: skip


def launch_ws(a, w, s32, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, perm_out, cfg,
              carveout):  # fmt: skip
    """The WS kernel's launch (for int4_gemm_gluon.gemm_gluon: its operands, cfg with every
    CONFIG_KEYS key): the shipped kernel's grid, num_warps the default partition's, maxnreg
    `ws_regs`; carveout(function, shared, registers of a CTA) for L1 / CARVE."""
    if a.shape[0] * a.stride(0) >= 2**31:
        raise ValueError("gluon int4 GEMM WS: activations over 2^31 elements (int32 offsets)")
    maxnreg, creg, preg = ws_regs(cfg)
    nc, cw = ws_split(cfg)
    cfg.pop("num_warps")
    carve = cfg.pop("CARVE") or cfg["L1"]
    for key in ("MAXNREG", "TAIL", "KW", "PREG", "CREG", "WS"):
        cfg.pop(key)
    grid = (eids.shape[0] * -(-N // cfg["BLOCK_N"]),)
    k = _int4_gemm_gluon_ws_kernel[grid](
        a, w, s32, c, tw, sorted_ids, eids, npost, eids, N, K, M, a.stride(0), c.stride(0),
        w.stride(0), w.stride(1), s32.stride(0), s32.stride(1), eids.shape[0], A_DIV=a_div,
        MUL_W=mul_w, PERM_OUT=perm_out, NC=nc, CW=cw, CREG=creg, PREG=preg, num_warps=cw,
        maxnreg=maxnreg, **cfg,
    )  # fmt: skip
    if carve and getattr(k, "function", None):
        carveout(int(k.function), int(k.metadata.shared), maxnreg * (nc * cw // 4 + 1) * 128)
