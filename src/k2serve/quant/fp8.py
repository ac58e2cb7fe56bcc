"""FP8 block quantization as in Kimi-K2-Instruct / DeepSeek-V3 (spec §2.1).

Invariants:
- weight float8_e4m3fn [out, in]; weight_scale_inv float32 [ceil(out/bo), ceil(in/bi)].
- Dequantization MULTIPLIES: W[i, j] = fp8[i, j] * scale_inv[i // bo, j // bi]; edge blocks
  may be partial (576 = 4 * 128 + 64 rows gives 5 row blocks).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    s = scale.to(torch.float32).repeat_interleave(block[0], dim=0)[: shape[0]]
    return s.repeat_interleave(block[1], dim=1)[:, : shape[1]]


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (weight float8_e4m3fn [out, in], weight_scale_inv float32)."""
    out, cols = w.shape
    bo, bi = block
    rb, cb = -(-out // bo), -(-cols // bi)
    wf = torch.nn.functional.pad(w.to(torch.float32), (0, cb * bi - cols, 0, rb * bo - out))
    absmax = wf.view(rb, bo, cb, bi).abs().amax(dim=(1, 3))  # [rb, cb]
    scale_inv = (absmax / FP8_MAX).clamp_min(1e-12)
    q = (w.to(torch.float32) / _expand(scale_inv, (out, cols), block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    out, cols = weight.shape
    rb, cb = -(-out // block[0]), -(-cols // block[1])
    if tuple(scale_inv.shape) != (rb, cb):
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"[{out}, {cols}] with block {block}: expected [{rb}, {cb}]"
        )
    return (weight.to(torch.float32) * _expand(scale_inv, (out, cols), block)).to(dtype)
