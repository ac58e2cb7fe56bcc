"""INT4 W4A16 routed experts for decode-sized batches on tensor cores ("swap-AB", Marlin style).

Owns: `int4_moe_mma` (the routed-expert output: a gate_up launch with SiLU(gate) * up in its
epilogue, a down launch with the top-k weight applied and the top-k sum), `to_plane_order`
(the activation layout the kernel reads), `MMA_CONFIG` (a default config) and `_int4_mma_kernel`.

Why: at T = 32..256 tokens x top-8 each hit expert gets ~1.3-5.4 (token, expert) pairs. The
grouped CUDA-core GEMV (int4_gemv.py) reads as many activation bytes (from L2) as weight bytes
per program (4 rows x 16 weight rows) and does the products on CUDA cores (55% of the copy
bandwidth at T=128 uniform). Here one program
takes one aligned block of an expert's pairs (moe_align_block_size, BLOCK_M rows, padding rows
masked) and BLOCK_N weight rows: the weights are the MMA's M side and the few tokens its N
side (SWAP=1, `tl.dot(w [BLOCK_N, KW], x^T [KW, BLOCK_M])`), so a weight tile is read once per
block and the activation bytes per weight byte fall with BLOCK_N. SWAP=0 runs the same tiles the
other way round (`tl.dot(x [BLOCK_M, KW], w^T [KW, BLOCK_N])`: Triton's mma.sync form at any
BLOCK_N / num_warps); the sweep (benchmarks/decode_mma.py) picks.

Dequant (plain `tl`, elementwise only, so Triton keeps the tile in the MMA's register operand):
a K step is 16 KW columns, two [BLOCK_N, KW] word tiles (the even and the odd groups' words);
nibble plane J of a tile is one MMA of K = KW against KW activation columns, which
`to_plane_order` makes contiguous. A plane is one and/or (the nibble into a float's mantissa:
2^E + n), one FMA with the word's group scale ((2^E + n) s - (2^E + 8) s = (n - 8) s, exact),
one rounding to bf16. Scales are read as int32 pairs (groups 2h, 2h + 1 of a row).

Status: measured, not dispatched. Two H100 sweeps (benchmarks/decode_mma.py, one K2 layer,
RESULTS.md "INT4 decode MoE on tensor cores"): the best config (16x32, SWAP=0, 3 stages) reads
at 47-51% of the copy bandwidth for every T and routing; at T=128 uniform 6.01 ms against the
grouped GEMV's 5.63 (0.94x), at T >= 192 1.01-1.05x the Gluon INT4 GEMM (within the noise).
Every config sat at 40-51% whatever its tile, so the limit is per weight byte, not the routing;
wgmma forms (SWAP=1, BLOCK_N >= 64) were 15-20% slower than the mma.sync form (Triton 3.6 waits
for each register-operand wgmma before the next plane).

The f16 design (config F16=1, kernels/int4_moe_mma16.py): Marlin's dequant and the group
scale once per group, ~2.2 SASS instructions a weight against this design's ~5.

Layout: compressed-tensors words w int32 [E, N, K/8] (nibble j of word i = column 8i + j,
value + 8), scales bf16 [E, N, K/32]; w13 rows: gate (0..I-1) then up (I..2I-1).

Invariants: group 32; K (hidden and intermediate) multiples of 16 KW (KW >= 16: a bf16 MMA's
K); ETAB=2 needs scales >= 0 (symmetric quantization); fp32 accumulation; no host
synchronisation (the grid is bounded on the host by `max_blocks`), so CUDA-graph safe;
`active` [1] int32 0: every program returns at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton
from .int4_moe_mma16 import check_f16, launch_f16
from .moe_align import moe_align_block_size

# the fastest tile of the H100 sweeps (16x32 mma.sync, 3 stages), with ETAB=0 so that it takes
# any scales (measured with ETAB=2, which was 2-5% faster on the 16x64 tile)
MMA_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, KW=16, SWAP=0, ATOMIC=0, ETAB=0, SPLIT=0, num_warps=4,
                  num_stages=3)  # fmt: skip
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "KW", "SWAP", "ATOMIC", "ETAB", "SPLIT", "num_warps",
               "num_stages", "maxnreg", "F16", "G", "PF")  # fmt: skip
# F16=1: the f16 design of int4_moe_mma16.py (its keys: BLOCK_M, BLOCK_N, G groups a K step,
# SWAP, ATOMIC, num_warps, num_stages, maxnreg); these defaults for the keys a config leaves out
# (16 pairs x 64 weight rows, weights as the MMA's M, two warps, 4 groups a K step, L2 prefetch
# 2 steps ahead: the fastest F16 tile of the H100 sweeps, T=128 uniform 4.69 ms = 63% of copy
# bw; kernels/configs/h100.json)
F16_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, G=4, SWAP=1, ATOMIC=0, num_warps=2, num_stages=3, PF=2)

if HAS_TRITON:

    @triton.jit
    def _plane(p, s, c15, c11, J: tl.constexpr, ex, s16, ETAB: tl.constexpr):
        """Nibble plane J of words p as (n - 8) * s in float32: the nibble moved to mantissa
        bits 8-11 (J even) or 12-15 (J odd) of 2^15 / 2^11 (and, or), one FMA with
        c = -(2^E + 8) s (exact). ETAB > 0: the exponent bits come from ex, a register tile
        (ptxas then makes the and + or one LOP3 with an immediate and a register; two
        immediates take two), and the odd planes read 2^15 + 16 n times s / 16. ex must come
        from a pipelined load: a kernel argument or a loop-invariant tile would stop Triton 3.6
        from hoisting the chain into the MMA's register operand (every plane then goes through
        shared memory: seen in the sm_90 SASS). ETAB=1 loads it from a table (every program
        reads the same 64 bytes: an L2 hot spot, 1.3x slower on the H100); ETAB=2 makes it
        from the scale pair (its sign bit, 0 for the scales >= 0 of symmetric quantization)."""
        if J < 2:
            r = p << 8
        elif J < 4:
            r = p
        elif J < 6:
            r = p >> 8
        else:
            r = p >> 16
        if ETAB:  # one exponent (2^15) from a register: and + or in one LOP3
            if J % 2 == 0:
                bits = (r & 0xF00) | ex
                return tl.fma(bits.to(tl.float32, bitcast=True), s, c15)
            else:  # nibble at bits 12-15: 2^15 + 16 n, times s / 16
                bits = (r & 0xF000) | ex
                return tl.fma(bits.to(tl.float32, bitcast=True), s16, c11)
        if J % 2 == 0:
            bits = (r & 0xF00) | (142 << 23)
            return tl.fma(bits.to(tl.float32, bitcast=True), s, c15)
        else:
            bits = (r & 0xF000) | (138 << 23)
            return tl.fma(bits.to(tl.float32, bitcast=True), s, c11)

    @triton.jit
    def _planes_dot(acc, p, s, a_ptrs, a_ok, KW: tl.constexpr, SWAP: tl.constexpr,
                    DOT_DT: tl.constexpr, ex, ETAB: tl.constexpr):  # fmt: skip
        """acc += the 8 nibble planes of words p (group scales s, fp32) times the activation
        tiles a_ptrs + J * KW (KW columns each, plane order; a_ok: the block's real rows)."""
        c15 = s * -32776.0  # -(2^15 + 8) * s
        c11 = s * -2056.0  # -(2^11 + 8) * s
        s16 = s * 0.0625
        for J in tl.static_range(8):
            a = tl.load(a_ptrs + J * KW, mask=a_ok, other=0.0).to(DOT_DT)
            w = _plane(p, s, c15, c11, J, ex, s16, ETAB).to(tl.bfloat16).to(DOT_DT)
            if SWAP:
                acc = tl.dot(w, a, acc)
            else:
                acc = tl.dot(a, w, acc)
        return acc

    @triton.jit
    def _int4_mma_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr, ex_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        ex_step, A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr,
        OUT_DIV: tl.constexpr, ATOMIC: tl.constexpr, PERM_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, KW: tl.constexpr, SWAP: tl.constexpr, DOT_DT: tl.constexpr,
        ETAB: tl.constexpr,
    ):  # fmt: skip
        """One aligned block of BLOCK_M pairs of expert e x BLOCK_N weight rows n:
        acc[m, n] = sum_k a[pair_m // A_DIV, k] W_e[n, k] (a in plane order). A K step is
        16 KW columns: two [BLOCK_N, KW] word tiles, the words of the even groups and of the
        odd groups (tile column c = group pair c // 4, word c % 4), so that every word of a
        tile takes the same half of its int32 scale pair (s_ptr: the bf16 scales as int32).
        GATED: rows n (gate) and N + n (up), stores silu(gate) * up as bf16, columns in plane
        order for a down launch of KW = PERM_OUT. Else times tw[pair] (MUL_W) and, ATOMIC,
        added to c[pair // OUT_DIV] (float32), or stored to c[pair]. Padding rows read nothing
        and store nothing; blocks past the rows in use return at once."""
        pid = tl.program_id(0)
        nbn = tl.cdiv(N, BLOCK_N)
        pid_m = pid // nbn
        pid_n = pid % nbn
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        ok = pair < num_pairs
        rows = tl.where(ok, pair // A_DIV, 0).to(tl.int64)
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c = tl.arange(0, KW)
        if SWAP:  # weight tiles [BLOCK_N, KW], activation tiles [KW, BLOCK_M]
            nn = offs_n[:, None]
            cc = c[None, :]
            a_ptrs = a_ptr + rows[None, :] * a_stride + c[:, None]
            a_ok = ok[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:  # weight tiles [KW, BLOCK_N], activation tiles [BLOCK_M, KW]
            nn = offs_n[None, :]
            cc = c[:, None]
            a_ptrs = a_ptr + rows[:, None] * a_stride + c[None, :]
            a_ok = ok[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        n_ok = nn < N
        w_ptrs = w_ptr + e * w_stride_e + nn * w_stride_n + (cc // 4) * 8 + cc % 4
        s_ptrs = s_ptr + e * s_stride_e + nn * s_stride_n + cc // 4
        u_off = N * w_stride_n
        us_off = N * s_stride_n
        acc_u = acc
        ex_ptrs = ex_ptr + cc + nn * 0  # [BN, KW] / [KW, BN] of 142 << 23 (2^15's bits)
        for it in range(0, K // (16 * KW)):
            # ex_step is 0: an address that moves with the loop (for the compiler) keeps the
            # load pipelined like the words, so the dequant chain stays hoistable
            ex = tl.load(ex_ptrs + it * ex_step) if ETAB == 1 else cc
            sp = tl.load(s_ptrs, mask=n_ok, other=0)
            if ETAB == 2:  # from the scale pair: scales >= 0, so its sign bit is 0
                ex = (sp >> 31) | (142 << 23)
            acc = _planes_dot(acc, tl.load(w_ptrs, mask=n_ok, other=0),
                              (sp << 16).to(tl.float32, bitcast=True), a_ptrs, a_ok,
                              KW, SWAP, DOT_DT, ex, ETAB)  # fmt: skip
            acc = _planes_dot(acc, tl.load(w_ptrs + 4, mask=n_ok, other=0),
                              (sp & -65536).to(tl.float32, bitcast=True),
                              a_ptrs + 8 * KW, a_ok, KW, SWAP, DOT_DT, ex, ETAB)  # fmt: skip
            if GATED:
                su = tl.load(s_ptrs + us_off, mask=n_ok, other=0)
                if ETAB == 2:
                    ex = (su >> 31) | (142 << 23)
                acc_u = _planes_dot(acc_u, tl.load(w_ptrs + u_off, mask=n_ok, other=0),
                                    (su << 16).to(tl.float32, bitcast=True), a_ptrs,
                                    a_ok, KW, SWAP, DOT_DT, ex, ETAB)  # fmt: skip
                acc_u = _planes_dot(acc_u, tl.load(w_ptrs + u_off + 4, mask=n_ok, other=0),
                                    (su & -65536).to(tl.float32, bitcast=True),
                                    a_ptrs + 8 * KW, a_ok, KW, SWAP, DOT_DT, ex, ETAB)  # fmt: skip
            w_ptrs += 2 * KW
            s_ptrs += KW // 4
            a_ptrs += 16 * KW
        if SWAP:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
            acc_u = tl.trans(acc_u)
        col = offs_n
        mask = ok[:, None] & (col < N)[None, :]
        if PERM_OUT > 0:  # column n -> its place in the down launch's plane order
            r = col % (16 * PERM_OUT)
            col = (col - r + ((r // 32) % 2) * 8 * PERM_OUT + (r % 8) * PERM_OUT
                   + (r // 64) * 4 + (r // 8) % 4)  # fmt: skip
        if GATED:
            y = acc / (1.0 + tl.exp(-acc)) * acc_u
            tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + col[None, :],
                     y.to(c_ptr.dtype.element_ty), mask=mask)  # fmt: skip
        else:
            if MUL_W:
                acc = acc * tl.load(tw_ptr + pair, mask=ok, other=0.0)[:, None]
            if ATOMIC:
                dst = c_ptr + (pair // OUT_DIV).to(tl.int64)[:, None] * c_stride + col[None, :]
                tl.atomic_add(dst, acc, mask=mask, sem="relaxed")
            else:
                tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + col[None, :],
                         acc.to(c_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def to_plane_order(x: torch.Tensor, kw: int) -> torch.Tensor:
    """Activations [M, K] (K % (16 kw) == 0) in the order the kernel reads them: inside each
    block of 16 kw columns, column 64h + 32par + 8r + j (group 2h + par, word r of the group,
    nibble j) moves to par * 8kw + j * kw + 4h + r, so that each nibble plane of the even or
    the odd groups' words meets kw contiguous activation columns (int4_gemm.to_gemm_order)."""
    M, K = x.shape
    return x.reshape(M, K // (16 * kw), kw // 4, 2, 4, 8).permute(0, 1, 3, 5, 2, 4).reshape(M, K)


def fit_kw(kw: int, *ks: int) -> int:
    """The largest KW <= kw (halving, at least 16) whose 16 KW columns divide every K."""
    while any(k % (16 * kw) for k in ks) and kw > 16:
        kw //= 2
    return kw


def _launch(a, w, s, c, tw, sorted_ids, eids, npost, ex, N, K, num_pairs, a_div, gated,
            mul_w, out_div, atomic, perm_out, cfg):  # fmt: skip
    s32 = s.view(torch.int32)  # [E, N, K/64]: the scales of groups 2h (low) and 2h + 1
    grid = (eids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    _int4_mma_kernel[grid](
        a, w, s32, c, tw, sorted_ids, eids, npost, ex, N, K, num_pairs, a.stride(0),
        c.stride(0), w.stride(0), w.stride(1), s32.stride(0), s32.stride(1), 0, A_DIV=a_div,
        GATED=gated, MUL_W=mul_w, OUT_DIV=out_div, ATOMIC=atomic, PERM_OUT=perm_out,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], KW=cfg["KW"], SWAP=cfg["SWAP"],
        DOT_DT=dot_dtype(), ETAB=cfg["ETAB"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip


def _configs(config: dict, D: int, I: int) -> tuple[dict, dict]:  # noqa: E741
    """(gate_up, down) launch configs: `config`'s keys, "w2" overrides for the down launch,
    KW shrunk to fit the model's K."""
    own = {k: v for k, v in config.items() if k not in ("w2", "what")}
    base = {**(F16_CONFIG if own.get("F16") else MMA_CONFIG), **own}
    c2 = {**base, **config.get("w2", {})}
    unknown = set(base) - set(CONFIG_KEYS) | set(c2) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"int4_moe_mma: unknown config keys {sorted(unknown)}")
    if c2["BLOCK_M"] != base["BLOCK_M"]:
        raise ValueError("int4_moe_mma: one BLOCK_M for both launches (one alignment)")
    if base.get("F16") or c2.get("F16"):
        if not (base.get("F16") and c2.get("F16")):
            raise ValueError("int4_moe_mma: F16 for both launches or neither")
        check_f16(base, D)
        check_f16(c2, I)
        return base, c2
    base["KW"] = fit_kw(base["KW"], D)
    c2["KW"] = fit_kw(c2["KW"], I)
    for c, k in ((base, D), (c2, I)):
        if c["KW"] < 16 or c["KW"] & (c["KW"] - 1) or k % (16 * c["KW"]):
            raise ValueError(f"int4_moe_mma: K={k} must be a multiple of 16 KW = "
                             f"{16 * c['KW']} (KW a power of two >= 16)")  # fmt: skip
        if c["ETAB"] not in (0, 1, 2):
            raise ValueError(f"int4_moe_mma: ETAB={c['ETAB']}: use 0, 1 or 2")
        if c["BLOCK_M"] & (c["BLOCK_M"] - 1) or c["BLOCK_N"] & (c["BLOCK_N"] - 1):
            raise ValueError(f"int4_moe_mma: BLOCK_M, BLOCK_N must be powers of two ({c})")
    return base, c2


def int4_moe_mma(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4", group 32
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    config: dict | None = None,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
) -> torch.Tensor:  # [T, D] x.dtype
    """Routed-expert output on tensor cores; no host synchronisation. `config`: BLOCK_M (rows of
    an aligned block), BLOCK_N (weight rows a program), KW (words a K step tile), SWAP, ATOMIC
    (the down launch adds into a float32 [T, D] instead of storing [T*k, D] for a torch sum),
    SPLIT (gate_up: gate and up rows in programs of their own, fewer registers a program, the
    SiLU-and-mul in torch), maxnreg (a register cap a thread),
    ETAB (the dequant's exponent from a register, one instruction less a weight: 1 from a
    table, 2 from the scales' sign bit, which needs scales >= 0), num_warps, num_stages;
    F16=1: the f16 design of int4_moe_mma16.py (keys BLOCK_M, BLOCK_N, G groups a K step, SWAP,
    ATOMIC, num_warps, num_stages, maxnreg; defaults F16_CONFIG);
    "w2": overrides for the down launch (not BLOCK_M). `active` 0: the programs return at once
    (the output is then undefined)."""
    require_triton(x)
    T, D = x.shape
    I = ew.intermediate  # noqa: E741
    if ew.quant != "int4" or ew.group_size != 32:
        raise ValueError(f"int4_moe_mma: needs int4 experts of group 32 (got {ew.quant}, "
                         f"group {ew.group_size})")  # fmt: skip
    if ew.hidden != D:
        raise ValueError(f"int4_moe_mma: hidden size {D} != experts' {ew.hidden}")
    c13, c2 = _configs(dict(config or {}), D, I)
    k = topk_ids.shape[1]
    M = T * k
    sorted_ids, eids, npost = moe_align_block_size(topk_ids, ew.num_experts, c13["BLOCK_M"])
    if active is not None:  # 0 rows in use: every program returns at once
        npost = npost * active
    tw = topk_weights.reshape(-1).float().contiguous()
    if c13.get("F16"):
        return launch_f16(x, ew, tw, topk_ids, sorted_ids, eids, npost, c13, c2)
    xg = to_plane_order(x, c13["KW"])
    # the exponent tile of ETAB (2^15's bits), one per K step's words
    ex = torch.full((max(c13["KW"], c2["KW"]),), 142 << 23, dtype=torch.int32, device=x.device)
    if c13["SPLIT"]:  # gate and up rows in programs of their own, SiLU-and-mul in torch
        h = torch.empty(M, 2 * I, dtype=torch.float32, device=x.device)  # plane order
        _launch(xg, ew.w13, ew.w13_scale, h, tw, sorted_ids, eids, npost, ex, 2 * I, D, M, k,
                False, False, 1, False, c2["KW"], c13)  # fmt: skip
        act = (F.silu(h[:, :I]) * h[:, I:]).to(x.dtype)
    else:
        act = torch.empty(M, I, dtype=x.dtype, device=x.device)  # silu(gate) * up, plane order
        _launch(xg, ew.w13, ew.w13_scale, act, tw, sorted_ids, eids, npost, ex, I, D, M, k,
                True, False, 1, False, c2["KW"], c13)  # fmt: skip
    if c2["ATOMIC"]:
        out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
        _launch(act, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, ex, D, I, M, 1,
                False, True, k, True, 0, c2)  # fmt: skip
        return out.to(x.dtype)
    out = torch.empty(M, D, dtype=torch.float32, device=x.device)
    _launch(act, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, ex, D, I, M, 1, False,
            True, 1, False, 0, c2)  # fmt: skip
    return out.view(T, k, D).sum(1).to(x.dtype)
