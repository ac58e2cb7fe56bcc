"""Attention: the paged latent KV cache and the MLA backends that read it.

Owns: `allocate_kv_caches`, the KV cache dtype names (`kv_cache_torch_dtype`) and the
backends' constructor by name (`make_attention_backend`); which one a device runs is chosen in
`k2serve.model.backends` (Triton on CUDA, fp8 caches included on NVIDIA sm_80+; else torch).

Invariants: one cache tensor per layer, [num_pages, page_size, kv_lora_rank + qk_rope_head_dim],
dtype = model dtype or float8_e4m3fn (`--kv-cache-dtype fp8`), zero-initialised.
"""

from __future__ import annotations

import torch

from k2serve.attention.base import AttentionMetadata, MLABackend
from k2serve.attention.torch_ref import TorchMLABackend
from k2serve.memory import KV_CACHE_DTYPES, check_kv_cache_dtype


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


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` (a `k2serve.memory.KV_CACHE_DTYPES` name, validated there) -> the
    cache tensors' dtype ("auto" = the model's compute dtype)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return {"auto": model_dtype, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]


def make_attention_backend(
    name: str, kv_dtype: torch.dtype | None = None, policy=None
) -> MLABackend:
    """The MLA backend `name` ("torch" or "triton", as `model.backends.resolve_backends` chose
    it for the device) reading a `kv_dtype` cache; `policy` (a KernelPolicy; None = the default
    tables) gives the Triton decode its tiles."""
    if name == "torch":
        return TorchMLABackend()
    if name != "triton":
        raise ValueError(f"attention backend {name!r}; expected 'torch' or 'triton'")
    from k2serve.attention.triton_mla import TritonMLABackend
    from k2serve.kernels.policy import KernelPolicy

    policy = policy or KernelPolicy()  # the default kind's tables (setup passes its policy)
    return TritonMLABackend(
        prefill=policy.mla_prefill,
        prefill_attn=policy.mla_prefill_attn,
        prefill_configs=policy.tables.mla_prefill,
        decode_configs={f: policy.mla_decode_config(f) for f in (False, True)},
    )


__all__ = [
    "AttentionMetadata",
    "KV_CACHE_DTYPES",
    "MLABackend",
    "TorchMLABackend",
    "allocate_kv_caches",
    "kv_cache_torch_dtype",
    "make_attention_backend",
]
