"""Kernel tests run on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1 is set
here before Triton is imported when no GPU is present). Without Triton they skip."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore = []
try:
    import triton  # noqa: F401
except ImportError:  # no Triton: the kernel tests are skipped, not failed
    collect_ignore = ["test_kernels.py", "test_mla_fp8.py", "test_moe_select.py"]
