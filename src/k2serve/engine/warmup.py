"""Start-up warm-up: every kernel configuration a step can pick is compiled (or loaded from
Triton's cache) before the first request, not during it.

Why: Triton compiles a kernel the first time it meets a new set of constexprs, a new launch
config or a new specialization of an integer argument (divisibility by 16, == 1). The
profiling pass runs only the largest prefill and decode steps and the decode CUDA graphs only
the decode buckets, so the first prompts of other lengths compiled the MoE GEMM configs of
their pair counts and the attention prefill paths in the request (served C=16 TTFT p50 3.8 s
on the first requests, 0.46 s after).

Owns: `step_inputs` (a step's flat batch), `warmup_token_counts` (the smallest token count
of each distinct kernel configuration key over 1..max_tokens, from the MoE backends'
`config_key`: path(s), table entry, the divisibility classes), `attention_token_counts` (a
prompt past each length band of the MLA prompt kernel's configs), `warmup_steps` (those counts
as prefill steps, plus one with a cached prefix and one mixed decode + prefill step) and
`run_warmup` (runs them eagerly on the model, writing into the KV cache's first pages before
any request holds one, and logs the time).
Invariant: the decode graphs are captured separately (DecodeGraphRunner); the sampler is torch
ops (nothing to compile).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from k2serve.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)


def moe_backends(model) -> list:
    """One routed-expert backend per distinct setting among `model`'s MoE layers that name
    their configs (`config_key`); layers with the same experts' shapes and the same policy
    pick the same configs."""
    seen, out = set(), []
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        be = getattr(getattr(layer, "mlp", None), "expert_backend", None)
        if be is None or not hasattr(be, "config_key"):
            continue
        w = getattr(be, "weights", None)
        shape = None if w is None else (w.quant, tuple(w.w13.shape), tuple(w.w2.shape))
        sig = (type(be).__name__, shape, repr(sorted((k, repr(v)) for k, v in vars(be).items()
                                                     if k != "weights")))  # fmt: skip
        if sig not in seen:
            seen.add(sig)
            out.append(be)
    return out


def config_key(backends, num_tokens: int, top_k: int) -> tuple:
    """The kernel configuration key of a step of `num_tokens` tokens (all MoE layers'); layers
    with equal settings give one entry."""
    return tuple(sorted({be.config_key(num_tokens, top_k) for be in backends}, key=repr))


def warmup_token_counts(backends, top_k: int, max_tokens: int) -> list[int]:
    """The smallest token count of each distinct configuration key in 1..max_tokens."""
    first: dict[tuple, int] = {}
    for t in range(1, max_tokens + 1):
        first.setdefault(config_key(backends, t, top_k), t)
    return sorted(first.values())


def attention_token_counts(model, max_tokens: int, max_len: int | None = None) -> list[int]:
    """One prompt just past each length band of the MLA prompt kernel's configs
    (TritonMLABackend.prefill_configs, picked by the step's longest prompt), where a prompt of
    that length fits the budget and max_len: the MoE counts alone may never reach a band."""
    layers = getattr(getattr(model, "model", None), "layers", ())
    be = getattr(getattr(layers[0], "self_attn", None), "backend", None) if layers else None
    if getattr(be, "prefill_attn", None) != "triton":
        return []
    cap = min(max_tokens, max_len or max_tokens)
    edges = [c.get("max_len") for c in getattr(be, "prefill_configs", ())]
    return [e + 1 for e in edges if e is not None and e + 1 <= cap]


@dataclass(frozen=True)
class WarmupStep:
    new_tokens: tuple[int, ...]  # new tokens per sequence (1 = a decode)
    context: tuple[int, ...]  # cached tokens before them per sequence


def warmup_steps(
    token_counts: list[int], page_size: int, max_tokens: int, max_len: int | None = None
) -> list[WarmupStep]:
    """One prefill of each count (in sequences of at most `max_len` tokens, as the profiling
    pass); one prefill after a cached prefix (the attention's prefix path); one mixed step (a
    decode + a prefill, the chunked-prefill batches)."""
    cap = max_len or max_tokens
    steps = []
    for t in token_counts:
        lens = (cap,) * (t // cap) + ((t % cap,) if t % cap else ())
        steps.append(WarmupStep(lens, (0,) * len(lens)))
    n = min(2 * page_size, max_tokens)
    if n > page_size:
        steps.append(WarmupStep((n - page_size,), (page_size,)))
    if max_tokens >= 3:
        steps.append(WarmupStep((1, min(page_size, max_tokens - 1)), (page_size, 0)))
    return steps


def step_inputs(step: WarmupStep, page_size: int, device) -> tuple:
    """(input_ids [T], positions [T], AttentionMetadata, pages used) for `step`, pages laid out
    from page 0 in order, decodes first."""
    seqs = sorted(zip(step.new_tokens, step.context, strict=True), key=lambda s: s[0] != 1)
    pages = [-(-(q + c) // page_size) for q, c in seqs]
    table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    slots, pos, first = [], [], 0
    for b, ((q, c), p) in enumerate(zip(seqs, pages, strict=True)):
        table[b, :p] = torch.arange(first, first + p, dtype=torch.int32)
        at = torch.arange(c, c + q)
        pos.append(at)
        slots.append(table[b, at // page_size].long() * page_size + at % page_size)
        first += p
    q_lens = torch.tensor([q for q, _ in seqs], dtype=torch.int32)
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    md = AttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=(q_lens + ctx).to(device),
        context_lens=ctx.to(device),
        block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=int(q_lens.max()),
        max_seq_len=int((q_lens + ctx).max()),
        page_size=page_size,
        num_decodes=sum(1 for q, _ in seqs if q == 1),
    )
    T = int(qsl[-1])
    return torch.zeros(T, dtype=torch.long, device=device), torch.cat(pos).to(device), md, first


@torch.inference_mode()
def run_warmup(
    model,
    kv_caches,
    *,
    page_size: int,
    max_num_batched_tokens: int,
    max_model_len: int | None = None,
) -> float:
    """Run the warm-up steps on `model` (before any request: the cache's first pages are
    scratch); returns the seconds it took (also logged)."""
    t0 = time.monotonic()
    backends = moe_backends(model)
    top_k = int(getattr(model.config, "num_experts_per_tok", 1) or 1)
    num_pages = kv_caches[0].shape[0] if kv_caches else 0
    max_tokens = min(max_num_batched_tokens, num_pages * page_size)
    counts = warmup_token_counts(backends, top_k, max_tokens) if backends else [1, max_tokens]
    counts = sorted({*counts, *attention_token_counts(model, max_tokens, max_model_len)})
    steps = warmup_steps(counts, page_size, max_tokens, max_model_len)
    device = kv_caches[0].device
    done = 0
    for step in steps:
        ids, pos, md, used = step_inputs(step, page_size, device)
        if used > num_pages:
            continue
        hidden = model(ids, pos, attn_metadata=md, kv_caches=kv_caches)  # [T, hidden]
        rows = (md.query_start_loc[1:] - 1).long()  # the sampled rows
        model.compute_logits(hidden[rows])
        done += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.monotonic() - t0
    logger.info("warm-up: %d steps (prefill token counts %s) compiled or loaded every kernel "
                "configuration in %.1fs", done, counts, dt)  # fmt: skip
    return dt
