"""Fused rotary embedding of MLA's q_pe and k_pe in one launch (decode spends ~24 small torch
kernels per layer on RoPE otherwise).

Owns: `rope_qk(q_pe, k_pe, cos, sin)` (Triton) and `rope_error_ratio`. Its reference is the
model's torch code (`model.layers.YarnRotaryEmbedding.apply` on both), which the tests and
benchmarks call (kernels never import the model).

Contract: q_pe [T, H, R] and k_pe [T, R] (any strides with unit last stride, e.g. views into
the q_b_proj / kv_a_proj outputs), cos/sin [T, R/2] float32 -> new contiguous tensors
[T, H, R] and [T, R] in x's dtype, laid out as transformers does (the rotated even-index
elements first, then the odd-index ones). The rounding steps of the torch code are written out
(cos/sin cast to x's dtype, each product and the sum/difference rounded to x's dtype); on the
H200 results are not all bit-equal to the torch path, so the contract is: within one rounding
error bound of it (`rope_error_ratio`; tests/kernels, benchmarks/model_speed.py).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton


def rope_error_ratio(out: torch.Tensor, x: torch.Tensor, cos, sin) -> float:
    """max |out - exact| / (u * (|x1 c| + |x2 s|)) over all elements, exact = the float64
    rotation of x and u = the unit roundoff of out's dtype. The torch code (three roundings:
    cos/sin to x's dtype, each product, the sum) stays at or under 3 on a GPU."""
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[out.dtype]
    xd = x.double()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.double().view(shape), sin.double().view(shape)
    x1, x2 = xd[..., 0::2], xd[..., 1::2]
    exact = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    mag = torch.cat([(x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()], -1)
    return ((out.double() - exact).abs() / (u * mag).clamp_min(1e-300)).max().item()


if HAS_TRITON:

    @triton.jit
    def _rot(x_ptr, o_ptr, offs_h, h_ok, x_sh, o_sh, c, s, HALF: tl.constexpr):
        """Rotate rows x_ptr + offs_h * x_sh (pairs interleaved) into o_ptr (halves)."""
        i = tl.arange(0, HALF)
        m = h_ok[:, None]
        x1 = tl.load(x_ptr + offs_h[:, None] * x_sh + 2 * i[None, :], mask=m, other=0.0)
        x2 = tl.load(x_ptr + offs_h[:, None] * x_sh + 2 * i[None, :] + 1, mask=m, other=0.0)
        dt = x1.dtype
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        r1 = (a * c).to(dt).to(tl.float32) - (b * s).to(dt).to(tl.float32)
        r2 = (b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)
        base = o_ptr + offs_h[:, None] * o_sh + i[None, :]
        tl.store(base, r1.to(o_ptr.dtype.element_ty), mask=m)
        tl.store(base + HALF, r2.to(o_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_qk_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, H,
        q_st, q_sh, k_st, cs_st, qo_st,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        i = tl.arange(0, HALF)
        dt = q_ptr.dtype.element_ty
        c = tl.load(cos_ptr + t * cs_st + i).to(dt).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * cs_st + i).to(dt).to(tl.float32)[None, :]
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        _rot(q_ptr + t * q_st, qo_ptr + t * qo_st, offs_h, offs_h < H, q_sh, 2 * HALF, c, s,
             HALF)  # fmt: skip
        if hb == 0:
            one = tl.arange(0, 1)
            _rot(k_ptr + t * k_st, ko_ptr + t * (2 * HALF), one, one < 1, 0, 0, c, s, HALF)


def rope_qk(
    q_pe: torch.Tensor,  # [T, H, R]
    k_pe: torch.Tensor,  # [T, R]
    cos: torch.Tensor,  # [T, R/2] float32
    sin: torch.Tensor,  # [T, R/2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(q_pe)
    T, H, R = q_pe.shape
    if R % 2 or k_pe.shape != (T, R) or cos.shape != (T, R // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"rope_qk: q_pe {tuple(q_pe.shape)}, k_pe {tuple(k_pe.shape)}, cos "
            f"{tuple(cos.shape)} do not fit [T, H, R], [T, R], [T, R/2]"
        )
    half = R // 2
    if half & (half - 1) or q_pe.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("rope_qk: R/2 must be a power of two and the last strides 1")
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty(T, H, R, dtype=q_pe.dtype, device=q_pe.device)
    ko = torch.empty(T, R, dtype=k_pe.dtype, device=k_pe.device)
    if T == 0:
        return qo, ko
    bh = min(64, triton.next_power_of_2(H))
    _rope_qk_kernel[(T, triton.cdiv(H, bh))](
        q_pe, k_pe, cos, sin, qo, ko, H,
        q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), cos.stride(0), qo.stride(0),
        HALF=half, BLOCK_H=bh, num_warps=4,
    )  # fmt: skip
    return qo, ko
