"""Attention: the paged latent KV cache and the MLA backends that read it.

Invariants: one cache tensor per layer, [num_pages, page_size, kv_lora_rank + qk_rope_head_dim],
dtype = model dtype, zero-initialised.
"""

from __future__ import annotations

import torch

from k2serve.attention.base import AttentionMetadata, MLABackend
from k2serve.attention.torch_ref import TorchMLABackend


def allocate_kv_caches(
    config, num_pages: int, page_size: int, dtype: torch.dtype, device="cpu"
) -> list[torch.Tensor]:
    """One [num_pages, page_size, L + R] tensor per layer."""
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be positive")
    return [
        torch.zeros(num_pages, page_size, config.kv_cache_dim, dtype=dtype, device=device)
        for _ in range(config.num_hidden_layers)
    ]


__all__ = ["AttentionMetadata", "MLABackend", "TorchMLABackend", "allocate_kv_caches"]
