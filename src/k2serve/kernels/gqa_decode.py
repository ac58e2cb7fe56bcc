"""Paged grouped-query attention for one new token per sequence (the EAGLE-3 Llama head's
one-token draft steps, `model.eagle3.paged_gqa_decode`).

Owns: `gqa_decode(...)` (Triton). Cache layout `[slots, 2, KVH, D]` (slot = page * page_size +
offset; K at index 0, V at 1), block table `[B, W]` int32, lengths `[B]` int32. Grid (B, KVH):
a program reads its sequence's keys up to its length (a loop bounded by the length read on the
device) for the G = H / KVH query heads of its KV head, with an online softmax in float32. No
host sync and a grid that does not depend on the lengths: safe inside a CUDA graph, reading
only the tokens a sequence has (the torch fallback gathers the whole block table).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _gqa_decode_kernel(
        q_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr,
        q_sb, q_sh, t_sb, kv_ss, kv_sk, kv_sh, o_sb, o_sh, scale, G, D, page_size,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kh = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gd = (g < G)[:, None] & (d < D)[None, :]
        heads = kh * G + g
        q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=gd, other=0.0)
        q = q.to(tl.float32)  # [BG, BD]
        n_keys = tl.load(lens_ptr + b)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nm = n < n_keys
            page = tl.load(table_ptr + b * t_sb + n // page_size, mask=nm, other=0)
            slot = page.to(tl.int64) * page_size + n % page_size  # [BN]
            nd = nm[:, None] & (d < D)[None, :]
            ptr = kv_ptr + slot[:, None] * kv_ss + kh * kv_sh + d[None, :]
            k = tl.load(ptr, mask=nd, other=0.0).to(tl.float32)  # [BN, BD]
            v = tl.load(ptr + kv_sk, mask=nd, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BG, BN]
            s = tl.where(nm[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / den[:, None]
        optr = out_ptr + b * o_sb + heads[:, None] * o_sh + d[None, :]
        tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=gd)


def gqa_decode(
    q: torch.Tensor,  # [B, H, D]
    flat: torch.Tensor,  # [slots, 2, KVH, D]
    block_table: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1
    page_size: int,
) -> torch.Tensor:
    """Softmax(q k^T / sqrt(D)) v over each sequence's first seq_lens[b] tokens -> [B, H, D]."""
    require_triton(q)
    B, H, D = q.shape
    KVH = flat.shape[2]
    if H % KVH or flat.shape[1] != 2 or flat.shape[3] != D:
        raise ValueError(f"q {tuple(q.shape)} does not fit the K/V cache {tuple(flat.shape)}")
    if q.stride(-1) != 1 or flat.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("gqa_decode needs unit last-dim strides")
    G = H // KVH
    out = torch.empty_like(q)
    block_g = max(2, triton.next_power_of_2(G))
    block_d = max(16, triton.next_power_of_2(D))
    block_n = max(8, 2048 // (block_g * block_d) * 8)  # [BG, BN, BD] products in registers
    block_n = min(64, triton.next_power_of_2(block_n))
    _gqa_decode_kernel[(B, KVH)](
        q, flat, block_table, seq_lens, out,
        q.stride(0), q.stride(1), block_table.stride(0), flat.stride(0), flat.stride(1),
        flat.stride(2), out.stride(0), out.stride(1), D**-0.5, G, D, page_size,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=8 if block_g * block_n * block_d > 4096 else 4,
    )  # fmt: skip
    return out


__all__ = ["gqa_decode"]
