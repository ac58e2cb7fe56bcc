"""Absorbed MLA decode over a paged bf16 latent cache with the native CPU kernel (k2mla.h).

Owns: `mla_decode()`, one sequence's new tokens (a decode, or the few tokens of a speculative
verify step) against its cached rows, read in place through its pages; `mla_paths()`, which of
the kernel's paths this CPU and build can run.

Paths: PATH_AMX (tile unit: scores^T = cache rows x Q^T, P x V), PATH_AVX512 (vdpbf16ps), chosen
at run time (PATH_AUTO: AMX where Linux grants it, else AVX512-BF16); None back when neither
runs (no compiler, a CPU without AVX512-BF16, unsupported shapes): then the torch paths run.
Scores, softmax and the split-KV merge are float32; P and the output are rounded to bf16.
"""

from __future__ import annotations

import os

import torch

import k2serve.kernels.cpu as ck

PATH_AUTO, PATH_AMX, PATH_AVX512 = 0, 1, 2
PATH_NAMES = {PATH_AMX: "amx", PATH_AVX512: "avx512_bf16"}


def _ok(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> bool:
    E, L = q.shape[-1], out.shape[-1]
    return (
        q.device.type == kv_cache.device.type == out.device.type == "cpu"
        and q.dtype == kv_cache.dtype == out.dtype == torch.bfloat16
        and q.dim() == 3
        and kv_cache.dim() == 3
        and kv_cache.shape[-1] == E
        and out.shape[:2] == q.shape[:2]
        and E % 32 == 0
        and L % 32 == 0
        and L <= E
        and q.is_contiguous()
        and kv_cache.is_contiguous()
        and out.is_contiguous()
        and not q.requires_grad
        and not ck.dispatch_mode_active()
    )


def mla_decode(
    q: torch.Tensor,  # [n, H, E] bf16: [q_latent | q_pe] of one sequence's n new tokens
    kv_cache: torch.Tensor,  # [num_pages, page_size, E] bf16, contiguous
    pages: torch.Tensor,  # [>= ceil(seq_len / page_size)] the sequence's pages (any int dtype)
    seq_len: int,  # cached rows including the new tokens' own (ctx = seq_len - n)
    scale: float,
    out: torch.Tensor,  # [n, H, L] bf16, contiguous: written
    path: int = PATH_AUTO,
) -> int | None:
    """Causal MLA of the n new tokens (token t sees keys 0 .. seq_len - n + t) into `out`;
    the path that ran, or None when the kernel cannot run here (nothing written)."""
    if not _ok(q, kv_cache, out):
        return None
    lp = ck._default_pool(os.getpid())  # (library, the kernel's shared pool) or None
    if lp is None:
        return None
    lib, pool = lp
    n, H, E = q.shape
    ps = kv_cache.shape[1]
    need = -(-seq_len // ps)
    if seq_len < n or pages.numel() < need:
        raise ValueError(f"seq_len {seq_len}: {n} new tokens, {pages.numel()} pages of {ps}")
    pg = pages[:need].to(device="cpu", dtype=torch.int32).contiguous()
    rc = lib.k2_mla_decode(pool._ptr, q.data_ptr(), n, H, kv_cache.data_ptr(), ps, E,
                           out.shape[-1], pg.data_ptr(), seq_len, float(scale), out.data_ptr(),
                           path)  # fmt: skip
    if rc < 0:
        raise ValueError(f"k2_mla_decode rejected q {tuple(q.shape)}, cache "
                         f"{tuple(kv_cache.shape)}, out {tuple(out.shape)}")  # fmt: skip
    return rc or None


def mla_paths() -> list[int]:
    """The kernel's paths that run on this CPU with this build (probed on a tiny case)."""
    kv = torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    got = []
    for path in (PATH_AMX, PATH_AVX512):
        out = torch.empty(1, 1, 32, dtype=torch.bfloat16)
        if mla_decode(q, kv, torch.zeros(1, dtype=torch.int32), 1, 1.0, out, path) == path:
            got.append(path)
    return got


__all__ = ["PATH_AMX", "PATH_AUTO", "PATH_AVX512", "PATH_NAMES", "mla_decode", "mla_paths"]
