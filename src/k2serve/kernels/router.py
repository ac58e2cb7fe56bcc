"""Router top-k for DeepSeek-V3 / Kimi (noaux_tc, sigmoid): grouped, biased selection.

Owns: `grouped_topk(...)` - on CUDA (or under the interpreter) one Triton program per token
(`fused_grouped_topk`: sigmoid, bias, group ranking, top-k, renormalise and scale in one launch;
the torch version costs ~10 kernels and a sort per layer, ~0.1 ms of a batch-1 decode step),
elsewhere torch ops (`router_torch.grouped_topk_torch`, also the model's router off CUDA); no
host sync either way (CUDA-graph safe) - and
`grouped_topk_ref`, a per-token loop written straight from the spec (shared/spec/kimi_format.md
section 3.5) that the tests use as the oracle.

Robustness: ids are always in [0, E) and distinct per token, whatever the input. A NaN
selection score (NaN logit or bias) ranks below every finite one (as the finite floor
`NAN_SCORE`) and its weight is 0; +-inf logits are ordinary (sigmoid 1 / 0).

Rules: scores = sigmoid(logits) in float32; the bias (e_score_correction_bias) is added only
for selection; groups: keep the `topk_group` groups with the largest sum of their top-2 biased
scores; weights are the unbiased scores of the chosen experts, renormalised when
`renormalize`, then times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, tl, triton
from .router_torch import grouped_topk_torch


def grouped_topk(
    router_logits: torch.Tensor,  # [T, E]
    bias: torch.Tensor | None,  # [E] float32
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    ids_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32, [T, k] ids_dtype)
    """Fused Triton kernel on CUDA (and under TRITON_INTERPRET=1), torch ops elsewhere."""
    if HAS_TRITON and (router_logits.is_cuda or INTERPRET):
        return fused_grouped_topk(router_logits, bias, top_k, n_group, topk_group, renormalize,
                                  routed_scaling_factor, ids_dtype)  # fmt: skip
    w, ids = grouped_topk_torch(router_logits, bias, top_k, n_group, topk_group, renormalize,
                                routed_scaling_factor)  # fmt: skip
    return w, ids.to(ids_dtype)


if HAS_TRITON:

    @triton.jit
    def _topk_kernel(
        lg_ptr, bias_ptr, w_ptr, id_ptr, lg_stride, scale,
        E: tl.constexpr, G: tl.constexpr, EG: tl.constexpr, EGP: tl.constexpr,
        TOPK_G: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
        RENORM: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, G)[:, None]
        i = tl.arange(0, EGP)[None, :]
        flat = g * EG + i  # [G, EGP] expert ids
        ok = i < EG
        x = tl.load(lg_ptr + t * lg_stride + flat, mask=ok, other=0.0).to(tl.float32)
        c = tl.sigmoid(x)
        s = tl.where(c == c, c, 0.0)  # NaN logit: weight 0
        if HAS_BIAS:
            c = c + tl.load(bias_ptr + flat, mask=ok, other=0.0).to(tl.float32)
        NEG: tl.constexpr = float("-inf")
        # NaN (and -inf) choices rank at the finite floor, so that every real expert stays
        # above the excluded ones (-inf) and each pick below is a distinct id in [0, E)
        c = tl.where(c > -1.0e30, c, -1.0e30)
        c = tl.where(ok, c, NEG)
        big = E + EGP * G
        if G > 1:  # keep the TOPK_G groups with the largest sum of their top-2 choice scores
            m1 = tl.max(c, 1)  # [G]
            a1 = tl.min(tl.where(c == m1[:, None], i, big), 1)
            m2 = tl.max(tl.where(i == a1[:, None], NEG, c), 1)
            gs = m1 + m2
            gi = tl.arange(0, G)
            keep = gi < 0
            for _ in tl.static_range(TOPK_G):
                mg = tl.max(gs, 0)
                sel = tl.min(tl.where(gs == mg, gi, G), 0)
                keep = keep | (gi == sel)
                gs = tl.where(gi == sel, NEG, gs)
            c = tl.where(keep[:, None], c, NEG)
        ko = tl.arange(0, KP)
        ids = tl.zeros([KP], tl.int32)
        ws = tl.zeros([KP], tl.float32)
        for j in tl.static_range(K):
            m = tl.max(tl.max(c, 1), 0)
            e = tl.min(tl.min(tl.where((c == m) & ok, flat, big), 1), 0)
            e = tl.minimum(e, E - 1)  # never out of range, even for an impossible input
            hit = (flat == e) & ok  # padded columns alias the next group's ids
            w = tl.sum(tl.sum(tl.where(hit, s, 0.0), 1), 0)
            ids = tl.where(ko == j, e, ids)
            ws = tl.where(ko == j, w, ws)
            c = tl.where(hit, NEG, c)
        if RENORM:
            ws = ws / (tl.sum(ws, 0) + 1e-20)
        kok = ko < K
        tl.store(w_ptr + t * K + ko, ws * scale, mask=kok)
        tl.store(id_ptr + t * K + ko, ids.to(id_ptr.dtype.element_ty), mask=kok)


def fused_grouped_topk(router_logits, bias, top_k, n_group=1, topk_group=1, renormalize=True,
                       routed_scaling_factor=1.0, ids_dtype=torch.int32):  # fmt: skip
    """One Triton program per token (see the module docstring). Ties pick the lowest id."""
    T, E = router_logits.shape
    if E % n_group:
        raise ValueError(f"n_group={n_group} does not divide num_experts={E}")
    if n_group & (n_group - 1):  # the kernel's group axis is a power-of-two block
        w, ids = grouped_topk_torch(router_logits, bias, top_k, n_group, topk_group,
                                    renormalize, routed_scaling_factor)  # fmt: skip
        return w, ids.to(ids_dtype)
    lg = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    dev = lg.device
    w = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=ids_dtype, device=dev)
    if T == 0:
        return w, ids
    eg = E // n_group
    b = bias.float().contiguous() if bias is not None else lg
    _topk_kernel[(T,)](
        lg, b, w, ids, lg.stride(0), float(routed_scaling_factor),
        E=E, G=n_group, EG=eg, EGP=triton.next_power_of_2(eg), TOPK_G=topk_group, K=top_k,
        KP=triton.next_power_of_2(top_k), HAS_BIAS=bias is not None, RENORM=bool(renormalize),
        num_warps=4,
    )  # fmt: skip
    return w, ids


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
