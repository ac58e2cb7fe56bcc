# ruff: noqa: E741
"""FP8-block (128x128) routed experts: grouped GEMMs with the fp8 weights converted in registers.

Owns: `fp8_moe` (the routed-expert output of one step: gate+up GEMM with the SiLU-and-mul in its
epilogue, down GEMM scaled by the routing weights, the weighted top-k sum), `pick_config` (the
launch config for a pair count from the kernel policy's `fp8_moe` table), `DEFAULT_TABLE`.

Layout (kernels/fused_moe.py): w13 float8_e4m3fn [E, 2I, D] (gate rows, then up rows), w13_scale
fp32 [E, 2 cdiv(I, 128), cdiv(D, 128)] (gate's block rows, then up's); w2 [E, D, I], w2_scale
[E, cdiv(D, 128), cdiv(I, 128)]. W = w * scale[n // 128, k // 128].

Why: the generic kernel (fused_moe.py) takes the weights as the dot's right operand, so every
converted tile goes through shared memory. Here the weights are the left operand: each program
computes the transposed tile acc[n, pair] = W[n, k] x A^T[k, pair]. The fp8 tile is cp.async'ed
to shared memory as stored (1 byte per weight), loaded into the MMA operand layout and converted
to bf16 in registers (fp8 e4m3 values are exact in bf16), so the converted tile never touches
shared memory (TTGIR: the fp8 tile async-copied, `local_load` to the dot operand layout,
`fp_to_fp` there, `warp_group_dot` with a register operand; mma.sync for BLOCK_N < 64); the
activations are the right operand, loaded already transposed ([K, pairs]) by pointer
arithmetic. BLOCK_N and BLOCK_K divide 128, so one tile of one K step lies in one 128x128 scale
block: one scalar scale per tile and K step, applied to the fp32 partial product
(acc += dot(w, a) * s: the generic kernel's numerics, bf16 x bf16 products, fp32 sums).
Scaling the weight tile in registers instead (dot(bf16(w * s), a)) does not keep the tile in
registers with Triton 3.6: the f32 -> bf16 rounding is a truncf / downcast, which the dot-operand
hoisting refuses (as it refuses the scalar's splat when multiplying in bf16), so Triton stores
the scaled tile to shared memory and reads it back.

Decode (few pairs): BLOCK_M 16 rows of one expert per program and the N outputs split over many
programs, so the weights stream at close to the copy bandwidth; prefill: BLOCK_M 32-128 and
GROUP_M row blocks per group of programs (the row blocks of one expert are adjacent in the
alignment; a group runs over them for each N tile while the expert's tiles sit in L2).

Invariants: BLOCK_N and BLOCK_K are powers of two in [16, 128], BLOCK_M one >= 16; any N, K
(partial tiles masked). Rows are the (token, slot) pairs aligned per expert by
moe_align_block_size (padding rows read row 0 and are never stored). No host sync (the grid is
bounded on the host): CUDA-graph safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton
from .moe_align import moe_align_block_size
from .policy import band_index, check_open_table

if HAS_TRITON:
    from .moe_align import aligned_block, grouped_tile

    @triton.jit
    def _w_part(w_ptrs, s_ptr, a, k0, K, n_ok, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_DT: tl.constexpr):  # fmt: skip
        """dot(W tile [BLOCK_N, BLOCK_K] at column k0, a [BLOCK_K, BLOCK_M]) unscaled, and the
        tile's 128x128 block scale (a scalar: the tile lies in one block)."""
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        return tl.dot(w.to(DOT_DT), a), tl.load(s_ptr + k0 // 128)

    @triton.jit
    def _fp8_moe_kernel(
        a_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        up_s_row,
        A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr,
        EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        DOT_DT: tl.constexpr,
    ):  # fmt: skip
        """c[pair, n] = sum_k a[pair // A_DIV, k] W[e, n, k] for one aligned block of BLOCK_M
        pairs of expert e and BLOCK_N outputs, as the transposed tile acc[n, pair]. GATED:
        c = silu(gate) * up with up's rows at n + N (scale rows at up_s_row + n // 128);
        MUL_W: c *= tw[pair]."""
        pid_m, pid_n = grouped_tile(N, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair, pair_ok, rows, e = aligned_block(sorted_ptr, eid_ptr, pid_m, num_pairs, A_DIV,
                                               BLOCK_M)  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_base = w_ptr + e * w_stride_e
        w_ptrs = w_base + offs_n[:, None] * w_stride_n + offs_k[None, :]
        s_base = s_ptr + e * s_stride_e
        s_g = s_base + (pid_n * BLOCK_N // 128) * s_stride_n  # the tile's scale row (scalar)
        a_ptrs = a_ptr + rows[None, :] * a_stride + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        if GATED:
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            wu_ptrs = w_ptrs + N * w_stride_n
            su_ptr = s_base + (up_s_row + pid_n * BLOCK_N // 128) * s_stride_n
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs).to(DOT_DT)
            else:
                a = tl.load(a_ptrs, mask=(k0 + offs_k < K)[:, None], other=0.0).to(DOT_DT)
            # both products are issued before either is scaled (the MMAs overlap)
            p, s = _w_part(w_ptrs, s_g, a, k0, K, n_ok, EVEN_K, BLOCK_K, DOT_DT)
            if GATED:
                p_u, s_u = _w_part(wu_ptrs, su_ptr, a, k0, K, n_ok, EVEN_K, BLOCK_K, DOT_DT)
                acc_u += p_u * s_u
                wu_ptrs += BLOCK_K
            acc += p * s
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_u
        if MUL_W:
            acc = acc * tl.load(tw_ptr + pair, mask=pair_ok, other=0.0)[None, :]
        tl.store(c_ptr + pair.to(tl.int64)[None, :] * c_stride + offs_n[:, None],
                 acc.to(c_ptr.dtype.element_ty), mask=n_ok[:, None] & pair_ok[None, :])  # fmt: skip


# Launch configs by (token, expert) pair count when the policy gives no table: the first entry
# whose max_pairs >= the pair count (None: any). BLOCK_M is shared by both GEMMs (one
# alignment); "w13" / "w2" hold each GEMM's tile and launch parameters (see kernels/configs).
DEFAULT_TABLE: tuple[Mapping[str, Any], ...] = (  # configs/h100.json's (measured on one H100)
    {"max_pairs": 8, "BLOCK_M": 16,
     "w13": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
     "w2": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}},
    {"max_pairs": 64, "BLOCK_M": 16,
     "w13": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
     "w2": {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}},
    {"max_pairs": 1024, "BLOCK_M": 16,
     "w13": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4},
     "w2": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}},
    {"max_pairs": 8192, "BLOCK_M": 32,
     "w13": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 4, "num_warps": 4, "num_stages": 4},
     "w2": {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": 4}},
    {"max_pairs": None, "BLOCK_M": 64,
     "w13": {"BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 4, "num_warps": 4, "num_stages": 4},
     "w2": {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 8, "num_stages": 4}},
)  # fmt: skip

_TILE_KEYS = {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}


def _entry(ent: Mapping[str, Any]) -> dict:
    return {
        "BLOCK_M": ent["BLOCK_M"],
        "w13": dict(ent["w13"]),
        "w2": dict(ent.get("w2", ent["w13"])),
    }


def pick_config(num_pairs: int, table: Sequence[Mapping[str, Any]] | None = None) -> dict:
    """The first entry of `table` (default DEFAULT_TABLE) whose max_pairs covers num_pairs, as
    {"BLOCK_M": ..., "w13": {...}, "w2": {...}} ("w2" defaults to "w13")."""
    table = table if table is not None else DEFAULT_TABLE
    i = band_index(table, num_pairs)
    if i is not None:
        return _entry(table[i])
    raise ValueError(f"fp8_moe: no config covers {num_pairs} pairs (the last entry needs "
                     "max_pairs null)")  # fmt: skip


def check_config(cfg: Mapping[str, Any]) -> None:
    """Raise ValueError when a config breaks the kernel's invariants."""
    bm = cfg.get("BLOCK_M")
    if not isinstance(bm, int) or bm < 16 or bm & (bm - 1):
        raise ValueError(f"fp8_moe: BLOCK_M={bm!r} must be a power of two >= 16")
    for part in ("w13", "w2"):
        t = cfg[part]
        if set(t) != _TILE_KEYS:
            raise ValueError(f"fp8_moe: config {part} keys {sorted(t)} != {sorted(_TILE_KEYS)}")
        for key in ("BLOCK_N", "BLOCK_K"):
            v = t[key]
            if not isinstance(v, int) or v < 16 or v > 128 or v & (v - 1):
                raise ValueError(f"fp8_moe: {part} {key}={v!r} must be a power of two in "
                                 "[16, 128] (one tile per 128x128 scale block)")  # fmt: skip
        if not isinstance(t["GROUP_M"], int) or t["GROUP_M"] < 1:
            raise ValueError(f"fp8_moe: {part} GROUP_M={t['GROUP_M']!r} must be >= 1")


def check_table(table: Sequence[Mapping[str, Any]]) -> None:
    """Raise ValueError when an entry breaks the invariants or no entry covers every count."""
    for ent in table:
        try:
            check_config(_entry(ent))
        except (KeyError, TypeError) as e:
            raise ValueError(f"fp8_moe: malformed table entry {dict(ent)!r}: {e!r}") from None
    check_open_table(table, "fp8_moe")


def _gemm(a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a_div, gated, mul_w, block_m, t,
          up_s_row=0):  # fmt: skip
    """One launch of _fp8_moe_kernel over every aligned block (the grid is bounded on the
    host: max_blocks x N tiles; blocks past num_post_padded return at once)."""
    grid = (eids.shape[0] * cdiv(N, t["BLOCK_N"]),)
    _fp8_moe_kernel[grid](
        a, w, s, c, tw, sorted_ids, eids, npost, N, K, M, a.stride(0), c.stride(0),
        w.stride(0), w.stride(1), s.stride(0), s.stride(1), up_s_row,
        A_DIV=a_div, GATED=gated, MUL_W=mul_w, EVEN_K=K % t["BLOCK_K"] == 0, BLOCK_M=block_m,
        DOT_DT=dot_dtype(), **t,
    )  # fmt: skip


def check_inputs(who: str, x, ew, topk_weights, topk_ids) -> tuple[int, int]:
    """-> (T, top_k) of an FP8-block experts call `who`; ValueError for experts that are not
    FP8-block, a hidden size not theirs, or routing tensors not both [T, top_k]."""
    if ew.quant != "fp8":
        raise ValueError(f"{who}: experts are {ew.quant!r}, not 'fp8'")
    T, D = x.shape
    if D != ew.hidden:
        raise ValueError(f"{who}: hidden size {D} != experts' {ew.hidden}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"{who}: topk_ids / topk_weights must both be [T, top_k]")
    return T, topk_ids.shape[1]


def fp8_moe(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "fp8"
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int32/int64
    config: Mapping[str, Any] | None = None,
    table: Sequence[Mapping[str, Any]] | None = None,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
) -> torch.Tensor:  # [T, D]
    """Routed-expert output sum_j w_tj * expert_{e_tj}(x_t) for FP8-block experts; no host
    synchronisation. `config` ({"BLOCK_M", "w13", "w2"}) overrides the pick from `table` (the
    kernel policy's fp8_moe table; None: DEFAULT_TABLE). `active` 0: every program returns at
    once (the output is left unwritten: the caller discards it); None: always run."""
    require_triton(x)
    T, k = check_inputs("fp8_moe", x, ew, topk_weights, topk_ids)
    D = x.shape[1]
    I, E = ew.intermediate, ew.num_experts
    M = T * k
    cfg = dict(config) if config is not None else pick_config(M, table)
    check_config(cfg)
    bm = cfg["BLOCK_M"]
    x = x.contiguous()
    sorted_ids, eids, npost = moe_align_block_size(topk_ids, E, bm)
    if active is not None:  # 0 rows in use: every program returns at once
        npost = npost * active
    tw = topk_weights.reshape(-1).float().contiguous()
    inter = torch.empty(M, I, dtype=x.dtype, device=x.device)
    _gemm(x, ew.w13, ew.w13_scale, inter, tw, sorted_ids, eids, npost, I, D, M, k, True, False,
          bm, cfg["w13"], up_s_row=cdiv(I, 128))  # fmt: skip
    out = torch.empty(M, D, dtype=x.dtype, device=x.device)
    _gemm(inter, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1, False, True,
          bm, cfg["w2"])  # fmt: skip
    return out.view(T, k, D).sum(1)
