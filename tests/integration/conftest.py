"""Tiny models for the integration tests (backend choice, CUDA graphs, hybrid experts, fp8 KV).

CPU by default; tests that need CUDA carry the `gpu` marker and `needs_cuda` (skipped without a
GPU). One intra-op thread: the tensors are tiny and CI has 2 busy cores.
"""

from __future__ import annotations

import torch
from tests.conftest import SMALL_VOCAB, needs_cuda, tiny_hf_config

from k2serve.config import ModelConfig

__all__ = ["load_tiny", "needs_cuda", "paged_logits", "tiny_config"]


def tiny_config(fmt: str = "bf16", **changes) -> ModelConfig:
    """The tiny model (3 layers: 1 dense + 2 MoE, 8 experts top-2) with 2 expert groups."""
    return ModelConfig.from_hf(
        tiny_hf_config(fmt, n_group=2, topk_group=2, **{**SMALL_VOCAB, **changes})
    )


def load_tiny(fmt="bf16", dtype=torch.float32, device="cpu", seed=5, **kw):
    from k2serve.weights.loader import load_model

    return load_model(None, dtype=dtype, device=device, load_format="dummy",
                      config=tiny_config(fmt), seed=seed, progress=False, **kw)  # fmt: skip


def paged_logits(model, kv_caches, ids: list[int], page_size: int, n_prefill: int):
    """Prefill ids[:n_prefill] in one step, then decode the rest one token per step, all on one
    sequence on pages 0.. of the caches. -> logits [len(ids) - n_prefill + 1, vocab] float32:
    the prefill's last row, then one row per decode step."""
    from k2serve.attention import AttentionMetadata

    dev = kv_caches[0].device
    pages = list(range(-(-len(ids) // page_size)))
    table = torch.tensor([pages], dtype=torch.int32, device=dev)
    out, start = [], 0
    for end in [n_prefill, *range(n_prefill + 1, len(ids) + 1)]:
        pos = torch.arange(start, end, device=dev)
        md = AttentionMetadata(
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([start], dtype=torch.int32, device=dev),
            block_table=table,
            slot_mapping=pos.to(torch.int64),  # pages 0.. in order: slot = position
            max_query_len=end - start,
            max_seq_len=end,
            page_size=page_size,
            num_decodes=1 if end - start == 1 else 0,
        )
        h = model(torch.tensor(ids[start:end], device=dev), pos, md, kv_caches)
        out.append(model.compute_logits(h[-1:]))
        start = end
    return torch.cat(out)
