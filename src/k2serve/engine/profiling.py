"""The device budget of the KV cache: measured by a profiling pass on a GPU, simulated on a CPU.

Owns: `device_budget` (a `memory.DeviceBudget`: capacity = total x --gpu-memory-utilization,
minus the weights and buffers already allocated, the peak activations of the largest steps,
the decode graphs' pool and what lives outside the tensor allocator) and `profile_run` (the
profiling pass: the largest prefill step, `max_num_batched_tokens` tokens in sequences of at
most `max_model_len`, and the largest decode step, `max_num_seqs` sequences, each run once
over a scratch cache, with the sampler's logits for `max_num_seqs` rows, as vLLM and
nano-vllm size their caches).

Where nothing can be measured, the terms come from `k2serve.memory`'s formulas, the
planner's: the decode graphs' pool always (graphs bake the cache's addresses, so they are
captured after it), activations on tensor-parallel ranks (one rank cannot run a step alone),
and everything but the weights on a CPU that simulates a GPU (K2SERVE_SIMULATED_DEVICE_MEMORY),
which is how `plan` and `serve` are checked to agree without a GPU.
"""

from __future__ import annotations

import logging

import torch

from k2serve import memory
from k2serve.attention import allocate_kv_caches
from k2serve.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prefill_lens(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The largest prefill step: `num_tokens` tokens in sequences of at most `max_model_len`."""
    lens: list[int] = []
    left = num_tokens
    while left > 0 and len(lens) < max_num_seqs:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    return lens


def _metadata(lens: list[int], page_size: int, device: torch.device):
    """Flat batch of sequences of `lens` new tokens each, no context, pages laid out in order:
    -> (input_ids [T], positions [T], AttentionMetadata, number of pages)."""
    pages = [_cdiv(n, page_size) for n in lens]
    width = max(pages)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    slots, positions, first = [], [], 0
    for b, (n, p) in enumerate(zip(lens, pages, strict=True)):
        table[b, :p] = torch.arange(first, first + p, dtype=torch.int32)
        slots.append(torch.arange(n) + first * page_size)
        positions.append(torch.arange(n))
        first += p
    lens_t = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = lens_t.cumsum(0)
    T = int(qsl[-1])
    md = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=lens_t.to(device),
        context_lens=torch.zeros_like(lens_t).to(device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        page_size=page_size,
        num_decodes=len(lens) if max(lens) == 1 else 0,
    )
    ids = torch.zeros(T, dtype=torch.long, device=device)
    return ids, torch.cat(positions).to(device), md, first


@torch.inference_mode()
def profile_run(
    model,
    kv_dtype: torch.dtype,
    device: torch.device,
    *,
    page_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """Peak bytes the largest prefill and decode steps allocate above what is allocated now
    (the scratch cache they write into not counted)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    peak = 0
    steps = (
        _prefill_lens(max_num_batched_tokens, max_model_len, max_num_seqs),
        [1] * min(max_num_seqs, max_num_batched_tokens),
    )
    for lens in steps:
        ids, pos, md, num_pages = _metadata(lens, page_size, device)
        caches = allocate_kv_caches(model.config, num_pages, page_size, kv_dtype, device)
        scratch = sum(c.numel() * c.element_size() for c in caches)
        hidden = model(ids, pos, attn_metadata=md, kv_caches=caches)  # [T, hidden]
        rows = (md.query_start_loc[1:] - 1).long()  # the last token of each sequence
        rows = rows.repeat(_cdiv(max_num_seqs, rows.numel()))[:max_num_seqs]  # sampled rows
        torch.softmax(model.compute_logits(hidden[rows]), dim=-1)  # [S, vocab] float32
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - base - scratch)
        del hidden, caches
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return max(0, peak)


def device_budget(
    model,
    model_config,
    kv_dtype: torch.dtype,
    device: torch.device,
    *,
    gpu_memory_utilization: float,
    page_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    cuda_graphs: bool,
    tp_size: int = 1,
    simulated_memory: int | None = None,
) -> memory.DeviceBudget | None:
    """The KV cache's budget on `device` (see the module docstring); None on a CPU that
    simulates no GPU (the CPU rules of `engine.setup.num_kv_pages` apply)."""
    graphs = memory.graph_pool_bytes(model_config, max_num_seqs, tp_size) if cuda_graphs else 0
    if device.type != "cuda":
        if simulated_memory is None:
            return None
        weights = sum(t.numel() * t.element_size() for t in _tensors(model) if t.device == device)
        return memory.DeviceBudget(
            capacity=int(simulated_memory * gpu_memory_utilization),
            weights=weights,
            activations=memory.activation_bytes(
                model_config, max_num_batched_tokens, max_num_seqs, tp_size
            ),
            cuda_graphs=graphs,
            runtime=memory.RUNTIME_RESERVE_BYTES,
        )
    if tp_size > 1:  # NOTE: a rank cannot run a step alone (the layers all-reduce)
        activations = memory.activation_bytes(
            model_config, max_num_batched_tokens, max_num_seqs, tp_size
        )
    else:
        activations = profile_run(
            model, kv_dtype, device, page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )  # fmt: skip
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return memory.DeviceBudget(
        capacity=int(total * gpu_memory_utilization),
        weights=reserved,  # the allocator's pool now: weights, buffers, its rounding
        activations=activations,
        cuda_graphs=graphs,
        runtime=max(0, total - free - reserved),  # CUDA context, workspaces, NCCL
    )


def _tensors(model):
    yield from model.parameters()
    yield from model.buffers()
