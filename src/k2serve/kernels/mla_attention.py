"""Paged MLA attention in the absorbed form (decode with split-KV, prefill with a cached prefix).

Owns: `mla_attention(...)` (Triton) and `mla_attention_ref(...)` (torch reference, the oracle).

Math (absorbed MLA, DeepSeek-V3 `inference/model.py`): the cache holds per token the normed
latent c [L] and the roped key k_pe [R]; every head shares them (MQA with one 576-wide key):
    score[t, h, n] = (q_latent[t, h] . c[n] + q_pe[t, h] . k_pe[n]) * scale
    out[t, h]      = softmax_n(score[t, h, :]) @ c[:, :]            # [L], before W_UV
Token t of a sequence (0-based among its new tokens) sees cache positions n < context_len + t + 1.

Kernel layout: the rows of one program are (token, head) pairs of ONE sequence, flattened
token-major (row r -> token r // H, head r % H), which is exactly `q_latent.view(T * H, L)`. Each
key tile [BLOCK_N, L + R] is loaded once per program and shared by all its rows. Decode splits
the keys of a sequence into `num_splits` ranges (split-KV, flash-decoding), each writing a
normalised partial output and its log-sum-exp, merged by a second kernel. Prefill (and mixed
batches) uses one split and writes the output directly.

Invariants: `seq_lens[b] == context_lens[b] + query_len[b]`; block_table rows cover
`cdiv(seq_lens[b], page_size)` pages; outputs are written for every row of every sequence.
"""

from __future__ import annotations

import math

import torch

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton

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
        H: tl.constexpr,
        L: tl.constexpr,
        R: tl.constexpr,
        PS: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DIRECT: tl.constexpr,
        DOT_DT: tl.constexpr,
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
        qk_scale = sm_scale * 1.4426950408889634  # log2(e)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, L], tl.float32)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_hi
            page = tl.load(bt_ptr + b * bt_stride + offs_n // PS, mask=n_ok, other=0)
            slot = page.to(tl.int64) * PS + offs_n % PS
            kv_row = kv_ptr + slot[:, None] * (L + R)
            c = tl.load(kv_row + offs_l[None, :], mask=n_ok[:, None], other=0.0).to(DOT_DT)
            k_r = tl.load(kv_row + L + offs_r[None, :], mask=n_ok[:, None], other=0.0).to(DOT_DT)
            s = tl.dot(q_n, tl.trans(c)) + tl.dot(q_r, tl.trans(k_r))  # [BM, BN] fp32
            vis = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            s = tl.where(vis, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DT), c)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if DIRECT:
            tl.store(
                out_ptr + g_rows[:, None] * L + offs_l[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # base 2
            tl.store(
                out_ptr + (g_rows[:, None] * SPLITS + split) * L + offs_l[None, :],
                o,
                mask=row_ok[:, None],
            )
            tl.store(lse_ptr + g_rows * SPLITS + split, lse, mask=row_ok)

    @triton.jit
    def _mla_reduce_kernel(
        part_ptr,  # [N_ROWS, SPLITS, L] fp32
        lse_ptr,  # [N_ROWS, SPLITS] fp32 (base-2)
        out_ptr,  # [N_ROWS, L]
        L: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs_s = tl.arange(0, SPLITS)
        offs_l = tl.arange(0, L)
        lse = tl.load(lse_ptr + row * SPLITS + offs_s)  # [S]
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # 0 for empty splits
        w = w / tl.maximum(tl.sum(w, 0), 1e-30)
        used = (lse > float("-inf"))[:, None]  # empty splits: no need to read their zeros
        part = tl.load(part_ptr + (row * SPLITS + offs_s[:, None]) * L + offs_l[None, :],
                       mask=used, other=0.0)  # fmt: skip
        o = tl.sum(part * w[:, None], 0)
        tl.store(out_ptr + row * L + offs_l, o.to(out_ptr.dtype.element_ty))


ROUND_UP_SMALL_BATCH = True  # False = the rule before run 10 (bench/model_speed.py's base)


def _pick_splits(num_seqs: int, row_blocks: int, max_seq_len: int, block_n: int) -> int:
    """Enough programs to cover the GPU (~2 waves of 132 SMs). A split covers a whole number of
    key tiles (chunk = cdiv(cdiv(keys, splits), block_n) tiles), so at one or two sequences the
    count is rounded UP to a power of two (tl.arange): 1025 keys in 64-key tiles are 17 tiles,
    i.e. 9 working splits of 2 tiles at 16 splits but 17 of 1 at 32 (run 9: 16 us per layer at
    batch 1 with 6 working splits of 3 tiles). Larger batches round down, as before."""
    programs = max(1, num_seqs * row_blocks)
    want = max(1, 264 // programs)
    tiles = max(1, -(-max_seq_len // block_n))
    if num_seqs <= 2 and ROUND_UP_SMALL_BATCH:
        n = min(want, tiles, 64)
        return min(64, 1 << (n - 1).bit_length())
    n = min(want, max(1, tiles // 2), 64)
    return 1 << (n.bit_length() - 1)


def mla_attention(
    q_latent: torch.Tensor,  # [T, H, L]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, max_pages] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, H, L]
    num_splits: int | None = None,
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
    q_latent, q_pe = q_latent.contiguous(), q_pe.contiguous()
    if out is None:
        out = torch.empty_like(q_latent)
    B = context_lens.shape[0]
    if T == 0 or B == 0:
        return out
    decode = max_query_len == 1
    block_m = 16 if decode else 64
    block_n = 64 if decode else 32
    num_warps = 4 if decode else 8
    if decode and H < 16:
        block_m = max(1 << (H - 1).bit_length(), 16)
    row_blocks = cdiv(max_query_len * H, block_m)
    if num_splits is None:
        num_splits = _pick_splits(B, row_blocks, max_seq_len, block_n) if decode else 1
    direct = num_splits == 1
    grid = (row_blocks, B, num_splits)
    if direct:
        part, lse = out, out  # lse unused
    else:
        part = torch.empty(T * H, num_splits, L, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(T * H, num_splits, dtype=torch.float32, device=q_latent.device)
    _mla_fwd_kernel[grid](
        q_latent, q_pe, kv_cache, query_start_loc, context_lens, block_table, part, lse,
        block_table.stride(0), float(scale),
        H=H, L=L, R=R, PS=PS, SPLITS=num_splits, BLOCK_M=block_m, BLOCK_N=block_n,
        DIRECT=direct, DOT_DT=dot_dtype(), num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    if not direct:
        _mla_reduce_kernel[(T * H,)](part, lse, out, L=L, SPLITS=num_splits, num_warps=4)
    return out


__all__ = ["mla_attention", "mla_attention_ref", "math"]
