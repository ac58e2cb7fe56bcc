# ruff: noqa: E741
"""INT4 W4A16 grouped GEMM for prefill and large decode batches: tensor cores, the weights
dequantized into the MMA's register operand.

Owns: `int4_moe_gemm` (routed-expert output: two grouped GEMM launches, the SiLU-and-mul between
them in torch, the weighted top-k sum), its configs (`PREFILL_TABLE` by pair count,
`pick_config`, `gemm_supported`, `to_gemm_order`), the previous tile kernel (`TILE_CONFIG`, the
fallback for shapes the new one does not take and the benchmarks' peer), and
`int4_moe_grouped_mm`, the path for long prefills: experts dequantized to bf16 chunk-wise, then
torch._grouped_mm (one host sync).

Why: dequant + torch._grouped_mm writes and re-reads 4x the INT4 bytes (34 GB of bf16 per K2
layer when all 384 experts are hit); here the experts are read once, as INT4.

Layout: compressed-tensors words w int32 [E, N, K/8] (nibble j of word i = column 8i + j, value
+ 8), scales bf16 [E, N, K/group] (group 32). The weights are the MMA's left operand (tokens are
its N: few tokens per expert waste less of a tile, and Hopper's wgmma takes a register left
operand).

`_int4_gemm_kernel` (the default): a K step of 256 columns is two [BLOCK_N, 16] word tiles, the
words of the even groups and of the odd groups, cp.async'ed to shared memory as they are and
loaded in the MMA operand layout; each of their 8 nibble planes is one MMA of K = 16, its operand
made by elementwise ops only (`_plane_w`: one and/or, one exact FMA, one rounding). Elementwise
chains are what Triton 3.6 hoists into the register operand: a reshape / join / interleave of
the dequantized tile, a 16-bit load in the chain (hence the scales read as int32 pairs) or a
two-input inline asm make it store the tile to shared memory and read it back instead (the tile
kernel's bottleneck: ncu showed L1 88% busy). The activations are permuted once per call so each
plane meets contiguous columns (`to_gemm_order`); the first GEMM writes its output in that order
for the second. BLOCK_N < 64 gives Triton's mma.sync form, >= 64 wgmma (Triton waits for each
register-operand wgmma before the next plane: the limit at large T). Figures: RESULTS.md
("INT4 MoE GEMM with the dequantized weights in registers").

`_int4_gemm_tile_kernel` (previous): one [BLOCK_N, 8W] tile per K step, dequantized by
int4_dequant's lop3/bf16x2 PTX and put back in natural column order by three `tl.interleave`
levels, which Triton converts through shared memory.

Invariants: rows are the (token, slot) pairs aligned per expert by moe_align_block_size (padding
rows are not read by the default kernel and never stored). No host sync (the grid is bounded on
the host), so both are CUDA-graph safe. Default kernel: group 32, hidden and intermediate
multiples of 16 W2 (256 with W2 = 16); tile kernel: K % (8W) == 0, W % (group / 8) == 0.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from k2serve import envs

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton
from .int4_dequant import dequant_int4_planes, permute_planes, pick_pb, use_asm
from .int4_gemm_gluon import GLUON_TABLE, gemm_gluon, gluon_align, gluon_usable
from .moe_align import max_blocks, moe_align_block_size
from .policy import band_index

logger = logging.getLogger(__name__)

if HAS_TRITON:
    from .int4_dequant import planes_bf16
    from .moe_align import aligned_block

    @triton.jit
    def _tile_bf16(p, s, USE_ASM: tl.constexpr):
        """Words p int32 [BN, W] with per-word scales s [BN, W] -> bf16 [BN, 8W], natural
        column order (column 8i + j = nibble j of word i)."""
        w0, w1, w2, w3, w4, w5, w6, w7 = planes_bf16(p, s, USE_ASM)
        even = tl.interleave(tl.interleave(w0, w4), tl.interleave(w2, w6))
        odd = tl.interleave(tl.interleave(w1, w5), tl.interleave(w3, w7))
        return tl.interleave(even, odd)

    @triton.jit
    def _int4_gemm_tile_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, MUL_W: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, W: tl.constexpr, WPG: tl.constexpr, DOT_DT: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] * dequant(w[e, n, k]) (* tw[pair]) for one
        aligned block of BLOCK_M pairs of expert e and BLOCK_N outputs, as the transposed tile
        acc[n, pair] (weights = the MMA's left operand)."""
        # the N tiles of one row block are adjacent in launch order: the block's activation
        # rows stay in L2 while every tile reads them; the row blocks of one expert follow
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair, pair_ok, rows, e = aligned_block(sorted_ptr, eid_ptr, pid_m, num_pairs, A_DIV,
                                               BLOCK_M)  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_base = w_ptr + e * w_stride_e + offs_n[:, None] * w_stride_n
        s_base = s_ptr + e * s_stride_e + offs_n[:, None] * s_stride_n
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        a_ptrs = a_ptr + rows[:, None] * a_stride + tl.arange(0, 8 * W)[None, :]
        offs_w = tl.arange(0, W)
        w_ptrs = w_base + offs_w[None, :]
        s_ptrs = s_base + (offs_w // WPG)[None, :]
        for _ in range(0, K // (8 * W)):
            p = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            s = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0)
            a = tl.load(a_ptrs)
            w = _tile_bf16(p, s, USE_ASM)
            acc = tl.dot(w.to(DOT_DT), tl.trans(a.to(DOT_DT)), acc)
            a_ptrs += 8 * W
            w_ptrs += W
            s_ptrs += W // WPG
        acc = tl.trans(acc)
        if MUL_W:
            acc = acc * tl.load(tw_ptr + pair, mask=pair_ok, other=0.0)[:, None]
        tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])  # fmt: skip

    @triton.jit
    def _plane_w(r, s, c, J: tl.constexpr):
        """Nibble plane J of the words as bf16 (n - 8) * s, with r the word moved so that the
        nibble sits at mantissa bits 8-11 (J even) or 12-15 (J odd). One and/or makes the
        float bits of 2^E + n (E = 15 or 11), one FMA with c = -(2^E + 8) * s gives (n - 8) * s
        exactly (c and the product fit fp32's 24 bits), one rounding to bf16. Elementwise
        only, so Triton keeps the plane in the MMA's register operand."""
        SH: tl.constexpr = 8 + 4 * (J % 2)
        bits = (r & (0xF << SH)) | ((150 - SH) << 23)
        return tl.fma(bits.to(tl.float32, bitcast=True), s, c).to(tl.bfloat16)

    @triton.jit
    def _planes_dot(acc, p, s, a_ptrs, a_ok, ROWS: tl.constexpr, DOT_DT: tl.constexpr):
        """acc += sum over the 8 nibble planes of words p [BN, ROWS] (scales s fp32) times
        activation rows a_ptrs + J*ROWS ([ROWS, BLOCK_M] each, already transposed; columns
        not a_ok, the block's padding, are not read)."""
        c15 = s * -32776.0  # -(2^15 + 8) * s
        c11 = s * -2056.0  # -(2^11 + 8) * s
        for J in tl.static_range(8):
            if J < 2:
                r = p << 8
            elif J < 4:
                r = p
            elif J < 6:
                r = p >> 8
            else:
                r = p >> 16
            if J % 2 == 0:
                w = _plane_w(r, s, c15, J)
            else:
                w = _plane_w(r, s, c11, J)
            a = tl.load(a_ptrs + J * ROWS, mask=a_ok[None, :], other=0.0)
            acc = tl.dot(w.to(DOT_DT), a.to(DOT_DT), acc)
        return acc

    @triton.jit
    def _int4_gemm_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, MUL_W: tl.constexpr, PERM_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, W2: tl.constexpr, DOT_DT: tl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] * dequant(w[e, n, k]) (* tw[pair]) for one
        aligned block of BLOCK_M pairs of expert e and BLOCK_N outputs, as the transposed tile
        acc[n, pair] (weights = the MMA's left operand, from registers). K steps of 16 * W2
        columns (2 * W2 words, groups of 4 words = 32 columns): the words of the even groups and
        of the odd groups are two [BLOCK_N, W2] tiles; each of their 8 nibble planes is one MMA
        of K = W2 against W2 rows of the activations in gemm order (`to_gemm_order`). s_ptr is
        the bf16 scales viewed as int32: one word holds the scales of groups 2h (low half) and
        2h + 1."""
        # the N tiles of one row block are adjacent in launch order: the block's activation
        # rows stay in L2 while every tile reads them; the row blocks of one expert follow
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair, pair_ok, rows, e = aligned_block(sorted_ptr, eid_ptr, pid_m, num_pairs, A_DIV,
                                               BLOCK_M)  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        c = tl.arange(0, W2)  # column of a parity tile: group pair c // 4, word c % 4
        w_ptrs = (w_ptr + e * w_stride_e + offs_n[:, None] * w_stride_n
                  + ((c // 4) * 8 + c % 4)[None, :])  # fmt: skip
        s_ptrs = s_ptr + e * s_stride_e + offs_n[:, None] * s_stride_n + (c // 4)[None, :]
        a_ptrs = a_ptr + rows[None, :] * a_stride + c[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for _ in range(0, K // (16 * W2)):
            p_even = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            p_odd = tl.load(w_ptrs + 4, mask=n_ok[:, None], other=0)
            sp = tl.load(s_ptrs, mask=n_ok[:, None], other=0)
            s_even = (sp << 16).to(tl.float32, bitcast=True)
            s_odd = (sp & -65536).to(tl.float32, bitcast=True)
            acc = _planes_dot(acc, p_even, s_even, a_ptrs, pair_ok, W2, DOT_DT)
            acc = _planes_dot(acc, p_odd, s_odd, a_ptrs + 8 * W2, pair_ok, W2, DOT_DT)
            w_ptrs += 2 * W2
            s_ptrs += W2 // 4
            a_ptrs += 16 * W2
        acc = tl.trans(acc)
        if MUL_W:
            acc = acc * tl.load(tw_ptr + pair, mask=pair_ok, other=0.0)[:, None]
        if PERM_OUT:  # column n -> its place in gemm order (to_gemm_order)
            r = offs_n % (16 * W2)
            cols = (
                offs_n - r + ((r // 32) % 2) * 8 * W2 + (r % 8) * W2 + (r // 64) * 4 + (r // 8) % 4
            )
        else:
            cols = offs_n
        tl.store(c_ptr + pair.to(tl.int64)[:, None] * c_stride + cols[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])  # fmt: skip


def to_gemm_order(x: torch.Tensor, w2: int) -> torch.Tensor:
    """Activations [M, K] (K % (16 w2) == 0) in the order `_int4_gemm_kernel` reads them:
    inside each block of 16 w2 columns, column 64h + 32par + 8r + j (group 2h + par, word r of
    the group, nibble j) moves to par*8w2 + j*w2 + 4h + r, so that each nibble plane of the
    even or the odd groups' words meets w2 contiguous activation columns."""
    M, K = x.shape
    return x.reshape(M, K // (16 * w2), w2 // 4, 2, 4, 8).permute(0, 1, 3, 5, 2, 4).reshape(M, K)


# One config for every size: 32-row blocks win slightly on uniform routing but lose badly when
# routing concentrates many rows on an expert (the k2-slice's 1k prefill). The kernel is bound
# by shared memory, not DRAM: Triton stores the dequantized tile to shared memory and reads it
# back in the wgmma operand layout on every K step.
TILE_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, W=8, num_warps=4, num_stages=3)
# The register-operand kernel's configs by (token, expert) pair count (the policy's tables carry
# the tuned ones; benchmarks/prefill_moe.py sweeps them). Few rows per expert: 16-row blocks and
# 64-row weight tiles (BLOCK_N < 64: Triton's mma.sync form); many: 64 x 128 wgmma tiles.
PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, W2=16, num_warps=4, num_stages=2)
PREFILL_TABLE = (
    dict(max_pairs=4096, BLOCK_M=16, BLOCK_N=64, W2=16, num_warps=2, num_stages=3),
    dict(max_pairs=8192, BLOCK_M=32, BLOCK_N=64, W2=16, num_warps=2, num_stages=3),
    dict(max_pairs=None, **PREFILL_CONFIG),
)


def pick_config(config, pairs: int) -> dict:
    """`config` itself (a mapping), or from a table (sequence of mappings with "max_pairs",
    ascending, the last None) the first entry whose max_pairs >= pairs."""
    if isinstance(config, Mapping):
        return dict(config)
    i = band_index(config, pairs)
    if i is not None:
        return {k: v for k, v in config[i].items() if k != "max_pairs"}
    raise ValueError(f"int4 prefill table has no entry for {pairs} pairs (the last needs "
                     "max_pairs null)")  # fmt: skip


def _gemm_tile(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, cfg, group, asm):
    """One launch of the tile kernel."""
    cfg = dict(cfg)
    cfg.pop("kernel", None)
    W = cfg.pop("W")
    while K % (8 * W) and W > group // 8:  # small test models: a K block that fits
        W //= 2
    if K % (8 * W) or W % (group // 8):
        raise ValueError(f"int4_moe_gemm: K={K} is not a multiple of 8*W={8 * W} or group "
                         f"{group} does not divide it")  # fmt: skip
    a = a.contiguous()
    grid = (eids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    _int4_gemm_tile_kernel[grid](
        a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a.stride(0), c.stride(0),
        w.stride(0), w.stride(1), s.stride(0), s.stride(1), A_DIV=a_div, MUL_W=mul_w, W=W,
        WPG=group // 8, DOT_DT=dot_dtype(), USE_ASM=use_asm(asm), **cfg,
    )  # fmt: skip


def _gemm(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, mul_w, perm_out, cfg):
    """One launch of the register-operand kernel; a in gemm order, s bf16 [E, N, K/32]."""
    cfg = {k: v for k, v in cfg.items() if k != "kernel"}
    s32 = s.view(torch.int32)
    grid = (eids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    _int4_gemm_kernel[grid](
        a, w, s32, c, tw, sorted_ids, eids, npost, N, K, M, a.stride(0), c.stride(0),
        w.stride(0), w.stride(1), s32.stride(0), s32.stride(1), A_DIV=a_div, MUL_W=mul_w,
        PERM_OUT=perm_out, DOT_DT=dot_dtype(), **cfg,
    )  # fmt: skip


def gemm_backend(backend: str | None, device) -> str:
    """The register-operand GEMM's kernel: `backend`, "triton" when None. The engine's choice
    (K2SERVE_INT4_GEMM, the device, the tables) is made once, in KernelPolicy.int4_gemm_backend,
    and passed here; "gluon" where it cannot run (gluon_usable) raises."""
    chosen = backend or "triton"
    if chosen not in envs.INT4_GEMM_BACKENDS:
        raise ValueError(f"int4 GEMM backend {chosen!r}: expected one of "
                         f"{envs.INT4_GEMM_BACKENDS}")  # fmt: skip
    if chosen == "gluon" and not gluon_usable(device):
        raise RuntimeError(f"int4 GEMM backend gluon needs Triton 3.6's Gluon and an sm_90 "
                           f"GPU (device {device})")  # fmt: skip
    return chosen


def gemm_supported(ew, w2: int = 16) -> bool:
    """Whether the register-operand kernel takes these experts with K steps of 16 w2 columns:
    group 32 and both K (hidden, intermediate) multiples of 16 w2; otherwise the tile kernel
    runs."""
    step = 16 * w2
    return ew.group_size == 32 and ew.hidden % step == 0 and ew.intermediate % step == 0


def int4_moe_gemm(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4"
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    config=None,  # one launch config, or a table by pair count (pick_config)
    asm: bool = True,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
    backend: str | None = None,  # "triton" / "gluon" (gemm_backend)
) -> torch.Tensor:  # [T, D]
    """Routed-expert output: gate+up grouped GEMM, SiLU(gate) * up, down grouped GEMM scaled by
    the routing weights, sum over the top-k. No host synchronisation. `config` None:
    PREFILL_TABLE. config["kernel"] == "tile" (or experts `gemm_supported` refuses): the tile
    kernel, whose `asm` picks the inline-PTX dequant where it compiles (`use_asm`). Backend
    "gluon" (`gemm_backend`): int4_gemm_gluon's kernel, with the config if it names STAGES,
    else GLUON_TABLE's."""
    require_triton(x)
    T, D = x.shape
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    cfg = pick_config(PREFILL_TABLE if config is None else config, T * k)
    gluon = cfg.get("kernel") != "tile" and gemm_backend(backend, x.device) == "gluon"
    if gluon and "STAGES" not in cfg:
        cfg = pick_config(GLUON_TABLE, T * k)
    if gluon and not gemm_supported(ew, cfg["W2"]) and gemm_supported(ew, 16):
        cfg = {**cfg, "W2": 16}  # K not a multiple of 16 * W2: the same tile, K steps of 256
    tile = cfg.get("kernel") == "tile" or not gemm_supported(ew, cfg.get("W2", 16))
    if tile and "W" not in cfg:
        cfg = dict(TILE_CONFIG)
    cfg = {k: v for k, v in cfg.items() if k not in (("W2",) if tile else ("W",))}
    if not tile:
        cfg.setdefault("W2", 16)
    M = T * k
    units = None
    if gluon and not tile:  # TAIL configs: rows aligned to BLOCK_M / 2, and their units
        sorted_ids, eids, npost, units = gluon_align(topk_ids, E, cfg)
    else:
        sorted_ids, eids, npost = moe_align_block_size(topk_ids, E, cfg["BLOCK_M"])
        assert eids.shape[0] == max_blocks(M, E, cfg["BLOCK_M"])
    if active is not None:  # 0 rows in use: every program returns at once
        npost = npost * active
    tw = topk_weights.reshape(-1).float().contiguous()
    silu = gluon and not tile and bool(cfg.get("SILU"))  # the gate_up launch stores the act
    h = torch.empty(M, I if silu else 2 * I, dtype=x.dtype, device=x.device)
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    if tile:
        _gemm_tile(x, ew.w13, ew.w13_scale, h, tw, sorted_ids, eids, npost, 2 * I, D, M, k,
                   False, cfg, ew.group_size, asm)  # fmt: skip
        act = F.silu(h[:, :I]) * h[:, I:]
        _gemm_tile(act, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1, True,
                   cfg, ew.group_size, asm)  # fmt: skip
    else:
        # h comes out in gemm order (I % 256 == 0, so gate and up halves each are too)
        gemm = functools.partial(gemm_gluon, units=units) if gluon else _gemm
        xg = to_gemm_order(x, cfg["W2"])
        gemm(xg, ew.w13, ew.w13_scale, h, tw, sorted_ids, eids, npost, 2 * I, D, M, k, False,
             True, cfg)  # fmt: skip
        act = h if silu else F.silu(h[:, :I]) * h[:, I:]
        gemm(act, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1, True,
             False, cfg)  # fmt: skip
    return out.view(T, k, D).sum(1)


def int4_moe_grouped_mm(x, ew, topk_weights, topk_ids, chunk: int = 32) -> torch.Tensor:
    """Prefill path: experts dequantized `chunk` at a time to bf16, torch._grouped_mm per
    projection. One host sync (expert counts). x [T, D] bf16 -> [T, D]."""
    T, D = x.shape
    k = topk_ids.shape[1]
    I, E = ew.intermediate, ew.num_experts
    pb = pick_pb(D, I)
    if pb is None:
        raise ValueError(f"int4_moe_grouped_mm: D={D}, I={I} must be multiples of 128")
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    cum = counts.cumsum(0)
    cum_h = [0] + cum.tolist()
    tok = order // k
    xs = permute_planes(x, pb)[tok]  # [M, D], rows grouped by expert
    out_s = torch.empty(flat.numel(), D, dtype=x.dtype, device=x.device)
    for e0 in range(0, E, chunk):
        e1 = min(E, e0 + chunk)
        r0, r1 = cum_h[e0], cum_h[e1]
        if r1 == r0:
            continue
        offs = (cum[e0:e1] - r0).to(torch.int32)
        w13 = dequant_int4_planes(ew.w13[e0:e1], ew.w13_scale[e0:e1], pb)  # [C, 2I, D]
        h = torch._grouped_mm(xs[r0:r1], w13.transpose(1, 2), offs=offs)  # [R, 2I]
        del w13
        a = (F.silu(h[:, :I]) * h[:, I:]).to(x.dtype)
        a = permute_planes(a, pb)
        w2 = dequant_int4_planes(ew.w2[e0:e1], ew.w2_scale[e0:e1], pb)  # [C, D, I]
        out_s[r0:r1] = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        del w2
    wsel = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, out_s.float() * wsel[:, None])
    return out.to(x.dtype)
