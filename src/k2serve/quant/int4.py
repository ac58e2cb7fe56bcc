"""INT4 group quantization in the compressed-tensors `pack-quantized` layout (spec §2.2).

Invariants:
- A signed value q in [-8, 7] is stored as q + 8 in a 4-bit nibble; 8 nibbles per int32 along
  the input dimension; column 8k+i lives in bits [4i, 4i+4) of packed[:, k] (lowest nibble =
  lowest column). A partial last word has zero bits in its unused nibbles (as compressed-tensors'
  `pack_to_int32` leaves them).
- Symmetric, no zero point: W[o, j] = q[o, j] * weight_scale[o, j // group_size].
- `weight_shape` is int32 [out_features, in_features].
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] integer in [-8, 7] -> packed [out, ceil(in / 8)] int32."""
    if q.dim() != 2:
        raise ValueError(f"pack_int4 needs a 2-D tensor, got shape {tuple(q.shape)}")
    qi = q.to(torch.int64)
    if qi.numel() and (qi.min() < -8 or qi.max() > 7):
        raise ValueError("pack_int4: values must lie in [-8, 7]")
    out, cols = qi.shape
    words = -(-cols // PACK_FACTOR)
    pad = words * PACK_FACTOR - cols
    u = qi + 8  # [out, in] in [0, 15]
    if pad:
        u = torch.cat([u, torch.zeros((out, pad), dtype=torch.int64, device=u.device)], dim=1)
    u = u.view(out, words, PACK_FACTOR)
    shifts = torch.arange(0, 4 * PACK_FACTOR, 4, dtype=torch.int64, device=u.device)
    acc = (u << shifts).sum(dim=-1)  # [out, words] in [0, 2^32)
    acc = torch.where(acc >= 2**31, acc - 2**32, acc)
    return acc.to(torch.int32)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """packed [out, words] int32 -> q [out, in_features] int8 in [-8, 7]."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(
            f"unpack_int4 needs a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    if packed.shape[1] * PACK_FACTOR < in_features:
        raise ValueError(
            f"unpack_int4: {packed.shape[1]} words hold fewer than in_features={in_features} values"
        )
    shifts = torch.arange(0, 4 * PACK_FACTOR, 4, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [out, words, 8]
    q = nib.reshape(packed.shape[0], -1)[:, :in_features] - 8
    return q.to(torch.int8)


def quantize_int4(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (weight_packed int32, weight_scale [out, ceil(in/g)], weight_shape)."""
    out, cols = w.shape
    groups = -(-cols // group_size)
    wf = w.to(torch.float32)
    pad = groups * group_size - cols
    wp = torch.nn.functional.pad(wf, (0, pad)) if pad else wf
    absmax = wp.view(out, groups, group_size).abs().amax(dim=-1)  # [out, groups]
    scale = (absmax / 7.0).clamp_min(1e-8).to(scale_dtype)  # [out, groups]
    s_full = scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :cols]
    q = torch.round(wf / s_full).clamp_(-8, 7)
    shape = torch.tensor([out, cols], dtype=torch.int32)
    return pack_int4(q), scale, shape


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    in_features: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """-> W [out, in_features] in `dtype` (computed in float32)."""
    q = unpack_int4(packed, in_features).to(torch.float32)
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :in_features]
    return (q * s).to(dtype)
