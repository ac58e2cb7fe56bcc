"""Triton MLA backend: the same interface as `TorchMLABackend` (store + absorbed forward).

Owns: `TritonMLABackend`. Invariants: no host synchronisation in `store` or `forward` (CUDA
graph safe when the metadata tensors are static buffers); the number of KV splits depends only
on the host-side ints in the metadata (max_query_len, max_seq_len, batch size), so a captured
graph stays valid while sequence lengths change inside it.
"""

from __future__ import annotations

import torch

from k2serve.attention.base import AttentionMetadata, MLABackend
from k2serve.kernels.kv_store import store_latent_kv
from k2serve.kernels.mla_attention import mla_attention


class TritonMLABackend(MLABackend):
    name = "triton"

    def store(
        self,
        kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
        latent: torch.Tensor,  # [T, L]
        k_pe: torch.Tensor,  # [T, R]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        store_latent_kv(kv_cache, latent, k_pe, slot_mapping)

    def forward(
        self,
        q_latent: torch.Tensor,  # [T, H, L]
        q_pe: torch.Tensor,  # [T, H, R]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, L]
        return mla_attention(
            q_latent,
            q_pe,
            kv_cache,
            metadata.query_start_loc,
            metadata.context_lens,
            metadata.block_table,
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
        )
