"""Triton MLA backend: the same interface as `TorchMLABackend` (store + absorbed forward).

Owns: `TritonMLABackend` and `mla_prefill_expanded`. With `TritonMLABackend(prefill="expand")`
(the engine's on CUDA: KernelPolicy.mla_prefill), the prompts of a step (with or without a
cached prefix; a mixed step's decodes stay absorbed, `MLAAttention._absorbed`) run the
NON-absorbed form: each sequence's latents (cached prefix + new) are expanded by kv_b_proj into
per-head K [S, H, nope + rope] and V [S, H, v], and torch's scaled_dot_product_attention (flash
path, V zero-padded to the qk width) computes the causal attention: ~3x fewer FLOPs than the
absorbed form at long prompts (8K prompt, 3 K2 layers on an H100: 16.7 ms a layer absorbed,
benchmarks/RESULTS.md). Invariants: no host synchronisation in `store` or `forward` (CUDA
graph safe when the metadata tensors are static buffers); the number of KV splits depends only
on the host-side ints in the metadata (max_query_len, max_seq_len, batch size), so a captured
graph stays valid while sequence lengths change inside it. The expanded prompt path reads the
sequences' lengths from the metadata's host copies when the engine gave them (else one device
sync; prompt steps are never captured). Its attention (KernelPolicy.mla_prefill_attn): "triton"
= one kv_b_proj over every sequence's keys and one varlen launch of kernels/mla_prefill.py
(q / k / v read in place, no padded V, the output written in place); "sdpa" = a loop over
sequences with torch's flash SDPA (the CPU's path, and the fallback).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from k2serve.attention.base import AttentionMetadata, MLABackend
from k2serve.kernels.kv_store import store_latent_kv
from k2serve.kernels.mla_attention import FP8_KV_DTYPES, mla_attention
from k2serve.kernels.sdpa import sdpa

PREFILL_ATTNS = ("sdpa", "triton")
logger = logging.getLogger(__name__)


class TritonMLABackend(MLABackend):
    """fp8 caches (float8_e4m3fn) use the torch backend's format: stored = x / kv_scale
    saturated and rounded to e4m3, read = stored * kv_scale; a cache written by either backend
    reads the same in both. Decode, prefill and a cached prefix all read fp8 in the kernel."""

    name = "triton"
    graph_safe = True

    def __init__(
        self,
        prefill: str = "absorbed",
        kv_scale: float = 1.0,
        decode_configs: Mapping[bool, Mapping] | None = None,
        prefill_attn: str = "sdpa",
        prefill_configs: tuple[Mapping, ...] = (),
    ) -> None:
        """decode_configs: {fp8 cache?: mla_attention config} for decode steps, from the
        kernel policy's tables (KernelPolicy.mla_decode_config); None = the kernel's rule.
        prefill="expand": every step with a prompt runs its prompts expanded (H100, 3 K2
        layers: as fast as absorbed at 512 tokens, 1.07-1.44x faster at 256 and 1K-8K;
        `model_speed.py --parts mlasweep`, benchmarks/RESULTS.md). prefill_attn: the expanded
        prompts' attention, "triton" (kernels/mla_prefill.py, configs from the policy table's
        `prefill_configs`) or "sdpa" (KernelPolicy.mla_prefill_attn)."""
        if prefill not in ("absorbed", "expand"):
            raise ValueError(f"TritonMLABackend prefill={prefill!r}: use 'absorbed' or 'expand'")
        if prefill_attn not in PREFILL_ATTNS:
            raise ValueError(f"prefill_attn={prefill_attn!r}: use one of {PREFILL_ATTNS}")
        if not kv_scale > 0:
            raise ValueError(f"kv_scale={kv_scale} must be positive")
        self.prefill = prefill
        self.prefill_attn = prefill_attn
        self.prefill_configs = tuple(prefill_configs)
        self.kv_scale = float(kv_scale)
        self.decode_configs = {k: dict(v) for k, v in (decode_configs or {}).items()}

    def store(
        self,
        kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
        latent: torch.Tensor,  # [T, L]
        k_pe: torch.Tensor,  # [T, R]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        store_latent_kv(kv_cache, latent, k_pe, slot_mapping, kv_scale=self.kv_scale)

    def forward(
        self,
        q_latent: torch.Tensor,  # [T, H, L]
        q_pe: torch.Tensor,  # [T, H, R]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, L]
        config = None
        if metadata.max_query_len == 1:
            config = self.decode_configs.get(kv_cache.dtype in FP8_KV_DTYPES)
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
            num_splits=metadata.num_kv_splits,
            kv_scale=self.kv_scale,
            config=config,
        )


def mla_prefill_expanded(attn, q_nope, q_pe, latent, k_pe, md: AttentionMetadata, kv_cache):
    """Non-absorbed MLA for a step's prompts (no decodes: `md.split_decodes` parts them).
    attn: the model's MLAAttention. q_nope [T, H, N], q_pe [T, H, R], latent [T, L],
    k_pe [T, R] -> [T, H, V]. The new tokens are stored in the cache first; a cached prefix is
    read back from its pages. The sequences' lengths come from md's host copies (else one
    device sync: prompt steps are not captured)."""
    H, N, V = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    L, R = attn.kv_lora_rank, attn.qk_rope_head_dim
    attn.backend.store(kv_cache, latent, k_pe, md.slot_mapping)
    qh, ch = md.query_start_loc_host, md.context_lens_host
    qsl = md.query_start_loc.tolist() if qh is None else [int(x) for x in qh]
    ctx = md.context_lens.tolist() if ch is None else [int(x) for x in ch]
    if getattr(attn.backend, "prefill_attn", "sdpa") == "triton":
        out = _expanded_triton(attn, q_nope, q_pe, latent, k_pe, md, kv_cache, qsl, ctx)
        if out is not None:
            return out
    out = torch.empty(q_nope.shape[0], H, V, dtype=q_nope.dtype, device=q_nope.device)
    for b, c in enumerate(ctx):
        t0, t1 = qsl[b], qsl[b + 1]
        if t1 == t0:
            continue
        S = c + t1 - t0
        if c == 0:
            lat, pe = latent[t0:t1], k_pe[t0:t1]
        else:
            rows = _cached_rows(attn, md, kv_cache, b, S, q_nope.dtype)  # [S, L + R]
            lat, pe = rows[:, :L], rows[:, L:]
        kv = attn.kv_b_proj(lat).view(S, H, N + V)
        k = torch.cat([kv[..., :N], pe[:, None, :].expand(S, H, R)], dim=-1)  # [S, H, N + R]
        v = F.pad(kv[..., N:], (0, N + R - V))  # [S, H, N + R], zero-padded for the flash path
        q = torch.cat([q_nope[t0:t1], q_pe[t0:t1]], dim=-1)  # [Tq, H, N + R]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, *, N + R]
        if c == 0:
            o = sdpa(q, k, v, is_causal=True, scale=attn.scaling)
        else:  # new token i sees keys <= c + i: causal aligned to the bottom right, no mask
            o = sdpa(q, k, v, attn_mask=causal_lower_right(t1 - t0, S), scale=attn.scaling)
        out[t0:t1] = o[0, :, :, :V].transpose(0, 1)
    return out


def _cached_rows(attn, md, kv_cache, b: int, S: int, dtype) -> torch.Tensor:  # [S, L + R]
    """Sequence b's first S latent rows read back from its pages (fp8: stored * kv_scale, as
    the decode kernel reads them)."""
    ps = kv_cache.shape[1]
    pages = md.block_table[b, : -(-S // ps)].long()
    rows = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:S]
    if rows.dtype == torch.float8_e4m3fn:
        rows = (rows.float() * getattr(attn.backend, "kv_scale", 1.0)).to(dtype)
    return rows


def _expanded_triton(attn, q_nope, q_pe, latent, k_pe, md, kv_cache, qsl, ctx):
    """The expanded prompts through kernels/mla_prefill.py: ONE kv_b_proj over every
    sequence's keys (a fresh prompt's new latent rows as they are; a cached prefix's rows,
    new ones included, read back from the pages as the SDPA path does), then one varlen
    launch reading q / k / v in place and writing `out`. All-fresh steps need no copy and
    no host->device transfer (the keys' offsets are the queries'). -> [T, H, V], or None
    when the policy's config cannot launch on the device (the backend then runs SDPA)."""
    from k2serve.kernels.mla_prefill import LAUNCH_ERRORS, mla_prefill_attention, pick_config

    H, N, V = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    L = attn.kv_lora_rank
    B = len(ctx)
    q_lens = [qsl[b + 1] - qsl[b] for b in range(B)]
    if all(c == 0 for c in ctx):
        lat, pe = latent[: qsl[B]], k_pe[: qsl[B]]  # [S_total, L], [S_total, R]
        cu_k = md.query_start_loc[: B + 1]
    else:
        lats, pes, cu = [], [], [0]
        for b, c in enumerate(ctx):
            t0, t1 = qsl[b], qsl[b + 1]
            if t1 > t0 and c == 0:
                lats.append(latent[t0:t1])
                pes.append(k_pe[t0:t1])
            elif t1 > t0:
                rows = _cached_rows(attn, md, kv_cache, b, c + t1 - t0, q_nope.dtype)
                lats.append(rows[:, :L])
                pes.append(rows[:, L:])
            cu.append(cu[-1] + (c + t1 - t0 if t1 > t0 else 0))
        lat, pe = torch.cat(lats), torch.cat(pes)
        cu_k = torch.tensor(cu, dtype=torch.int32).to(q_nope.device, non_blocking=True)
    S = lat.shape[0]
    out = torch.empty(q_nope.shape[0], H, V, dtype=q_nope.dtype, device=q_nope.device)
    if S == 0:
        return out
    kv = attn.kv_b_proj(lat).view(S, H, N + V)  # [S_total, H, N + V]
    max_q = max(q_lens)
    cfg = pick_config(getattr(attn.backend, "prefill_configs", ()), max_q)
    try:
        return mla_prefill_attention(
            q_nope, q_pe, kv[..., :N], pe, kv[..., N:], md.query_start_loc[: B + 1], cu_k,
            max_q, attn.scaling, out=out, config=cfg,
        )  # fmt: skip
    except LAUNCH_ERRORS as e:  # a table config this device cannot hold: SDPA from now on
        logger.warning("MLA prefill kernel config %s does not fit %s (%s); the expanded prompts "
                       "run torch's SDPA", cfg, q_nope.device, e)  # fmt: skip
        attn.backend.prefill_attn = "sdpa"
        return None
