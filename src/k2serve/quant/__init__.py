"""Weight formats: which scheme each linear layer uses, and the layers themselves.

Invariants:
- The scheme is decided from config.json's `quantization_config` (never guessed from names):
  int4_group: every Linear not matched by the `ignore` list; fp8_block: the linears that have a
  `weight_scale_inv` tensor in the checkpoint, or (no checkpoint, e.g. dummy weights) every
  linear except lm_head, as in Kimi-K2-Instruct.
- The router (`mlp.gate`) and embeddings are never quantized.
"""

from __future__ import annotations

from k2serve.config import QuantConfig
from k2serve.quant.linear import (
    Fp8BlockLinear,
    Int4GroupLinear,
    LinearBase,
    UnquantizedLinear,
    make_linear,
)


def linear_scheme(
    ckpt_name: str, quant: QuantConfig | None, tensor_names: frozenset[str] | None = None
) -> str:
    """Scheme of the linear module with checkpoint name `ckpt_name` (prefix included)."""
    if quant is None:
        return "bf16"
    if quant.method == "int4_group":
        return "bf16" if quant.is_ignored(ckpt_name) else "int4_group"
    if quant.method == "fp8_block":
        if tensor_names is not None:
            return "fp8_block" if f"{ckpt_name}.weight_scale_inv" in tensor_names else "bf16"
        return "bf16" if ckpt_name.endswith("lm_head") else "fp8_block"
    raise ValueError(f"unknown quantization method {quant.method!r}")


__all__ = [
    "Fp8BlockLinear",
    "Int4GroupLinear",
    "LinearBase",
    "UnquantizedLinear",
    "linear_scheme",
    "make_linear",
]
