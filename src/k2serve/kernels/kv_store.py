"""Latent-cache store: write each new token's normed latent and roped key into its page slot.

Owns: `store_latent_kv(...)` (Triton) and `store_latent_kv_ref(...)` (torch reference).
Layout (docs/interfaces.md): cache `[num_pages, page_size, L + R]`, latent first, roped key last;
slot = page * page_size + offset. Slots < 0 (padding tokens, as in vLLM) are skipped.

fp8 cache (float8_e4m3fn), the format of the torch reference backend (attention/torch_ref.py):
stored = e4m3(clamp(x / kv_scale, -448, 448)), rounded to nearest even; a NaN stays NaN. The
kernel computes the e4m3 byte with integer arithmetic on the float32 bits and writes it through
a uint8 view, so its bytes equal torch's on every GPU and under Triton's CPU interpreter (whose
own fp32 -> fp8 cast neither rounds to nearest even nor saturates).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, require_triton, tl, triton

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_ref(x: torch.Tensor, kv_scale: float = 1.0) -> torch.Tensor:
    """x -> float8_e4m3fn as the fp8 latent cache stores it (torch reference)."""
    return (x.to(torch.float32) / kv_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def store_latent_kv_ref(
    kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    latent: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    slot_mapping: torch.Tensor,  # [T] int64
    kv_scale: float = 1.0,  # fp8 caches only
) -> None:
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    rows = torch.cat([latent, k_pe], dim=-1)[keep]
    if kv_cache.dtype == torch.float8_e4m3fn:
        flat[slot_mapping[keep]] = quantize_fp8_ref(rows, kv_scale)
    else:
        flat[slot_mapping[keep]] = rows.to(kv_cache.dtype)


if HAS_TRITON:

    @triton.jit
    def _e4m3_bits(x, kv_scale):
        """float8_e4m3fn bytes (uint8) of float32 `x / kv_scale`: saturated at +-448, rounded
        to nearest even (integer arithmetic on the float32 bits), NaN -> 0x7F | sign."""
        u = tl.math.div_rn(x, kv_scale).to(tl.int32, bitcast=True)
        sign = (u >> 24) & 0x80
        a = u & 0x7FFFFFFF  # |x| bits
        nan = a > 0x7F800000
        a = tl.minimum(a, 0x43E00000)  # 448.0 (inf too)
        # |x| >= 2^-6 (normal e4m3): round the 23-bit mantissa to 3 bits, ties to even; the
        # carry may step the exponent. Exponent bias 127 -> 7: subtract 120 << 3.
        r = a + 0x7FFFF + ((a >> 20) & 1)
        normal = (r >> 20) - (120 << 3)
        # |x| < 2^-6 (sub-normal e4m3, steps of 2^-9): round |x| * 2^9 = m * 2^(e - 141) to an
        # integer, ties to even (8 is the code of 2^-6, the smallest normal)
        sh = tl.minimum(tl.maximum(141 - (a >> 23), 1), 31)
        m = (a & 0x7FFFFF) | 0x800000
        q = m >> sh
        rem = m - (q << sh)
        half = 1 << (sh - 1)
        q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
        code = tl.where(a >= 0x3C800000, normal, q)  # 0x3C800000 = 2^-6
        code = tl.where(nan, 0x7F, code) | sign
        return code.to(tl.uint8)

    @triton.jit
    def _store_kernel(
        cache_ptr, lat_ptr, pe_ptr, slot_ptr, lat_stride, pe_stride, kv_scale,
        L: tl.constexpr, R: tl.constexpr, FP8: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        dst = cache_ptr + slot * (L + R)
        lat = tl.load(lat_ptr + t * lat_stride + offs_l)
        pe = tl.load(pe_ptr + t * pe_stride + offs_r)
        if FP8:  # cache_ptr is the uint8 view of a float8_e4m3fn cache
            tl.store(dst + offs_l, _e4m3_bits(lat.to(tl.float32), kv_scale))
            tl.store(dst + L + offs_r, _e4m3_bits(pe.to(tl.float32), kv_scale))
        else:
            tl.store(dst + offs_l, lat.to(cache_ptr.dtype.element_ty))
            tl.store(dst + L + offs_r, pe.to(cache_ptr.dtype.element_ty))


def store_latent_kv(
    kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
    latent: torch.Tensor,  # [T, L] (row stride may be larger, e.g. a view of kv_a output)
    k_pe: torch.Tensor,  # [T, R]
    slot_mapping: torch.Tensor,  # [T] int64
    kv_scale: float = 1.0,  # float8_e4m3fn caches: stored = x / kv_scale
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
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8 and not kv_scale > 0:
        raise ValueError(f"kv_scale={kv_scale} must be positive")
    if T == 0:
        return
    _store_kernel[(T,)](
        kv_cache.view(torch.uint8) if fp8 else kv_cache, latent, k_pe, slot_mapping,
        latent.stride(0), k_pe.stride(0), float(kv_scale), L=L, R=R, FP8=fp8, num_warps=4,
    )  # fmt: skip
