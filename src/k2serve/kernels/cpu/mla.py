"""Absorbed MLA decode over a paged bf16 latent cache with the native CPU kernel (k2mla.h).

Owns: `mla_decode()`, one sequence's new tokens (a decode, or the few tokens of a speculative
verify step) against its cached rows, read in place through its pages; `mla_paths()`, which of
the kernel's paths this CPU and build can run.

Paths: PATH_AMX (tile unit: scores^T = cache rows x Q^T, P x V), PATH_AVX512 (vdpbf16ps), chosen
at run time (PATH_AUTO: AMX where Linux grants it, else AVX512-BF16); None back when neither
runs (no compiler, a CPU without AVX512-BF16, unsupported shapes, K2SERVE_CPU_KERNEL=torch):
then the torch paths run. K2SERVE_CPU_AMX=0 keeps it off the tiles (the vdpbf16ps path).
Scores, softmax and the split-KV merge are float32; P and the output are rounded to bf16.
"""

from __future__ import annotations

import functools
import os

import torch

import k2serve.kernels.cpu as ck
from k2serve import envs

PATH_AUTO, PATH_AMX, PATH_AVX512 = 0, 1, 2
PATH_NAMES = {PATH_AMX: "amx", PATH_AVX512: "avx512_bf16"}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] with its n * H rows at one stride (a contiguous slice, or a column slice of
    a wider tensor): as it is; else a contiguous copy."""
    n, H, _ = x.shape
    ok = x.stride(-1) == 1 and (n == 1 or x.stride(0) == H * x.stride(1))
    return x if ok else x.contiguous()


def _ok(q_latent, q_pe, kv_cache, out) -> bool:
    L, E = q_latent.shape[-1], kv_cache.shape[-1]
    return (
        q_latent.device.type == q_pe.device.type == kv_cache.device.type == "cpu"
        and out.device.type == "cpu"
        and q_latent.dtype == q_pe.dtype == kv_cache.dtype == out.dtype == torch.bfloat16
        and q_latent.dim() == q_pe.dim() == kv_cache.dim() == out.dim() == 3
        and q_latent.shape[:2] == q_pe.shape[:2] == out.shape[:2]
        and L + q_pe.shape[-1] == E
        and out.shape[-1] == L
        and E % 32 == 0
        and L % 32 == 0
        and kv_cache.is_contiguous()
        and out.is_contiguous()
        and not q_latent.requires_grad
        and not q_pe.requires_grad
        and not ck.dispatch_mode_active()
    )


def mla_decode(
    q_latent: torch.Tensor,  # [n, H, L] bf16: one sequence's n new tokens
    q_pe: torch.Tensor,  # [n, H, R] bf16 (L + R = E)
    kv_cache: torch.Tensor,  # [num_pages, page_size, E] bf16, contiguous
    pages: torch.Tensor,  # [>= ceil(seq_len / page_size)] the sequence's pages (any int dtype)
    seq_len: int,  # cached rows including the new tokens' own (ctx = seq_len - n)
    scale: float,
    out: torch.Tensor,  # [n, H, L] bf16, contiguous: written
    path: int = PATH_AUTO,
) -> int | None:
    """Causal MLA of the n new tokens (token t sees keys 0 .. seq_len - n + t) into `out`;
    the path that ran, or None when the kernel cannot run here (nothing written). No torch op
    runs on the way for contiguous inputs (an intra-op parallel op would leave torch's OpenMP
    threads spinning on the cores the kernel's pool is about to use)."""
    if not _ok(q_latent, q_pe, kv_cache, out):
        return None
    lp = ck._default_pool(os.getpid())  # (library, the kernel's shared pool) or None
    if lp is None:
        return None
    lib, pool = lp
    if not envs.cpu_amx():  # K2SERVE_CPU_AMX=0: no tiles here either
        if path == PATH_AMX:
            return None
        path = PATH_AVX512
    n, H, L = q_latent.shape
    ps, E = kv_cache.shape[1], kv_cache.shape[2]
    need = -(-seq_len // ps)
    if seq_len < n or pages.numel() < need:
        raise ValueError(f"seq_len {seq_len}: {n} new tokens, {pages.numel()} pages of {ps}")
    pg = pages  # the kernel reads its first `need` ids
    if pages.dtype != torch.int32 or pages.stride(-1) != 1 or pages.device.type != "cpu":
        pg = pages[:need].to(device="cpu", dtype=torch.int32).contiguous()
    ql, qp = _rows(q_latent), _rows(q_pe)
    num_pages = kv_cache.shape[0]
    rc = lib.k2_mla_decode(pool._ptr, ql.data_ptr(), ql.stride(1), qp.data_ptr(), qp.stride(1),
                           n, H, kv_cache.data_ptr(), num_pages, ps, E, L, pg.data_ptr(),
                           seq_len, float(scale), out.data_ptr(), path)  # fmt: skip
    if rc < 0:
        raise ValueError(f"k2_mla_decode rejected q_latent {tuple(q_latent.shape)}, cache "
                         f"{tuple(kv_cache.shape)}, out {tuple(out.shape)}, seq_len {seq_len}, "
                         f"pages {pg.tolist()[:8]} (ids must be < {num_pages})")  # fmt: skip
    return rc or None


def amx_ready() -> bool:
    """True when PATH_AUTO runs on AMX here (the kernel builds, Linux grants the tiles,
    K2SERVE_CPU_AMX is not 0); cheap after the first call."""
    return envs.cpu_amx() and _amx_granted()


@functools.cache
def _amx_granted() -> bool:
    lib = ck.load_kernel()
    return lib is not None and bool(lib.k2_amx_available())


def mla_paths() -> list[int]:
    """The kernel's paths that run on this CPU with this build (probed on a tiny case)."""
    kv = torch.zeros(1, 16, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    got = []
    for path in (PATH_AMX, PATH_AVX512):
        out = torch.empty(1, 1, 32, dtype=torch.bfloat16)
        pages = torch.zeros(1, dtype=torch.int32)
        if mla_decode(q, q, kv, pages, 1, 1.0, out, path) == path:
            got.append(path)
    return got


__all__ = [
    "amx_ready",
    "PATH_AMX",
    "PATH_AUTO",
    "PATH_AVX512",
    "PATH_NAMES",
    "mla_decode",
    "mla_paths",
]
