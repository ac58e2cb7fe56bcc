"""Sampling on the device with no host synchronisation per step.

Owns: `sample(logits, temperature, top_k, top_p, noise=None)` and `sample_ref`.
Per-row parameters are tensors, so one call (and one CUDA graph) serves a mixed batch:
temperature <= 0 means greedy; top_k <= 0 or >= V means no top-k; top_p >= 1 means no top-p.
Sampling uses the exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) draws index i with
probability p_i (no cumulative sum, no multinomial, no `.item()`). `noise` [B, V] may be passed
for reproducible tests; otherwise it is drawn from torch's generator on the device.
"""

from __future__ import annotations

import torch


def _filtered_probs(logits, temperature, top_k, top_p):
    B, V = logits.shape
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    sp, si = probs.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V))
    drop = rank >= k[:, None]
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays)
    before = sp.cumsum(-1) - sp
    drop |= before >= top_p.float()[:, None]
    sp = sp.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, si, sp)


def sample(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] float
    top_k: torch.Tensor,  # [B] int
    top_p: torch.Tensor,  # [B] float
    noise: torch.Tensor | None = None,  # [B, V] Exp(1) draws
) -> torch.Tensor:  # [B] int64
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [B, V], got {tuple(logits.shape)}")
    greedy = logits.argmax(-1)
    probs = _filtered_probs(logits, temperature, top_k, top_p)
    if noise is None:
        noise = torch.empty_like(probs).exponential_()
    drawn = (probs / noise.clamp_min(1e-20)).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)


def sample_ref(logits, temperature, top_k, top_p, noise):
    """Row by row in float64 with explicit sorting; same noise gives the same draw."""
    out = []
    for b in range(logits.shape[0]):
        lg = logits[b].double()
        if temperature[b] <= 0:
            out.append(int(lg.argmax()))
            continue
        p = torch.softmax(lg / float(temperature[b]), -1)
        order = sorted(range(p.numel()), key=lambda i: -p[i].item())
        k = int(top_k[b]) if 0 < int(top_k[b]) < p.numel() else p.numel()
        keep, mass = [], 0.0
        for i in order[:k]:
            if keep and mass >= float(top_p[b]):
                break
            keep.append(i)
            mass += p[i].item()
        best = max(keep, key=lambda i: p[i].item() / max(noise[b, i].item(), 1e-20))
        out.append(best)
    return torch.tensor(out)
