"""The routed experts' kernel chosen on the device from the routing: no host sync.

Owns: `moe_select(topk_ids, num_experts, thresholds)` (one Triton launch) and `moe_select_ref`.

Why: per-pair GEMV, grouped GEMV and grouped GEMM cost differently for the same token count
depending on how many (token, expert) pairs each hit expert gets: the per-pair GEMV reads an
expert's weights once per pair, the grouped GEMV once per block of a few pairs, the GEMM once
per block of many (benchmarks/RESULTS.md: at T=128 x top-8 the grouped GEMV wins on uniform
routing, 2.9 pairs per hit expert, and the GEMM on the k2-slice's concentrated routing, 7.9).
The count of distinct experts hit is only known on the device; reading it on the host would
stop CUDA graphs and cost a sync per layer.

Contract: pairs = topk_ids.numel(), hits = distinct ids, ppe = pairs / hits. With thresholds
t_1 < ... < t_{n-1} (pairs per hit expert), path p = #{i : ppe >= t_i} in 0..n-1. Output
`sel` int32 [n + 1]: sel[i] = 1 for i == p else 0, sel[n] = hits. The caller launches each
candidate path with `active=sel[i:i+1]` (its programs return at once when 0) and keeps the
chosen one's output (`torch.where`), so the graph is the same whatever the routing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton

MAX_PATHS = 3


def moe_select_ref(topk_ids: torch.Tensor, num_experts: int, thresholds: Sequence[float]):
    """torch reference of `moe_select` (any device)."""
    n = len(thresholds) + 1
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    hits = int((counts > 0).sum())
    p = sum(flat.numel() >= t * hits for t in thresholds)  # ppe >= t without a division
    sel = [int(i == p) for i in range(n)] + [hits]
    return torch.tensor(sel, dtype=torch.int32, device=flat.device)


if HAS_TRITON:
    from .moe_align import expert_histogram

    @triton.jit
    def _select_kernel(ids_ptr, sel_ptr, M, t1, t2, NPATH: tl.constexpr, E: tl.constexpr,
                       BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
        """One program: histogram of the ids, hits = experts with a pair, the path index."""
        counts = expert_histogram(ids_ptr, M, BLOCK_E, CHUNK)
        offs_e = tl.arange(0, BLOCK_E)
        hits = tl.sum(((counts > 0) & (offs_e < E)).to(tl.int32), 0)
        pairs = M * 1.0
        hf = hits.to(tl.float32)
        p = (pairs >= t1 * hf).to(tl.int32)
        if NPATH > 2:
            p += (pairs >= t2 * hf).to(tl.int32)
        offs = tl.arange(0, 4)
        val = tl.where(offs == NPATH, hits, (offs == p).to(tl.int32))
        tl.store(sel_ptr + offs, val, mask=offs <= NPATH)


def moe_select(
    topk_ids: torch.Tensor,  # [T, k] int32 / int64, values in [0, num_experts)
    num_experts: int,
    thresholds: Sequence[float],  # ascending pairs-per-hit-expert limits, 1 or 2 of them
) -> torch.Tensor:  # [len(thresholds) + 2] int32: one-hot path, then the hit count
    """See the module docstring. One launch, no host sync (CUDA-graph safe)."""
    require_triton(topk_ids)
    n = len(thresholds) + 1
    if not 2 <= n <= MAX_PATHS:
        raise ValueError(f"moe_select: {len(thresholds)} thresholds; use 1 or 2")
    if list(thresholds) != sorted(thresholds):
        raise ValueError(f"moe_select: thresholds {list(thresholds)} must be ascending")
    flat = topk_ids.reshape(-1)
    sel = torch.empty(n + 1, dtype=torch.int32, device=flat.device)
    t = [float(x) for x in thresholds] + [0.0]
    block_e = triton.next_power_of_2(num_experts + 1)
    _select_kernel[(1,)](flat, sel, flat.numel(), t[0], t[1], NPATH=n, E=num_experts,
                         BLOCK_E=block_e, CHUNK=128, num_warps=4)  # fmt: skip
    return sel
