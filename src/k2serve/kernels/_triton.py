"""Triton import guard shared by the kernels.

Owns: whether Triton can be used (`HAS_TRITON`), whether it runs under its CPU interpreter
(`INTERPRET`, set by `TRITON_INTERPRET=1`), and the dtype used for `tl.dot` operands.

Invariants:
- Importing k2serve never requires Triton; kernels raise `RuntimeError` naming the problem
  when called without it.
- `DOT_DTYPE` is bf16 on a GPU; under the interpreter it is fp32, because Triton's interpreter
  (3.9) computes bf16 `tl.dot` wrongly on CPU (it returns values ~1e10 for unit inputs).
"""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - any import failure means "no Triton"
    triton = None
    tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_dtype():
    """The `tl.dot` operand dtype: bf16 on GPU, fp32 under the CPU interpreter."""
    return tl.float32 if INTERPRET else tl.bfloat16


def require_triton(t) -> None:
    """Raise a clear error when a Triton kernel cannot run on tensor `t`'s device."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed: install k2serve[gpu] or use the torch backend")
    if t.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 to run "
            "them on the CPU interpreter"
        )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
