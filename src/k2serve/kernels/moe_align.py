"""Token/expert alignment for the fused MoE GEMM (vLLM `moe_align_block_size`).

Owns: `moe_align_block_size(topk_ids, num_experts, block_m)` (Triton, two launches, four from
PARALLEL_COUNT_MIN_PAIRS pairs, no host sync), `moe_align_block_size_ref` (torch), and
`tail_units` (the Gluon GEMM's TAIL rows).

Contract: the M = T * top_k (token, slot) pairs, numbered i = t * top_k + j, are grouped by expert;
each expert's group is padded to a multiple of `block_m` and only experts with pairs get blocks.
- `sorted_ids [max_padded]` int32: pair ids grouped by expert; padding and unused tail = M;
- `expert_ids [max_blocks]` int32: the expert of each block of `block_m` rows (E past the end);
- `num_post_padded [1]` int32: rows in use (blocks in use * block_m).
`max_padded = max_blocks * block_m`, `max_blocks = cdiv(M, block_m) + min(E, M)`: a bound known
on the host, so the grid is fixed and CUDA-graph safe. Order inside one expert's group is not
specified (atomics); every consumer treats rows independently.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, cdiv, require_triton, tl, triton

# from this many (token, expert) pairs (512 tokens of top-8) the pairs are counted and the
# sentinels filled by a grid of programs before the one-program offsets kernel
PARALLEL_COUNT_MIN_PAIRS = 4096


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def tail_units(eids: torch.Tensor, num_experts: int, num_units: int) -> torch.Tensor:
    """The program rows of a TAIL launch: eids [nb] int32, the expert of each aligned block of
    BLOCK_M / 2 rows (num_experts past the end) -> units [num_units] int32: the blocks at an
    even place in their expert's run, in order (an expert's units stay adjacent: its weight
    tiles stay in L2), then nb (no work). num_units >= the units there can be:
    max_blocks(pairs, experts, BLOCK_M) (an expert's units are cdiv(pairs, BLOCK_M)). No
    host sync (CUDA-graph safe)."""
    nb = eids.shape[0]
    idx = torch.arange(nb, device=eids.device)
    start = torch.ones(nb, dtype=torch.bool, device=eids.device)
    start[1:] = eids[1:] != eids[:-1]
    first = torch.where(start, idx, 0).cummax(0).values  # the first block of each one's expert
    unit = ((idx - first) % 2 == 0) & (eids < num_experts)
    dest = torch.where(unit, unit.long().cumsum(0) - 1, num_units)  # non-units: a spare slot
    units = torch.full((num_units + 1,), nb, dtype=torch.int32, device=eids.device)
    units.scatter_(0, dest, idx.int())
    return units[:num_units]


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    flat = topk_ids.reshape(-1).long()
    M = flat.numel()
    nb = max_blocks(M, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    cum = padded.cumsum(0)
    start = cum - padded
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(M, device=flat.device) - (counts.cumsum(0) - counts)[sorted_e]
    sorted_ids = torch.full((nb * block_m,), M, dtype=torch.int32, device=flat.device)
    sorted_ids[start[sorted_e] + rank] = order.int()
    blk = torch.arange(nb, device=flat.device) * block_m
    expert_ids = torch.searchsorted(cum, blk, right=True).int()
    return sorted_ids, expert_ids, cum[-1:].int()


if HAS_TRITON:

    @triton.jit
    def expert_histogram(ids_ptr, M, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
        """Pairs per expert id [BLOCK_E] int32 of the M flat top-k ids (CHUNK at a time; the
        masked tail counts in bin BLOCK_E - 1: callers mask the bins >= E)."""
        counts = tl.zeros([BLOCK_E], tl.int32)
        for s in range(0, M, CHUNK):
            o = s + tl.arange(0, CHUNK)
            v = tl.load(ids_ptr + o, mask=o < M, other=BLOCK_E - 1).to(tl.int32)
            counts += tl.histogram(v, BLOCK_E)
        return counts

    @triton.jit
    def grouped_tile(N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of this program for the grouped GEMMs: GROUP_M row blocks run through
        each N tile before the next N tile (L2 reuse of the weight tiles across the row blocks
        of one expert); GROUP_M = 1: row-block major."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        num_m = tl.num_programs(0) // num_n
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m

    # M and NB vary with the step's token count: not specialized (divisibility by 16), so one
    # compile serves every step (NB's class was not in the warm-up's key: served runs compiled
    # this kernel inside requests, benchmarks/RESULTS.md "Served throughput", wave 8)
    @triton.jit(do_not_specialize=["M", "NB"])
    def _align_count_kernel(
        ids_ptr, sorted_ptr, eid_ptr, npost_ptr, cursor_ptr, counts_ptr, M, NB,
        E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
        COUNTED: tl.constexpr,
    ):  # fmt: skip
        # one program: padded offsets, block -> expert map, cursors. Not COUNTED: it also counts
        # the pairs and fills the sentinels itself (small M); COUNTED: _align_hist_kernel did
        # both, the counts are in counts_ptr.
        offs_e = tl.arange(0, BLOCK_E)
        if COUNTED:
            counts = tl.load(counts_ptr + offs_e)
        else:
            counts = expert_histogram(ids_ptr, M, BLOCK_E, CHUNK)
        counts = tl.where(offs_e < E, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        cum = tl.cumsum(padded, 0)
        tl.store(cursor_ptr + offs_e, cum - padded)
        tl.store(npost_ptr, tl.sum(padded, 0))
        for s in range(0, NB, CHUNK):
            b = s + tl.arange(0, CHUNK)
            # expert of block b = number of experts whose padded range ends at or before b*BM
            e = tl.sum((cum[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)
            e = tl.minimum(e, E)
            tl.store(eid_ptr + b, e, mask=b < NB)
        if not COUNTED:
            for s in range(0, NB * BLOCK_M, CHUNK):
                o = s + tl.arange(0, CHUNK)
                tl.store(sorted_ptr + o, tl.zeros([CHUNK], tl.int32) + M, mask=o < NB * BLOCK_M)

    @triton.jit(do_not_specialize=["M", "NFILL"])
    def _align_hist_kernel(ids_ptr, sorted_ptr, counts_ptr, M, NFILL, BLOCK_E: tl.constexpr,
                           CHUNK: tl.constexpr):  # fmt: skip
        # many programs: each counts CHUNK pairs into counts (atomics; bins >= E are ignored
        # later) and fills CHUNK sentinel rows of sorted_ids (NFILL >= M rows in all)
        o = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        v = tl.load(ids_ptr + o, mask=o < M, other=BLOCK_E - 1).to(tl.int32)
        tl.atomic_add(counts_ptr + tl.arange(0, BLOCK_E), tl.histogram(v, BLOCK_E))
        tl.store(sorted_ptr + o, tl.zeros([CHUNK], tl.int32) + M, mask=o < NFILL)

    @triton.jit
    def aligned_block(sorted_ptr, eid_ptr, pid_m, num_pairs, A_DIV: tl.constexpr,
                      BLOCK_M: tl.constexpr):  # fmt: skip
        """Block pid_m of the alignment, for the grouped GEMMs: its pair ids [BLOCK_M], which
        of them are real (padding = num_pairs), each pair's activation row (pair // A_DIV;
        padding reads row 0) and the block's expert (int64)."""
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        ok = pair < num_pairs
        rows = tl.where(ok, pair // A_DIV, 0).to(tl.int64)
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        return pair, ok, rows, e

    @triton.jit(do_not_specialize=["M"])
    def _align_scatter_kernel(ids_ptr, sorted_ptr, cursor_ptr, M, CHUNK: tl.constexpr):
        o = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        ok = o < M
        e = tl.load(ids_ptr + o, mask=ok, other=0)
        dest = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
        tl.store(sorted_ptr + dest, o, mask=ok)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """See the module docstring. `topk_ids` [T, top_k] integer, values in [0, num_experts)."""
    require_triton(topk_ids)
    flat = topk_ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {flat.dtype}")
    M = flat.numel()
    nb = max_blocks(M, num_experts, block_m)
    dev = flat.device
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(block_e, dtype=torch.int32, device=dev)
    if M == 0:
        num_post.zero_()
        return sorted_ids, expert_ids, num_post
    counted = M >= PARALLEL_COUNT_MIN_PAIRS
    counts = cursor
    if counted:  # one program would walk M ids and nb * block_m rows alone (0.47 ms at 64K pairs)
        counts = torch.zeros(block_e, dtype=torch.int32, device=dev)
        _align_hist_kernel[(cdiv(nb * block_m, 1024),)](
            flat, sorted_ids, counts, M, nb * block_m, BLOCK_E=block_e, CHUNK=1024, num_warps=4
        )  # fmt: skip
    _align_count_kernel[(1,)](
        flat, sorted_ids, expert_ids, num_post, cursor, counts, M, nb,
        E=num_experts, BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=128, COUNTED=counted, num_warps=4,
    )  # fmt: skip
    _align_scatter_kernel[(cdiv(M, 256),)](flat, sorted_ids, cursor, M, CHUNK=256, num_warps=4)
    return sorted_ids, expert_ids, num_post
