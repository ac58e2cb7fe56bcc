"""`sdpa`: torch's scaled_dot_product_attention kept off cuDNN's backend on CUDA.

Why: cuDNN's SDPA builds an execution plan for every new shape. On the H100 that cost a K2
prompt step 90-110 ms the first time each prompt length was seen (a 777-token step 125 ms
against 18 ms steady; `benchmarks/model_speed.py --parts warmup`, RESULTS.md), and a server sees
a new length with nearly every request, which no start-up warm-up can cover. The flash and
memory-efficient backends have no per-shape set-up (first step of a new length 1.02-1.24x its
steady time) and were 2-6% slower than cuDNN's steady state on those steps.
Order: flash (no mask), memory-efficient (boolean / additive masks), math (anything else).
On the CPU the call is torch's as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NO_CUDNN = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, **kwargs), without cuDNN on CUDA tensors."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(list(NO_CUDNN)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
