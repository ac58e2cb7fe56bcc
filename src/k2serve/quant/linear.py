"""Linear layers for each weight format, with the checkpoint's parameter names.

Invariants:
- Parameter names and dtypes equal the checkpoint's: `weight` (model dtype) for bf16;
  `weight` float8_e4m3fn + `weight_scale_inv` float32 for fp8_block; `weight_packed` int32 +
  `weight_scale` bf16 + `weight_shape` int32 for int4_group. The loader casts each checkpoint
  tensor to the dtype of the parameter it fills, so these dtypes are what stays in memory.
- Quantized weights stay quantized; `forward` (the reference path) dequantizes per call into
  the activation dtype. `dequantized_weight(dtype)` is the one place that does it.
- No biases (Kimi / DeepSeek-V3 have none).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from k2serve.kernels.policy import KernelTables
from k2serve.quant.fp8 import dequantize_fp8_block
from k2serve.quant.int4 import PACK_FACTOR, dequantize_int4


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def linear(x: torch.Tensor, w: torch.Tensor, gemv_table: Mapping | None = None) -> torch.Tensor:
    """F.linear, or the one-row GEMV kernel (kernels/gemv.py) for a single row on CUDA when
    `gemv_table` is given (the kernel policy's tuned configs; set by
    DeepseekV3ForCausalLM.apply_kernel_policy when the policy's decode_gemv is on), or on the CPU
    the CPU kernel's GEMV for decode-sized batches (kernels.cpu.cpu_linear)."""
    if gemv_table is not None:  # NOTE: imported here: importing k2serve never imports Triton
        from k2serve.kernels.gemv import gemv, use_gemv

        if use_gemv(x, w, gemv_table):
            return gemv(x, w, table=gemv_table)
    if x.device.type == "cpu":
        from k2serve.kernels.cpu import cpu_linear

        y = cpu_linear(x, w)
        if y is not None:
            return y
    return F.linear(x, w)


class LinearBase(nn.Module):
    scheme = "none"
    # bf16 weights: the one-row GEMV kernel's configs at batch 1 on CUDA (None: off); set by
    # the kernel policy at setup
    gemv_table: Mapping | None = None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:  # [out, in]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


class UnquantizedLinear(LinearBase):
    scheme = "bf16"

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features)
        self.weight = _param(torch.empty(out_features, in_features, dtype=dtype))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.dequantized_weight(x.dtype), self.gemv_table)


class Fp8BlockLinear(LinearBase):
    scheme = "fp8_block"
    # the kernel policy's tables when its fp8_gemm is on (set at setup; None: reference path)
    kernel_tables: KernelTables | None = None

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]) -> None:
        super().__init__(in_features, out_features)
        self.block: tuple[int, int] = (block[0], block[1])
        rb, cb = -(-out_features // block[0]), -(-in_features // block[1])
        self.weight = _param(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.weight_scale_inv = _param(torch.empty(rb, cb, dtype=torch.float32))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight.is_cuda and tuple(self.block) == (128, 128):  # one Triton pass, same
            from k2serve.kernels.fp8_linear import HAS_TRITON, dequant_fp8_block  # values

            if HAS_TRITON:
                return dequant_fp8_block(self.weight, self.weight_scale_inv, dtype)
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """With the kernel policy's fp8_gemm, on CUDA up to the tables' fp8_kernel_max_rows
        rows: the FP8 block GEMM kernel, which reads the weight once as fp8 (decode);
        otherwise dequantize, then F.linear."""
        t = self.kernel_tables
        if t is not None and x.is_cuda:  # NOTE: imported here: k2serve never imports Triton
            from k2serve.kernels import fp8_linear

            rows = x.numel() // max(1, x.shape[-1])
            if rows <= t.fp8_kernel_max_rows and fp8_linear.use_fp8_kernel(
                x, self.weight, self.block
            ):
                return fp8_linear.fp8_block_matmul(
                    x, self.weight, self.weight_scale_inv, table=t.fp8_linear
                )
        return F.linear(x, self.dequantized_weight(x.dtype))


class Int4GroupLinear(LinearBase):
    scheme = "int4_group"

    def __init__(self, in_features: int, out_features: int, group_size: int) -> None:
        super().__init__(in_features, out_features)
        self.group_size = group_size
        words = -(-in_features // PACK_FACTOR)
        groups = -(-in_features // group_size)
        self.weight_packed = _param(torch.empty(out_features, words, dtype=torch.int32))
        self.weight_scale = _param(torch.empty(out_features, groups, dtype=torch.bfloat16))
        self.weight_shape = _param(torch.empty(2, dtype=torch.int32))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(
            self.weight_packed, self.weight_scale, self.in_features, self.group_size, dtype
        )


def make_linear(
    in_features: int, out_features: int, scheme: str, dtype: torch.dtype, quant=None
) -> LinearBase:
    """One linear layer in `scheme` ("bf16", "fp8_block", "int4_group")."""
    if scheme == "bf16":
        return UnquantizedLinear(in_features, out_features, dtype)
    if scheme == "fp8_block":
        return Fp8BlockLinear(in_features, out_features, quant.block_size)
    if scheme == "int4_group":
        return Int4GroupLinear(in_features, out_features, quant.group_size)
    raise ValueError(f"unknown linear scheme {scheme!r}")
