"""Router top-k for DeepSeek-V3 / Kimi (noaux_tc, sigmoid): grouped, biased selection.

Owns: `grouped_topk(...)` - torch ops only (a [T, 384] problem is launch-bound, not worth a
kernel; every op is device-side, so it is CUDA-graph safe with no host sync) - and
`grouped_topk_ref`, a per-token loop written straight from the spec (shared/spec/kimi_format.md
section 3.5) that the tests use as the oracle.

Rules: scores = sigmoid(logits) in float32; the bias (e_score_correction_bias) is added only
for selection; groups: keep the `topk_group` groups with the largest sum of their top-2 biased
scores; weights are the unbiased scores of the chosen experts, renormalised when
`renormalize`, then times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch


def grouped_topk(
    router_logits: torch.Tensor,  # [T, E]
    bias: torch.Tensor | None,  # [E] float32
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32, [T, k] int32)
    T, E = router_logits.shape
    if E % n_group:
        raise ValueError(f"n_group={n_group} does not divide num_experts={E}")
    scores = torch.sigmoid(router_logits.float())
    choice = scores + bias.float() if bias is not None else scores
    if n_group > 1:
        g = choice.view(T, n_group, E // n_group)
        gscore = g.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(gscore, dtype=torch.bool)
        keep.scatter_(1, gscore.topk(topk_group, dim=-1).indices, True)
        choice = g.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, ids.to(torch.int32)


def grouped_topk_ref(router_logits, bias, top_k, n_group=1, topk_group=1, renormalize=True,
                     routed_scaling_factor=1.0):  # fmt: skip
    """Token-by-token, in float64, as the spec reads."""
    T, E = router_logits.shape
    gsz = E // n_group
    ws, idss = [], []
    for t in range(T):
        s = torch.sigmoid(router_logits[t].double())
        c = s + (bias.double() if bias is not None else 0.0)
        gs = [sorted(c[i * gsz : (i + 1) * gsz].tolist(), reverse=True)[:2] for i in range(n_group)]
        gsum = torch.tensor([sum(x) for x in gs], dtype=torch.float64)
        groups = gsum.topk(topk_group).indices.tolist()
        allowed = [e for g in groups for e in range(g * gsz, (g + 1) * gsz)]
        cand = sorted(allowed, key=lambda e: -c[e].item())[:top_k]
        w = s[cand]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        ws.append(w * routed_scaling_factor)
        idss.append(torch.tensor(cand))
    return torch.stack(ws), torch.stack(idss)
