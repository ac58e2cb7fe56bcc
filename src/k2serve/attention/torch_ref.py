"""Torch reference backend for absorbed MLA over the paged latent cache (the test oracle).

Invariants:
- Cache layout per layer: [num_pages, page_size, L + R], latent first, roped key last.
- Scores = (q_latent . latent + q_pe . k_pe) * scale, softmax in float32, output = p . latent.
- Plain loops over sequences (and over query chunks of a long prompt, so that the float32
  scores stay bounded): slow, obvious, device-agnostic.
- fp8 cache (kv_cache.dtype float8_e4m3fn): stored value = clamp(x / kv_scale, +-448) rounded
  to e4m3; read value = stored * kv_scale in float32. `kv_scale` is one per-tensor scale shared
  by every layer (1.0 default: the normed latent and the roped key are O(1)).
- bf16 queries over a bf16 cache on the CPU (a bf16 model served on the CPU) take a bf16 path
  instead (bf16 operands, float32 scores and softmax, as the GPU kernels): the float32 einsums
  here were 2% of the read bandwidth at decode. A decode or a verify step of at most
  KERNEL_MAX_TOKENS tokens runs the native kernel (kernels/cpu/mla.py: pages read in place,
  split-KV over the kernel's threads) on AMX tiles where the CPU has them; its vdpbf16ps path
  only replaces the einsums (a short decode on scattered pages: faster than them, slower than
  the flash kernel); prompts take torch's CPU flash kernel (`cpu_flash.py`). `cpu_kernel=False`
  skips the native kernel; `cpu_flash=False` keeps the einsums (the oracle); float32, fp8 and
  GPU tensors always run them, bit for bit as before.
"""

from __future__ import annotations

import torch

from k2serve.attention import cpu_flash
from k2serve.attention.base import AttentionMetadata, MLABackend
from k2serve.kernels.cpu import mla as cpu_mla

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCORES_MAX_ELEMS = 1 << 26  # float32 scores per query chunk (256 MB)
# new tokens per sequence up to which the native kernel runs (decodes, speculative verify
# steps); prompts take the flash path (benchmarks/cpu_attn.py, RESULTS.md)
KERNEL_MAX_TOKENS = 8


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _flash_seq(flash: bool, n_new: int, seq_len: int, pages: torch.Tensor) -> bool:
    """A bf16 sequence's torch path: the flash kernel (prompts, long contexts, pages in one
    run: read in place), else the einsums."""
    return flash and (
        n_new > 1 or seq_len >= cpu_flash.DECODE_MIN_KEYS or bool((pages.diff() == 1).all())
    )


class TorchMLABackend(MLABackend):
    name = "torch"
    graph_safe = False  # per-sequence loops over host copies of the lengths

    def __init__(
        self, kv_scale: float = 1.0, cpu_flash: bool = True, cpu_kernel: bool = True
    ) -> None:
        if not kv_scale > 0:
            raise ValueError(f"kv_scale={kv_scale} must be positive")
        self.kv_scale = float(kv_scale)
        self.cpu_flash = cpu_flash
        self.cpu_kernel = cpu_kernel

    def _bf16_path(self, q_latent, q_pe, kv_cache) -> bool:
        """bf16 queries and cache on the CPU (the native kernel or the flash path)."""
        return (
            self.cpu_flash
            and q_latent.device.type == "cpu"
            and q_latent.dtype == q_pe.dtype == kv_cache.dtype == torch.bfloat16
            and kv_cache.is_contiguous()
        )

    def _flash_path(self, q_latent, q_pe, kv_cache) -> bool:
        """The bf16 path, and torch has the CPU flash kernel."""
        return self._bf16_path(q_latent, q_pe, kv_cache) and cpu_flash.available()

    def _to_cache(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if is_fp8(dtype):
            x = (x.to(torch.float32) / self.kv_scale).clamp_(-FP8_MAX, FP8_MAX)
        return x.to(dtype)

    def _from_cache(self, kv: torch.Tensor) -> torch.Tensor:  # -> float32, same shape
        out = kv.to(torch.float32)
        return out * self.kv_scale if is_fp8(kv.dtype) and self.kv_scale != 1.0 else out

    def store(
        self,
        kv_cache: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_pages, page_size, dim = kv_cache.shape
        L = latent.shape[-1]
        if L + k_pe.shape[-1] != dim:
            raise ValueError(f"kv_cache last dim {dim} != latent {L} + k_pe {k_pe.shape[-1]}")
        flat = kv_cache.view(num_pages * page_size, dim)
        slots = slot_mapping.to(torch.long)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, latent, k_pe = slots[keep], latent[keep], k_pe[keep]
        flat[slots, :L] = self._to_cache(latent, kv_cache.dtype)
        flat[slots, L:] = self._to_cache(k_pe, kv_cache.dtype)

    def forward(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        T, H, L = q_latent.shape
        page_size = kv_cache.shape[1]
        qsl = metadata.query_start_loc.tolist()
        # every row of a sequence is written below; rows past the last sequence (padding) are 0
        out = torch.empty(T, H, L, dtype=q_latent.dtype, device=q_latent.device)
        if qsl[-1] < T:
            out[qsl[-1] :].zero_()
        seq_lens = metadata.seq_lens.tolist()
        ctx_lens = metadata.context_lens.tolist()
        bf16 = self._bf16_path(q_latent, q_pe, kv_cache)
        flash = bf16 and cpu_flash.available()
        kernel = bf16 and self.cpu_kernel
        q = None  # [T, H, L + R] for the flash path, made when first needed
        for b, (seq_len, ctx) in enumerate(zip(seq_lens, ctx_lens, strict=True)):
            start, end = qsl[b], qsl[b + 1]
            n_new = end - start
            if n_new == 0:
                continue
            n_pages = -(-seq_len // page_size)
            blk = metadata.block_table[b, :n_pages]  # [n_pages] int32, as the kernel takes it
            if kernel and n_new <= KERNEL_MAX_TOKENS:
                # the kernel on AMX beats both torch paths; on vdpbf16ps only the einsums
                path = cpu_mla.PATH_AMX  # the flash test (3 torch ops) only without AMX
                if not cpu_mla.amx_ready() and not _flash_seq(flash, n_new, seq_len, blk):
                    path = cpu_mla.PATH_AUTO
                ql, qp, o = q_latent, q_pe, out  # one sequence, every row: no slicing ops
                if n_new != T:
                    ql, qp, o = q_latent[start:end], q_pe[start:end], out[start:end]
                if cpu_mla.mla_decode(ql, qp, kv_cache, blk, seq_len, scale, o, path):
                    continue
            use_flash = _flash_seq(flash, n_new, seq_len, blk)
            pages = blk.to(torch.long)
            if use_flash:
                if q is None:
                    q = torch.cat([q_latent, q_pe], dim=-1)
                cpu_flash.mla_sequence(q[start:end], kv_cache, pages, ctx, scale, out[start:end])
                continue
            kv = kv_cache[pages].reshape(n_pages * page_size, -1)[:seq_len]  # [S, L + R]
            kv = self._from_cache(kv)  # float32
            latent, k_pe = kv[:, :L], kv[:, L:]  # [S, L], [S, R]
            # queries in chunks so that a chunk's scores stay under SCORES_MAX_ELEMS (a long
            # prompt's [n, H, S] float32 scores would be tens of GB); rows are independent
            step = max(1, SCORES_MAX_ELEMS // (H * seq_len))
            k_pos = torch.arange(seq_len, device=kv.device)  # [S]
            for c0 in range(0, n_new, step):
                c1 = min(n_new, c0 + step)
                ql = q_latent[start + c0 : start + c1].to(torch.float32)  # [n, H, L]
                qp = q_pe[start + c0 : start + c1].to(torch.float32)  # [n, H, R]
                scores = (
                    torch.einsum("nhl,sl->nhs", ql, latent) + torch.einsum("nhr,sr->nhs", qp, k_pe)
                ) * scale  # [n, H, S]
                q_pos = ctx + torch.arange(c0, c1, device=scores.device)  # [n]
                mask = k_pos[None, :] > q_pos[:, None]  # [n, S]
                scores.masked_fill_(mask[:, None, :], float("-inf"))
                p = torch.softmax(scores, dim=-1)
                out[start + c0 : start + c1] = torch.einsum("nhs,sl->nhl", p, latent).to(out.dtype)
        return out
