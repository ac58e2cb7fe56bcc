"""Latent-cache store: write each new token's normed latent and roped key into its page slot.

Owns: `store_latent_kv(...)` (Triton) and `store_latent_kv_ref(...)` (torch reference).
Layout (docs/interfaces.md): cache `[num_pages, page_size, L + R]`, latent first, roped key last;
slot = page * page_size + offset. Slots < 0 (padding tokens, as in vLLM) are skipped.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton


def store_latent_kv_ref(
    kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    latent: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = torch.cat([latent, k_pe], dim=-1)[keep].to(kv_cache.dtype)


if HAS_TRITON:

    @triton.jit
    def _store_kernel(
        cache_ptr, lat_ptr, pe_ptr, slot_ptr, lat_stride, pe_stride,
        L: tl.constexpr, R: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        dst = cache_ptr + slot * (L + R)
        lat = tl.load(lat_ptr + t * lat_stride + offs_l)
        tl.store(dst + offs_l, lat.to(cache_ptr.dtype.element_ty))
        pe = tl.load(pe_ptr + t * pe_stride + offs_r)
        tl.store(dst + L + offs_r, pe.to(cache_ptr.dtype.element_ty))


def store_latent_kv(
    kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    latent: torch.Tensor,  # [T, L] (row stride may be larger, e.g. a view of kv_a output)
    k_pe: torch.Tensor,  # [T, R]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    require_triton(latent)
    T, L = latent.shape
    R = k_pe.shape[-1]
    if kv_cache.shape[-1] != L + R:
        raise ValueError(f"kv_cache last dim {kv_cache.shape[-1]} != {L} + {R}")
    if slot_mapping.shape[0] != T or k_pe.shape[0] != T:
        raise ValueError("latent, k_pe and slot_mapping must have the same number of tokens")
    if latent.stride(-1) != 1 or k_pe.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("store_latent_kv needs unit last-dim strides and a contiguous cache")
    if T == 0:
        return
    _store_kernel[(T,)](
        kv_cache, latent, k_pe, slot_mapping, latent.stride(0), k_pe.stride(0), L=L, R=R,
        num_warps=4,
    )  # fmt: skip
