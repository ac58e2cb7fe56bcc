"""Training forward for the demo model: several sequences packed into one flat batch.

Owns: `packed_logits(model, ids, positions, seq_ids, logit_rows)`. It runs the model's own
modules (embedding, `MLAAttention._qkv_latent`, kv_b_proj / o_proj, MLP / MoE, norms, lm_head)
outside `forward()`'s inference mode, so gradients flow.

Invariants:
- Attention is the naive MLA of `MLAAttention._naive`, per sequence (gathered into a padded
  [B, L] batch, causal, padding masked). With one sequence this equals
  `model.forward(ids, positions)` (tested).
- Logits are computed only for `logit_rows` (the positions that carry a loss).
"""

from __future__ import annotations

import torch


def _attention(attn, x, positions, gather, valid, mask) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]. gather [B, L] flat index per padded slot, valid [B, L],
    mask [B, 1, L, L] (True = may attend)."""
    q_nope, q_pe, latent, k_pe = attn._qkv_latent(x, positions)
    T, H = x.shape[0], attn.num_heads
    kv = attn.kv_b_proj(latent).view(T, H, attn.qk_nope_head_dim + attn.v_head_dim)
    k_nope, v = kv.split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, qk]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(T, H, -1)], dim=-1)  # [T, H, qk]
    qp, kp, vp = q[gather], k[gather], v[gather]  # [B, L, H, *]
    scores = torch.einsum("bihd,bjhd->bhij", qp, kp) * attn.scaling  # [B, H, L, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.einsum("bhij,bjhd->bihd", p, vp)[valid]  # [T, H, v] (row-major = flat order)
    return attn.o_proj(o.reshape(T, H * attn.v_head_dim))


def packed_logits(
    model,
    ids: torch.Tensor,  # [T] long, sequences back to back
    positions: torch.Tensor,  # [T] long, restarting at 0 for each sequence
    seq_lens: list[int],  # tokens of each sequence, in order; sum = T
    logit_rows: torch.Tensor | None = None,  # [N] long
) -> torch.Tensor:  # [N or T, vocab]
    L = max(seq_lens)
    lens = torch.tensor(seq_lens, device=ids.device)
    starts = torch.cumsum(lens, 0) - lens  # [B]
    slot = torch.arange(L, device=ids.device)
    valid = slot[None, :] < lens[:, None]  # [B, L]
    gather = torch.where(valid, starts[:, None] + slot[None, :], 0)  # [B, L]
    causal = slot[None, :] <= slot[:, None]  # [L, L]
    mask = (causal[None] & valid[:, None, :])[:, None]  # [B, 1, L, L]
    h = model.model.embed_tokens(ids)  # [T, hidden]
    for layer in model.model.layers:
        a = _attention(layer.self_attn, layer.input_layernorm(h), positions, gather, valid, mask)
        h = h + a
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.model.norm(h)
    if logit_rows is not None:
        h = h[logit_rows]
    return model.lm_head(h)
