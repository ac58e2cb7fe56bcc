"""Attention: the paged latent KV cache and the MLA backends that read it.

Owns: `allocate_kv_caches`, the KV cache dtype names (`kv_cache_torch_dtype`) and the backend
choice (`make_attention_backend`: "auto" = Triton on CUDA when Triton is importable, else the
torch reference; an fp8 cache takes Triton too where its kernel reads fp8: NVIDIA sm_80+).

Invariants: one cache tensor per layer, [num_pages, page_size, kv_lora_rank + qk_rope_head_dim],
dtype = model dtype or float8_e4m3fn (`--kv-cache-dtype fp8`), zero-initialised.
"""

from __future__ import annotations

import logging

import torch

from k2serve.attention.base import AttentionMetadata, MLABackend
from k2serve.attention.torch_ref import TorchMLABackend, is_fp8
from k2serve.kernels.policy import triton_usable

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")  # as k2serve.plan


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
    """`--kv-cache-dtype` -> the cache tensors' dtype ("auto" = the model's compute dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "bf16":
        return torch.bfloat16
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}")


def make_attention_backend(
    name: str, device: torch.device | str, kv_dtype: torch.dtype | None = None, policy=None
) -> MLABackend:
    """The MLA backend for `name` in ATTENTION_BACKENDS on `device` with a `kv_dtype` cache;
    `policy` (a KernelPolicy; None = the default tables) gives the Triton decode its tiles."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r}; expected one of {ATTENTION_BACKENDS}")
    fp8 = kv_dtype is not None and is_fp8(kv_dtype)
    if name == "triton" and not triton_usable(device):
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device and Triton (device is {device}); "
            "use 'auto' or 'torch'"
        )
    if name == "torch" or (name == "auto" and not triton_usable(device)):
        return TorchMLABackend()
    if fp8:
        from k2serve.kernels.mla_attention import fp8_cache_supported

        if not fp8_cache_supported(device):
            if name == "triton":
                raise ValueError(
                    f"attention_backend='triton' cannot read an fp8 KV cache on {device} (needs "
                    "an NVIDIA GPU of compute capability 8.0+); use 'auto' or 'torch'"
                )
            logger.warning(
                "kv_cache_dtype fp8: the Triton MLA kernel reads fp8 caches on NVIDIA sm_80+ "
                "only; using the torch reference attention backend on %s (slower decode, no "
                "decode CUDA graphs)",
                device,
            )
            return TorchMLABackend()
    from k2serve.attention.triton_mla import TritonMLABackend
    from k2serve.kernels.policy import KernelPolicy

    policy = policy or KernelPolicy()  # the default kind's tables (setup passes its policy)
    return TritonMLABackend(decode_configs={f: policy.mla_decode_config(f) for f in (False, True)})


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "KV_CACHE_DTYPES",
    "MLABackend",
    "TorchMLABackend",
    "allocate_kv_caches",
    "kv_cache_torch_dtype",
    "make_attention_backend",
    "triton_usable",
]
