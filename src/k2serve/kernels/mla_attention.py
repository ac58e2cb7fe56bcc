"""Paged MLA attention in the absorbed form (decode with split-KV, prefill with a cached prefix).

Owns: `mla_attention(...)` (Triton) and `mla_attention_ref(...)` (torch reference, the oracle).
Just over 500 lines: the decode kernel, its split merge and the prefill kernel share the tile
rules and the fp8 widening, and the reference sits beside them as their oracle.

Math (absorbed MLA, DeepSeek-V3 `inference/model.py`): the cache holds per token the normed
latent c [L] and the roped key k_pe [R]; every head shares them (MQA with one 576-wide key):
    score[t, h, n] = (q_latent[t, h] . c[n] + q_pe[t, h] . k_pe[n]) * scale
    out[t, h]      = softmax_n(score[t, h, :]) @ c[:, :]            # [L], before W_UV
Token t of a sequence (0-based among its new tokens) sees cache positions n < context_len + t + 1.

Kernel layout: the rows of one program are (token, head) pairs of ONE sequence, flattened
token-major (row r -> token r // H, head r % H), which is exactly `q_latent.view(T * H, L)`. Each
key tile [BLOCK_N, L + R] is loaded once per program and shared by all its rows (decode: all 64
heads of a sequence in one program). Decode splits the keys of a sequence into `num_splits`
ranges (split-KV, flash-decoding; the count from the batch, the context and the SM count, see
`_pick_splits`), each writing a normalised partial output and its log-sum-exp, merged by a
second kernel. Prefill (and mixed batches) uses one split and writes the output directly.
Launch configs (tiles, stages, the split rule) come from the policy tables ("mla_decode" in
configs/<kind>.json) through `config`; `default_config` is the rule without a table.

fp8 cache (float8_e4m3fn, the format of `attention/torch_ref.py` and `kernels/kv_store.py`):
stored = e4m3(clamp(x / kv_scale, +-448)), read = stored * kv_scale. The kernel loads the bytes
(half the traffic of a bf16 cache), widens them to the dot dtype in registers (exact: every e4m3
value is a bf16 value) and folds kv_scale into the softmax scale and the output, so no
per-element multiply is added. On NVIDIA GPUs the widening is inline PTX, 4 bytes per 32-bit
register: the 7 exponent+mantissa bits shifted into a bf16 word and one bf16x2 multiply by 2^120
(the exponent bias difference; exact for sub-normals too): 2.5 integer/FMA instructions per value
where Triton's cast takes cvt.f16x2.e4m3x2 + two cvt.bf16.f16, 1.5 per value on the conversion
pipe (16/clk/SM in the CUDA guide's table against 64-128 for integer/FMA); `fp8_convert="cast"`
keeps Triton's (the interpreter always casts) and benchmarks/mla_fp8.py times both.
NOTE: the PTX path reads the NaN code 0x7F as 480 (like Triton's own emulation); a NaN is only
stored for a NaN input.

Invariants: `seq_lens[b] == context_lens[b] + query_len[b]`; block_table rows cover
`cdiv(seq_lens[b], page_size)` pages; outputs are written for every row of every sequence.
"""

from __future__ import annotations

import functools
import math

import torch

from ._triton import HAS_TRITON, INTERPRET, cdiv, dot_dtype, require_triton, tl, triton

FP8_KV_DTYPES = (torch.float8_e4m3fn,)

# --------------------------------------------------------------------------------------------
# torch reference


def mla_attention_ref(
    q_latent: torch.Tensor,  # [T, H, L]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_pages] int32
    scale: float,
    kv_scale: float = 1.0,  # fp8 caches: read value = stored * kv_scale
) -> torch.Tensor:  # [T, H, L]
    """Per-sequence gather of the paged cache and a float32 causal softmax."""
    T, H, L = q_latent.shape
    ps = kv_cache.shape[1]
    out = torch.empty(T, H, L, dtype=q_latent.dtype, device=q_latent.device)
    qsl, ctx = query_start_loc.tolist(), context_lens.tolist()
    for b in range(len(ctx)):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        n_keys = ctx[b] + (e - s)
        pos = torch.arange(n_keys, device=kv_cache.device)
        pages = block_table[b].long()[pos // ps]
        kv = kv_cache[pages, pos % ps].float()  # [S, L + R]
        if kv_cache.dtype in FP8_KV_DTYPES and kv_scale != 1.0:
            kv = kv * kv_scale
        q = torch.cat([q_latent[s:e], q_pe[s:e]], dim=-1).float()  # [t, H, L + R]
        score = torch.einsum("thd,sd->ths", q, kv) * scale
        tpos = ctx[b] + torch.arange(e - s, device=kv.device)
        mask = pos[None, :] > tpos[:, None]  # [t, S]
        score.masked_fill_(mask[:, None, :], float("-inf"))
        out[s:e] = torch.einsum("ths,sd->thd", score.softmax(-1), kv[:, :L]).to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Triton kernels

if HAS_TRITON:

    @triton.jit
    def _e4m3_to_bf16_ptx(x):
        """bf16 values of float8_e4m3fn bytes `x` (uint8), 4 per 32-bit register: the sign to
        bit 15, exponent+mantissa to bits 10..4 (a bf16 with exponent bias 127 instead of 7),
        then one bf16x2 multiply by 2^120. Exact, sub-normals included."""
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 a0, a1, b0, b1, e120, nz;
            mov.b32 e120, 0x7B807B80;
            mov.b32 nz, 0x80008000;
            prmt.b32 a0, 0, $2, 0x5140;
            prmt.b32 a1, 0, $2, 0x7362;
            and.b32 b0, a0, 0x7FFF7FFF;
            and.b32 b1, a1, 0x7FFF7FFF;
            shr.b32 b0, b0, 4;
            shr.b32 b1, b1, 4;
            lop3.b32 b0, b0, 0x80008000, a0, 0xF8;
            lop3.b32 b1, b1, 0x80008000, a1, 0xF8;
            fma.rn.bf16x2 $0, b0, e120, nz;
            fma.rn.bf16x2 $1, b1, e120, nz;
            }
            """,
            constraints="=r,=r,r",
            args=[x],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )

    @triton.jit
    def _load_kv(ptrs, mask, KV_FP8: tl.constexpr, DOT_DT: tl.constexpr):
        """A key tile as DOT_DT. KV_FP8: 0 = the cache is bf16/fp32, 1 = float8_e4m3fn read
        through Triton's cast, 2 = float8_e4m3fn bytes (uint8 view) widened by PTX."""
        if KV_FP8 == 2:
            return _e4m3_to_bf16_ptx(tl.load(ptrs, mask=mask, other=0))
        return tl.load(ptrs, mask=mask, other=0.0).to(DOT_DT)

    @triton.jit
    def _mla_fwd_kernel(
        q_lat_ptr,  # [T*H, L]
        q_pe_ptr,  # [T*H, R]
        kv_ptr,  # [P*PS, L+R]
        qsl_ptr,  # [B+1]
        ctx_ptr,  # [B]
        bt_ptr,  # [B, max_pages]
        out_ptr,  # [T*H, L] (DIRECT) or partial [T*H, SPLITS, L] fp32
        lse_ptr,  # [T*H, SPLITS] fp32 (unused if DIRECT)
        bt_stride,
        sm_scale,
        kv_scale,
        SPLITS,  # a runtime int: one compiled kernel serves every split count
        H: tl.constexpr,
        L: tl.constexpr,
        R: tl.constexpr,
        PS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr,
        DOT_DT: tl.constexpr,
        KV_FP8: tl.constexpr,
        SPLIT_QK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        ctx = tl.load(ctx_ptr + b)
        n_rows = q_len * H
        row0 = pid_m * BLOCK_M
        if row0 >= n_rows:
            return
        rows = row0 + tl.arange(0, BLOCK_M)  # [BM]
        row_ok = rows < n_rows
        tok = rows // H
        q_pos = ctx + tok  # position of each row's token
        last_row = tl.minimum(row0 + BLOCK_M, n_rows) - 1
        kv_len = ctx + last_row // H + 1  # keys this block may see
        chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
        n_lo = split * chunk
        n_hi = tl.minimum(n_lo + chunk, kv_len)

        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        g_rows = q_start * H + rows  # global row index into q / out
        q_n = tl.load(
            q_lat_ptr + g_rows[:, None] * L + offs_l[None, :], mask=row_ok[:, None], other=0.0
        ).to(DOT_DT)
        q_r = tl.load(
            q_pe_ptr + g_rows[:, None] * R + offs_r[None, :], mask=row_ok[:, None], other=0.0
        ).to(DOT_DT)
        # log2(e); an fp8 cache's kv_scale multiplies every key, so it scales the scores
        qk_scale = sm_scale * kv_scale * 1.4426950408889634

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, L], tl.float32)
        bt_row = bt_ptr + b * bt_stride
        if BLOCK_N <= PS:  # tiles start at multiples of BLOCK_N: each lies in one page
            offs_t = tl.arange(0, BLOCK_N)[:, None] * (L + R)  # loop-invariant offsets
            page_next = tl.load(bt_row + n_lo // PS, mask=n_lo < n_hi, other=0)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_hi
            if BLOCK_N <= PS:  # one page id per tile; the addresses are base + invariant
                # the next tile's page id is read one tile ahead: the tile's address does not
                # wait on a load issued in the same iteration
                page = page_next
                n1 = n0 + BLOCK_N
                page_next = tl.load(bt_row + n1 // PS, mask=n1 < n_hi, other=0)
                base = kv_ptr + (page.to(tl.int64) * PS + n0 % PS) * (L + R)
                kv_row = base + offs_t
            else:
                page = tl.load(bt_row + offs_n // PS, mask=n_ok, other=0)
                slot = page.to(tl.int64) * PS + offs_n % PS
                kv_row = kv_ptr + slot[:, None] * (L + R)
            c = _load_kv(kv_row + offs_l[None, :], n_ok[:, None], KV_FP8, DOT_DT)  # [BN, L]
            k_r = _load_kv(kv_row + L + offs_r[None, :], n_ok[:, None], KV_FP8, DOT_DT)
            # SPLIT_QK: Triton gives a dot whose result feeds another dot (here the scores feed
            # p @ c) the warps [num_warps, 1]; with 64 rows and 8 warps both warpgroups then
            # compute the SAME [64, BLOCK_N] scores (2x the QK MMAs, which at 64 heads are half
            # the kernel's tensor work). Returned through an scf.if, the scores' forward slice
            # ends at its yield, so the QK dots get warps [4, 2] (each warpgroup half the keys),
            # and scaling each dot keeps Triton from folding the rope dot's add into the first
            # dot's accumulator (a chain again). The condition is always true in the loop.
            if SPLIT_QK and n0 < n_hi:
                s = tl.dot(q_n, tl.trans(c)) * qk_scale + tl.dot(q_r, tl.trans(k_r)) * qk_scale
            else:
                s = (tl.dot(q_n, tl.trans(c)) + tl.dot(q_r, tl.trans(k_r))) * qk_scale
            vis = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            s = tl.where(vis, s, float("-inf"))  # [BM, BN] fp32, log2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DT), c)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if KV_FP8 != 0:
            o = o * kv_scale  # the values are the (scaled) keys too
        if DIRECT:
            tl.store(
                out_ptr + g_rows[:, None] * L + offs_l[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # base 2
            tl.store(
                out_ptr + (g_rows.to(tl.int64)[:, None] * SPLITS + split) * L + offs_l[None, :],
                o,
                mask=row_ok[:, None],
            )
            tl.store(lse_ptr + g_rows * SPLITS + split, lse, mask=row_ok)

    @triton.jit
    def _mla_reduce_kernel(
        part_ptr,  # [N_ROWS, SPLITS, L] fp32
        lse_ptr,  # [N_ROWS, SPLITS] fp32 (base-2)
        out_ptr,  # [N_ROWS, L]
        SPLITS,
        L: tl.constexpr,
        SPLITS_P2: tl.constexpr,  # next power of two (tl.arange); the rest is masked
        BLOCK_S: tl.constexpr,  # splits merged per step
        BLOCK_L: tl.constexpr,  # output columns per program (grid axis 1)
    ):
        """out[row, cols] = sum_s w_s * part[row, s, cols], w = softmax of the splits' lse.
        A program takes BLOCK_L columns of one row and walks the splits BLOCK_S at a time (the
        whole [splits, L] partial of a row in registers spilled at 64+ splits)."""
        row = tl.program_id(0).to(tl.int64)
        offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        offs_s = tl.arange(0, SPLITS_P2)
        lse = tl.load(lse_ptr + row * SPLITS + offs_s, mask=offs_s < SPLITS, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        inv = 1.0 / tl.maximum(tl.sum(tl.exp2(lse - m), 0), 1e-30)  # empty splits weigh 0
        o = tl.zeros([BLOCK_L], tl.float32)
        for s0 in range(0, SPLITS, BLOCK_S):
            offs = s0 + tl.arange(0, BLOCK_S)
            ls = tl.load(lse_ptr + row * SPLITS + offs, mask=offs < SPLITS, other=float("-inf"))
            used = ls > float("-inf")  # empty splits: no need to read their zeros
            part = tl.load(part_ptr + (row * SPLITS + offs[:, None]) * L + offs_l[None, :],
                           mask=used[:, None], other=0.0)  # fmt: skip
            o += tl.sum(part * (tl.exp2(ls - m) * inv)[:, None], 0)
        tl.store(out_ptr + row * L + offs_l, o.to(out_ptr.dtype.element_ty))


def _pick_splits(
    num_seqs: int, row_blocks: int, max_seq_len: int, sms: int, waves: float,
    min_split_keys: int, max_splits: int,
) -> int:  # fmt: skip
    """Split-KV count for a decode step: enough programs for `waves` x `sms` (a decode tile of
    64 rows takes a whole SM: ~150-220 KB of shared memory, 8 warps at ~220 registers), never a
    split of fewer than `min_split_keys` keys (each split writes a [rows, L] fp32 partial that
    the merge reads back: at 132 splits of B=1 that is 17 MB against 38 MB of a 32K bf16
    cache), at most `max_splits`. Rounded DOWN so the last wave is not a few stragglers (B=8 on
    132 SMs: 16 splits = 128 programs, not 17 = 136 = a second wave of 4). Any count works:
    the merge masks its power-of-two range. Depends only on host ints (graph-safe)."""
    programs = max(1, num_seqs * row_blocks)
    want = max(1, int(waves * sms) // programs)
    by_len = max(1, max_seq_len // max(1, min_split_keys))
    return max(1, min(want, by_len, max_splits))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _smem_per_block(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 232448)  # sm_90's 227 KB


def fit_stages(cfg: dict, L: int, R: int, kv_bytes: int, device: torch.device) -> int:
    """num_stages, lowered until the kernel's shared memory fits the device (the tables are
    tuned on sm_90's 227 KB; an A100 has 163 KB): q [block_m, L + R] bf16, one key tile
    [block_n, L + R] per stage (fp8: per stage but one) and for fp8 the widened bf16 tile, and
    p [block_m, block_n] (Triton 3.6's builds: bf16 64 x 32 x 4 stages 221184 B, 225280 here;
    fp8 64 x 32 x 5: 188416, fp8 64 x 64 x 3: 225280, 229376 here; the limit is 232448)."""
    stages = cfg["num_stages"]
    if device.type != "cuda":
        return stages
    index = device.index if device.index is not None else torch.cuda.current_device()
    limit = _smem_per_block(index)
    q = cfg["block_m"] * (L + R) * 2
    tile = cfg["block_n"] * (L + R)
    widened = tile * 2 if kv_bytes == 1 else 0
    p = cfg["block_m"] * cfg["block_n"] * 2  # the probabilities, restaged for the PV MMA

    def need(st: int) -> int:  # an fp8 tile is widened from its buffer: st - 1 buffers
        return q + (st - 1 if widened else st) * tile * kv_bytes + widened + p

    while stages > 1 and need(stages) > limit:
        stages -= 1
    return stages


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (CUDA), else 8 (the CPU interpreter: few programs
    keep the tests fast; any count gives the same result)."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


FP8_CONVERTS = ("ptx", "cast")
TILE_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "split_qk")
SPLIT_KEYS = ("waves", "min_split_keys", "max_splits")  # decode split-KV rule (_pick_splits)
CONFIG_KEYS = TILE_KEYS + SPLIT_KEYS


def default_fp8_convert() -> str:
    """How the kernel widens fp8 keys: the PTX path on NVIDIA GPUs, Triton's cast elsewhere (the
    interpreter, ROCm)."""
    return "cast" if INTERPRET or torch.version.hip is not None else "ptx"


def fp8_cache_supported(device: torch.device | str) -> bool:
    """True when the Triton kernel can read a float8_e4m3fn cache on `device`: NVIDIA sm_80+
    (the PTX widening needs bf16x2 FMA), or Triton's CPU interpreter."""
    dev = torch.device(device)
    if INTERPRET and dev.type == "cpu":
        return True
    if dev.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 0)


def default_config(decode: bool, heads: int, fp8: bool) -> dict:
    """Tile sizes (and, for decode, the split-KV rule); the policy tables (configs/<kind>.json,
    "mla_decode") override them per cache dtype. Prefill: 64 rows, 32-key tiles, one split,
    3 stages (at 2, Triton 3.6 keeps 2 buffers but waits for the next tile's copy at once).
    Decode: ALL heads of a sequence in one program (64 rows at Kimi-K2's 64 heads), so each key
    tile crosses L2 -> shared memory once and an fp8 tile is widened once (16-row tiles read and
    widened it 4 times: at B=1 the kernel was L2-bound at 22-31% of the copy bandwidth); on
    sm_90 a 64-row tile is a warpgroup MMA, the accumulator [64, 512] fp32 split over 8 warps.
    The key tiles are cp.async'ed num_stages - 1 ahead: that needs the tile's address not to
    wait on a load of the same iteration, so the next tile's page id is read one tile ahead
    (with the page id read in the iteration, Triton 3.6 issued the next tile's copy after the
    MMAs and waited for it at once: no overlap at any num_stages, one memory latency exposed
    per tile).
    The QK dots are split between the two warpgroups (SPLIT_QK in the kernel; split_qk=False
    is the plain form, kept for comparison).
    NOTE: sm_90 builds without a GPU (Triton 3.6, ptxas; benchmarks/mla_fp8.py --resources),
    64 rows, 8 warps, split QK: bf16 32 keys x 4 stages: 214 registers, no spill, 221 KB
    shared memory, 3 tiles (108 KB) in flight, 36 + 2 warpgroup MMAs a tile; fp8 32 keys x 5
    stages: 235 registers, no spill, 188 KB, 3 raw tiles (54 KB) in flight (the widened tile
    goes registers -> shared memory for the MMA). Without the split QK: 72 + 2 MMAs a tile,
    fp8 spills 232 B. 4 warps spill > 2 KB (the [64, 512] fp32 accumulator alone is 256
    registers a thread); bf16 64 keys x 3 stages needs 288 KB (does not fit). The old
    16 x 64 / 4 warps tile spilled 100 B and ran mma.sync, not the warpgroup MMA.
    benchmarks/mla_fp8.py times the candidates; the policy tables hold the pick."""
    if not decode:
        return dict(block_m=64, block_n=32, num_warps=8, num_stages=3, split_qk=True)
    block_m = min(64, max(16, triton_next_pow2(heads)))
    # fp8: 64-key tiles x 3 stages (H100: 0.95-1.04x the bf16 cache's time against 0.82-0.90x
    # with 32 x 5). Its one failed fidelity check was a budget artefact: on the H100 its error
    # is within 1% of the 32-key tile's at pages 16 and 64, 5 contexts, 2 seeds
    # (benchmarks/mla_fp8_tiles_check.py, RESULTS.md)
    if fp8:
        return dict(block_m=block_m, block_n=64, num_warps=8, num_stages=3, split_qk=True,
                    waves=1.0, min_split_keys=256, max_splits=256)  # fmt: skip
    return dict(block_m=block_m, block_n=32, num_warps=8, num_stages=4, split_qk=True,
                waves=1.0, min_split_keys=256, max_splits=256)  # fmt: skip


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def mla_attention(
    q_latent: torch.Tensor,  # [T, H, L]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [num_pages, page_size, L + R] bf16/fp32 or float8_e4m3fn
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_pages] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, H, L]
    num_splits: int | None = None,
    kv_scale: float = 1.0,  # fp8 cache: read value = stored * kv_scale (others: unused)
    fp8_convert: str | None = None,  # "ptx" | "cast"; None = default_fp8_convert()
    config: dict | None = None,  # overrides of default_config (benchmarks compare tiles)
) -> torch.Tensor:
    """Absorbed paged MLA; see the module docstring. No host synchronisation."""
    require_triton(q_latent)
    T, H, L = q_latent.shape
    R = q_pe.shape[-1]
    P, PS, D = kv_cache.shape
    if D != L + R:
        raise ValueError(f"kv_cache last dim {D} != kv_lora_rank {L} + rope dim {R}")
    if q_pe.shape[:2] != (T, H):
        raise ValueError(f"q_pe shape {tuple(q_pe.shape)} does not match q_latent {(T, H)}")
    for name, v in (("kv_lora_rank", L), ("rope dim", R), ("page_size", PS)):
        if v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two for the Triton MLA kernel")
    fp8 = kv_cache.dtype in FP8_KV_DTYPES
    kv_fp8 = 0
    if fp8:
        if not kv_scale > 0:
            raise ValueError(f"kv_scale={kv_scale} must be positive")
        conv = fp8_convert or default_fp8_convert()
        if conv not in FP8_CONVERTS:
            raise ValueError(f"fp8_convert={conv!r}; expected one of {FP8_CONVERTS}")
        if conv == "ptx" and INTERPRET:
            raise ValueError("fp8_convert='ptx' needs an NVIDIA GPU (not the interpreter)")
        kv_fp8 = 2 if conv == "ptx" else 1
        if kv_fp8 == 2:
            kv_cache = kv_cache.view(torch.uint8)  # the PTX widening takes the raw bytes
    q_latent, q_pe = q_latent.contiguous(), q_pe.contiguous()
    if out is None:
        out = torch.empty_like(q_latent)
    B = context_lens.shape[0]
    if T == 0 or B == 0:
        return out
    decode = max_query_len == 1
    cfg = default_config(decode, H, fp8)
    if config:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(f"unknown MLA config keys {sorted(unknown)}; use {CONFIG_KEYS}")
        cfg.update(config)
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"MLA block_n={block_n}: a power of two >= 16 (the key tile is the K "
                         "of the P @ V MMA, whose minimum is 16)")  # fmt: skip
    if decode:  # a table's 64-row tile on a shard of 8 heads: 16 rows do (the MMA minimum)
        block_m = min(block_m, max(16, triton_next_pow2(H)))
    row_blocks = cdiv(max_query_len * H, block_m)
    if num_splits is None:
        num_splits = 1
        if decode:
            num_splits = _pick_splits(
                B, row_blocks, max_seq_len, sm_count(q_latent.device), cfg["waves"],
                cfg["min_split_keys"], cfg["max_splits"],
            )  # fmt: skip
    direct = num_splits == 1
    grid = (row_blocks, B, num_splits)
    if direct:
        part, lse = out, out  # lse unused
    else:
        part = torch.empty(T * H, num_splits, L, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(T * H, num_splits, dtype=torch.float32, device=q_latent.device)
    _mla_fwd_kernel[grid](
        q_latent, q_pe, kv_cache, query_start_loc, context_lens, block_table, part, lse,
        block_table.stride(0), float(scale), float(kv_scale) if fp8 else 1.0, num_splits,
        H=H, L=L, R=R, PS=PS, BLOCK_M=block_m, BLOCK_N=block_n,
        DIRECT=direct, DOT_DT=dot_dtype(), KV_FP8=kv_fp8, SPLIT_QK=bool(cfg["split_qk"]),
        num_warps=cfg["num_warps"],
        num_stages=fit_stages(cfg, L, R, kv_cache.element_size(), q_latent.device),
    )  # fmt: skip
    if not direct:
        p2 = triton_next_pow2(num_splits)
        block_l = min(L, 128)
        _mla_reduce_kernel[(T * H, L // block_l)](part, lse, out, num_splits, L=L, SPLITS_P2=p2,
                                                  BLOCK_S=min(p2, 16), BLOCK_L=block_l,
                                                  num_warps=4)  # fmt: skip
    return out


__all__ = [
    "CONFIG_KEYS",
    "default_config",
    "default_fp8_convert",
    "fp8_cache_supported",
    "math",
    "mla_attention",
    "mla_attention_ref",
    "sm_count",
]
