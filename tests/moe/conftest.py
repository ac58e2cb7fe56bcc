"""Triton kernels (the router's top-k) run on CPU under Triton's interpreter here, as in
tests/kernels: TRITON_INTERPRET=1 is set before Triton is imported when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
