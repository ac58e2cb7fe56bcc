"""The absorbed MLA's two per-head products with kv_b_proj's weight, for a few tokens (decode).

Owns: `absorb_q(q_nope, w)` (q_latent[t, h] = q_nope[t, h] @ W_UK[h], [T, H, L]),
`absorb_o(o_latent, w)` (out[t, h] = o_latent[t, h] @ W_UV[h]^T, [T, H, V]) and `usable`.
w is kv_b_proj's weight viewed [H, N + V, L] (W_UK = w[:, :N], W_UV = w[:, N:]).

Why: torch.einsum runs these as batched GEMMs of 1-16 rows per head (cuBLAS: ~4.8 us each on
K2's 8 MB per layer at batch 1, ~1.7 TB/s); one program per (head, column block) here reads
its weight tile once and multiplies all the step's tokens (tl.dot, tokens padded to 16).

Invariants: T <= MAX_TOKENS; N, V, L powers of two >= 16 (K2: 128, 128, 512); float32
accumulation, output in the activations' dtype (as the einsum); no host sync (graph-safe).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, cdiv, dot_dtype, require_triton, tl, triton

MAX_TOKENS = 16


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def usable(q_nope: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernels apply: CUDA (or the interpreter), 16-bit activations, few tokens,
    K2-like sizes."""
    H, NV, L = w.shape
    N = q_nope.shape[-1]
    return (
        HAS_TRITON
        and (q_nope.is_cuda or INTERPRET)
        and q_nope.dtype in (torch.bfloat16, torch.float16)  # float32 models: the einsum's
        and w.dtype == q_nope.dtype  # precision (tl.dot here rounds its operands to bf16)
        and q_nope.shape[0] <= MAX_TOKENS
        and w.stride(-1) == 1
        and q_nope.stride(-1) == 1
        and all(_pow2(d) for d in (N, NV - N, L))
    )


if HAS_TRITON:

    @triton.jit
    def _absorb_q_kernel(q_ptr, w_ptr, o_ptr, T, q_st, q_sh, w_sh, w_sn, o_st, o_sh,
                         N: tl.constexpr, BL: tl.constexpr, DOT_DT: tl.constexpr):  # fmt: skip
        h = tl.program_id(0).to(tl.int64)
        offs_l = tl.program_id(1) * BL + tl.arange(0, BL)
        offs_t = tl.arange(0, 16)
        offs_n = tl.arange(0, N)
        t_ok = offs_t < T
        q = tl.load(q_ptr + offs_t[:, None] * q_st + h * q_sh + offs_n[None, :],
                    mask=t_ok[:, None], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + h * w_sh + offs_n[:, None] * w_sn + offs_l[None, :])  # [N, BL]
        acc = tl.dot(q.to(DOT_DT), w.to(DOT_DT))  # [16, BL]
        tl.store(o_ptr + offs_t[:, None] * o_st + h * o_sh + offs_l[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=t_ok[:, None])  # fmt: skip

    @triton.jit
    def _absorb_o_kernel(a_ptr, w_ptr, o_ptr, T, L, a_st, a_sh, w_sh, w_sn, o_st, o_sh,
                         N: tl.constexpr, BV: tl.constexpr, BL: tl.constexpr,
                         DOT_DT: tl.constexpr):  # fmt: skip
        h = tl.program_id(0).to(tl.int64)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        offs_t = tl.arange(0, 16)
        t_ok = offs_t < T
        acc = tl.zeros([16, BV], tl.float32)
        for l0 in range(0, L, BL):
            offs_l = l0 + tl.arange(0, BL)
            a = tl.load(a_ptr + offs_t[:, None] * a_st + h * a_sh + offs_l[None, :],
                        mask=t_ok[:, None], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + h * w_sh + (N + offs_v)[:, None] * w_sn + offs_l[None, :])
            acc += tl.dot(a.to(DOT_DT), tl.trans(w.to(DOT_DT)))  # [16, BV]
        tl.store(o_ptr + offs_t[:, None] * o_st + h * o_sh + offs_v[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=t_ok[:, None])  # fmt: skip


def absorb_q(q_nope: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, N] (any strides, unit last), w [H, N + V, L] -> [T, H, L]."""
    require_triton(q_nope)
    T, H, N = q_nope.shape
    L = w.shape[2]
    out = torch.empty(T, H, L, dtype=q_nope.dtype, device=q_nope.device)
    bl = min(128, L)
    _absorb_q_kernel[(H, cdiv(L, bl))](
        q_nope, w, out, T, q_nope.stride(0), q_nope.stride(1), w.stride(0), w.stride(1),
        out.stride(0), out.stride(1), N=N, BL=bl, DOT_DT=dot_dtype(), num_warps=4,
    )  # fmt: skip
    return out


def absorb_o(o_latent: torch.Tensor, w: torch.Tensor, n_nope: int) -> torch.Tensor:
    """o_latent [T, H, L] (unit last stride), w [H, N + V, L] -> [T, H, V] (V = rows - N)."""
    require_triton(o_latent)
    T, H, L = o_latent.shape
    V = w.shape[1] - n_nope
    out = torch.empty(T, H, V, dtype=o_latent.dtype, device=o_latent.device)
    bv = min(32, V)
    _absorb_o_kernel[(H, cdiv(V, bv))](
        o_latent, w, out, T, L, o_latent.stride(0), o_latent.stride(1), w.stride(0),
        w.stride(1), out.stride(0), out.stride(1), N=n_nope, BV=bv, BL=min(128, L),
        DOT_DT=dot_dtype(), num_warps=4,
    )  # fmt: skip
    return out
