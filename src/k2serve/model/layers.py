"""Small building blocks of the DeepSeek-V3 / Kimi-K2 model: RMSNorm, YaRN rotary embedding.

Invariants:
- RMSNorm normalises in float32 and casts back to the input dtype before the weight multiply,
  exactly as transformers' `DeepseekV3RMSNorm`. With a residual, the sum x + residual is rounded
  to the activation dtype first (as the unfused `h = h + f(h)`), then normalised. The Triton
  path (CUDA only) multiplies by the weight in float32: at most one bf16 rounding apart.
- RoPE rotates interleaved pairs (2i, 2i+1) by frequency i (GPT-J style), which equals
  transformers' `apply_rotary_pos_emb_interleave`. Inverse frequencies follow transformers'
  `_compute_yarn_parameters` (truncated correction range, clamped to [0, dim-1]).
- The rotary tables are plain float32 tensors built on the CPU (never on the meta device) and
  moved to the input's device on first use.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`forward(x)` -> norm(x); `add_norm(x, residual)` -> (norm(x + residual), x + residual).

    `use_triton` (set by `DeepseekV3ForCausalLM.install_backends`) runs the fused Triton kernel
    (k2serve.kernels.rmsnorm) for CUDA inputs; `add_norm` then updates `residual` IN PLACE
    (vLLM's fused_add_rms_norm), so callers must treat the residual they pass as consumed.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.variance_epsilon = eps
        self.use_triton = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton and x.is_cuda:
            return self._triton(x, None)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the sum is rounded to x's dtype first."""
        if self.use_triton and x.is_cuda:
            if not residual.is_contiguous():
                residual = residual.contiguous()
            return self._triton(x, residual), residual
        residual = x + residual
        return self.forward(residual), residual

    def _triton(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        from k2serve.kernels.rmsnorm import rms_norm

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [T, N]; a view when x is a row-strided split
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        res2 = residual.view(-1, shape[-1]) if residual is not None else None
        return rms_norm(x2, self.weight, self.variance_epsilon, res2).view(shape)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(
    rotary_dim: int, base: float, rope_scaling: dict | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_factor for cos/sin)."""
    pos_freqs = base ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
    )
    if not rope_scaling:
        return 1.0 / pos_freqs, 1.0
    rs = rope_scaling
    orig = int(rs.get("original_max_position_embeddings") or max_position_embeddings)
    factor = rs.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / orig
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if rs.get("attention_factor") is not None:
        attention_factor = float(rs["attention_factor"])
    elif mscale and mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low),
        0,
        1,
    )
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    # ramp = 0 keeps the original frequency, ramp = 1 interpolates (divides by factor)
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    return inv_freq, attention_factor


class YarnRotaryEmbedding:
    """Interleaved-pair rotary embedding with YaRN frequencies (not an nn.Module: no state)."""

    def __init__(
        self, rotary_dim: int, base: float, rope_scaling: dict | None, max_position_embeddings: int
    ) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq, self.attention_factor = rope_parameters(
            rotary_dim, base, rope_scaling, max_position_embeddings
        )  # [rotary_dim // 2] float32 on CPU
        self._per_device: dict[torch.device, torch.Tensor] = {}
        # (positions, cos, sin) of the current forward step: every layer rotates with the same
        # positions tensor, so the tables are computed once per step (set by `step_cache`)
        self._caching = False
        self._cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def step_cache(self, on: bool) -> None:
        """Start (True) or end (False) one forward step: within it, `cos_sin` of the same
        positions tensor object is computed once."""
        self._caching = on
        self._cache = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim // 2] float32."""
        c = self._cache
        if c is not None and c[0] is positions:
            return c[1], c[2]
        cos, sin = self._cos_sin(positions)
        if self._caching:
            self._cache = (positions, cos, sin)
        return cos, sin

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._per_device.get(positions.device)
        if inv is None:
            inv = self._per_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., rotary_dim] (pairs interleaved) -> rotated, laid out as transformers does:
        the even-index results first, then the odd-index results ([x1', x2'] concatenated).

        cos/sin [T, rotary_dim // 2] are cast to x's dtype (as transformers does).
        """
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        c = cos.to(x.dtype).view(shape)
        s = sin.to(x.dtype).view(shape)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
