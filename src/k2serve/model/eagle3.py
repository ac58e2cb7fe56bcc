"""EAGLE-3 draft heads for the K2 family, in the two published layouts.

- Llama-layer head (`LlamaForCausalLMEagle3`, e.g. lightseekorg/kimi-k2.5-eagle3): one decoder
  layer whose attention is Llama's (q/k/v/o, grouped KV heads, neox-style rope); its KV lives in
  its own small paged cache `[num_pages, page_size, 2, num_kv_heads, head_dim]`.
- MLA head (`Eagle3DeepseekV2ForCausalLM`, e.g. lightseekorg/kimi-k2.5-eagle3-mla, SGLang's
  `kimi_k25_eagle3.py`, vLLM's `deepseek_eagle3.py`): the decoder layer's attention is
  DeepSeek-V2 MLA (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj), absorbed over a paged latent cache
  `[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]` read and written by the target's
  own MLA backend (`attention.MLABackend`: Triton on CUDA, the torch reference on CPU).
  Both caches are indexed by the TARGET's pages, block tables and slots: the draft's KV of a
  token sits in the same page slot as the target's, so prefix-cache hits, preemption and page
  freeing need nothing extra.

Both heads (vLLM's llama_eagle3.py / deepseek_eagle3.py):
    h = fc(aux)                           aux = concat of 3 target hidden states [T, 3 * H_t]
                                          (EAGLE3.1: fc_norm, an RMSNorm per auxiliary state,
                                          applied first)
    x = concat(input_layernorm(embed(tok)), hidden_norm(h))        [T, 2H]
    a = attention(x);  x, r = post_attention_layernorm(a + h);  x = mlp(x)
    out, prenorm = norm(x + r)            logits = lm_head(out) over the draft vocabulary
    next h = prenorm (EAGLE3.1: norm_output(prenorm))
The draft vocabulary maps to the target's by `d2t` (target id = draft id + d2t[draft id]).
Parameter names follow the checkpoints (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`);
`weights.eagle3` maps the other spellings (`model.` prefix, `layers.0.`, fused qkv_a).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k2serve.kernels.sdpa import sdpa
from k2serve.model.layers import RMSNorm, YarnRotaryEmbedding

LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    kind: str  # "llama" | "mla"
    hidden_size: int
    target_hidden_size: int
    vocab_size: int  # target vocabulary (embedding rows)
    draft_vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    aux_layer_ids: tuple[int, ...] | None  # None: the target's default (2, N // 2, N - 3)
    eagle31: bool  # fc_norm / norm_output present
    norm_before_residual: bool
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    # llama attention
    num_key_value_heads: int = 0
    head_dim: int = 0
    # MLA attention
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @staticmethod
    def from_hf(d: dict) -> Eagle3Config:
        archs = d.get("architectures") or []
        if any(a in MLA_ARCHS for a in archs):
            kind = "mla"
        elif any(a in LLAMA_ARCHS for a in archs):
            kind = "llama"
        else:
            raise ValueError(
                f"draft architectures {archs} are not an EAGLE-3 head "
                f"({', '.join(LLAMA_ARCHS + MLA_ARCHS)})"
            )
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or d.get("aux_hidden_state_layer_ids")
        H = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        common: dict[str, Any] = dict(
            kind=kind,
            hidden_size=H,
            target_hidden_size=int(d.get("target_hidden_size") or H),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            eagle31=bool(d.get("eagle31") or eagle.get("use_fc_norm")),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        )
        if kind == "llama":
            return Eagle3Config(
                **common,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or H // heads),
            )
        q_lora = d.get("q_lora_rank")
        return Eagle3Config(
            **common,
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
        )


def _linear(n_in: int, n_out: int, dtype) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False, dtype=dtype).requires_grad_(False)


def _llama_inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim / 2]
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise ValueError(f"draft rope_scaling type {kind!r} is not supported (default, llama3)")
    s = scaling or {}
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = ((old / wavelen) - lo) / (hi - lo)
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return torch.where((wavelen <= old / lo) & (wavelen >= old / hi), mid, scaled)


class LlamaDraftAttention(nn.Module):
    """Llama attention over the draft's own paged KV cache [pages, page_size, 2, KVH, D]."""

    inv_freq: torch.Tensor  # [D / 2] buffer

    def __init__(self, c: Eagle3Config, dtype) -> None:
        super().__init__()
        H, D, KV = c.num_attention_heads, c.head_dim, c.num_key_value_heads
        self.num_heads, self.head_dim, self.num_kv_heads = H, D, KV
        self.q_proj = _linear(2 * c.hidden_size, H * D, dtype)
        self.k_proj = _linear(2 * c.hidden_size, KV * D, dtype)
        self.v_proj = _linear(2 * c.hidden_size, KV * D, dtype)
        self.o_proj = _linear(H * D, c.hidden_size, dtype)
        self.register_buffer(
            "inv_freq", _llama_inv_freq(D, c.rope_theta, c.rope_scaling), persistent=False
        )

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, D], neox style (rotate the two halves)
        f = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D / 2]
        cos, sin = f.cos()[:, None, :].to(x.dtype), f.sin()[:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, x, positions, md, kv_cache, graph: bool = False) -> torch.Tensor:
        """graph: a one-token-per-sequence step captured in a CUDA graph (no host sync):
        padding rows (slot -1) write the cache's scratch page, attention reads every page of
        the block table, masked by the sequence lengths (`paged_gqa_decode`)."""
        T = x.shape[0]
        q = self._rope(self.q_proj(x).view(T, self.num_heads, self.head_dim), positions)
        k = self._rope(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        flat = kv_cache.view(-1, 2, self.num_kv_heads, self.head_dim)  # [slots, 2, KVH, D]
        slots = md.slot_mapping
        if graph:  # the last slot is the scratch page's (see Eagle3Head.new_kv_cache)
            slots = torch.where(slots >= 0, slots, torch.full_like(slots, flat.shape[0] - 1))
        flat[slots, 0] = k.to(flat.dtype)
        flat[slots, 1] = v.to(flat.dtype)
        out = paged_gqa_decode(q, flat, md) if graph else paged_gqa(q, flat, md)  # [T, H, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


def paged_gqa(q: torch.Tensor, flat: torch.Tensor, md) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' cached K/V, one sequence at a
    time (its K/V gathered from its pages: O(context) transient memory per sequence, no paged
    kernel for this head). q [T, H, D]; flat [slots, 2, KVH, D] -> [T, H, D]."""
    ps = md.page_size
    qsl = md.query_start_loc.tolist()
    ctx = md.context_lens.tolist()
    lens = md.seq_lens.tolist()
    table = md.block_table.long()
    out = torch.empty_like(q)
    H, KVH = q.shape[1], flat.shape[2]
    for b, (c, n) in enumerate(zip(ctx, lens, strict=True)):
        pos = torch.arange(n, device=q.device)
        kv = flat[table[b, pos // ps] * ps + pos % ps]  # [S, 2, KVH, D]
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [KVH, S, D]
        if H != KVH:
            k, v = k.repeat_interleave(H // KVH, 0), v.repeat_interleave(H // KVH, 0)
        qb = q[qsl[b] : qsl[b + 1]].transpose(0, 1)  # [H, t, D]
        t = qb.shape[1]
        mask = pos[None, :] <= (c + torch.arange(t, device=q.device))[:, None]  # [t, S]
        o = sdpa(qb, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        out[qsl[b] : qsl[b + 1]] = o.transpose(0, 1)
    return out


def gqa_decode_uses_kernel(t: torch.Tensor) -> bool:
    """Whether `paged_gqa_decode` runs the Triton kernel for tensors on t's device."""
    from k2serve.kernels._triton import HAS_TRITON

    return t.is_cuda and HAS_TRITON


def paged_gqa_decode(q: torch.Tensor, flat: torch.Tensor, md) -> torch.Tensor:
    """One new token per sequence, without host syncs (CUDA-graph safe). q [B, H, D];
    flat [slots, 2, KVH, D] -> [B, H, D]. On CUDA the Triton kernel (kernels.gqa_decode: each
    sequence's keys up to its length); else every page of the block table gathered
    [B, W * page_size, 2, KVH, D], keys at or past seq_lens masked, the query heads grouped
    per KV head (no K/V repeated)."""
    if gqa_decode_uses_kernel(q):
        from k2serve.kernels.gqa_decode import gqa_decode

        return gqa_decode(q, flat, md.block_table, md.seq_lens, md.page_size)
    ps = md.page_size
    table = md.block_table.long()  # [B, W]
    B, W = table.shape
    H, D, KVH = q.shape[1], q.shape[2], flat.shape[2]
    off = torch.arange(ps, device=q.device)
    kv = flat[(table[:, :, None] * ps + off).view(B, W * ps)].to(q.dtype)  # [B, S, 2, KVH, D]
    k, v = kv[:, :, 0], kv[:, :, 1]  # [B, S, KVH, D]
    qg = q.view(B, KVH, H // KVH, D)
    s = torch.einsum("bkgd,bskd->bkgs", qg, k).float() * D**-0.5  # [B, KVH, G, S]
    keys = torch.arange(W * ps, device=q.device)
    s = s.masked_fill((keys[None, :] >= md.seq_lens[:, None])[:, None, None, :], float("-inf"))
    o = torch.einsum("bkgs,bskd->bkgd", s.softmax(-1).to(q.dtype), v)  # [B, KVH, G, D]
    return o.reshape(B, H, D)


class MLADraftAttention(nn.Module):
    """DeepSeek-V2 MLA (absorbed) over a paged latent cache, through the target's backend."""

    def __init__(self, c: Eagle3Config, dtype, backend) -> None:
        super().__init__()
        H = self.num_heads = c.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = c.q_lora_rank, c.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        qk = self.nope + self.rope_dim
        d_in = 2 * c.hidden_size
        if c.q_lora_rank:
            self.q_a_proj = _linear(d_in, c.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype)
            self.q_b_proj = _linear(c.q_lora_rank, H * qk, dtype)
        else:
            self.q_proj = _linear(d_in, H * qk, dtype)
        self.kv_a_proj_with_mqa = _linear(d_in, c.kv_lora_rank + self.rope_dim, dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, dtype)
        self.kv_b_proj = _linear(c.kv_lora_rank, H * (self.nope + self.v_dim), dtype)
        self.o_proj = _linear(H * self.v_dim, c.hidden_size, dtype)
        self.rope = YarnRotaryEmbedding(
            self.rope_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        )
        self.scaling = qk**-0.5 * _yarn_mscale(c.rope_scaling) ** 2
        self.backend = backend  # attention.MLABackend (store / forward), set by the loader

    def forward(self, x, positions, md, kv_cache, graph: bool = False) -> torch.Tensor:
        # graph: nothing different, the backend handles padding rows (slot -1: not stored)
        T, H = x.shape[0], self.num_heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(T, H, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)  # [T, L]
        cos, sin = self.rope.cos_sin(positions)
        q_pe, k_pe = self.rope.apply(q_pe, cos, sin), self.rope.apply(k_pe, cos, sin)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, N, L], [H, V, L]
        self.backend.store(kv_cache, latent, k_pe, md.slot_mapping)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk).contiguous()  # [T, H, L]
        o = self.backend.forward(q_latent, q_pe.contiguous(), kv_cache, md, self.scaling)
        o = torch.einsum("thl,hvl->thv", o, w_uv)  # [T, H, V]
        return self.o_proj(o.reshape(T, H * self.v_dim))


def _yarn_mscale(rs: dict | None) -> float:
    if not rs or (rs.get("type") or rs.get("rope_type")) != "yarn":
        return 1.0
    factor, m = float(rs.get("factor", 1.0)), float(rs.get("mscale_all_dim", 0.0))
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 and m else 1.0


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, inter, dtype)
        self.up_proj = _linear(hidden, inter, dtype)
        self.down_proj = _linear(inter, hidden, dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config, dtype, backend=None) -> None:
        super().__init__()
        H = c.hidden_size
        self.self_attn: nn.Module = (
            MLADraftAttention(c, dtype, backend)
            if c.kind == "mla"
            else LlamaDraftAttention(c, dtype)
        )
        self.mlp = DraftMLP(H, c.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps, dtype)


class Eagle3Head(nn.Module):
    d2t: torch.Tensor  # [draft_vocab] long buffer: target id = draft id + d2t[draft id]

    def __init__(self, c: Eagle3Config, dtype: torch.dtype, backend=None) -> None:
        super().__init__()
        self.config = c
        H = c.hidden_size
        self.embed_tokens: nn.Module | None = None  # None: the target's embedding is shared
        self.fc = _linear(3 * c.target_hidden_size, H, dtype)
        self.fc_norm = RMSNorm(c.target_hidden_size, c.rms_norm_eps, dtype) if c.eagle31 else None
        self.midlayer = Eagle3Layer(c, dtype, backend)
        self.norm = RMSNorm(H, c.rms_norm_eps, dtype)
        self.norm_output = RMSNorm(H, c.rms_norm_eps, dtype) if c.eagle31 else None
        self.lm_head = _linear(H, c.draft_vocab_size, dtype)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))

    def combine_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """[T, 3 * H_t] target hidden states -> [T, H]."""
        if self.fc_norm is not None:
            T = aux.shape[0]
            aux = self.fc_norm(aux.view(T, 3, -1)).view(T, -1)
        return self.fc(aux)

    def forward(self, embeds, hidden, positions, md, kv_cache, graph: bool = False):
        """embeds [T, H] (of the input tokens), hidden [T, H] -> (normed [T, H] for the logits,
        the hidden state for the next draft step [T, H]). graph: a one-token step captured in
        a CUDA graph (engine.spec_decode.eagle_graphs). `hidden` may be updated in place."""
        layer = self.midlayer
        if self.config.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual, h = hidden, hidden
        else:
            residual, h = hidden, layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), h], dim=-1)  # [T, 2H]
        a = layer.self_attn(x, positions, md, kv_cache, graph=graph)
        x, residual = layer.post_attention_layernorm.add_norm(a, residual)
        x = layer.mlp(x)
        out, prenorm = self.norm.add_norm(x, residual)
        nxt = self.norm_output(prenorm) if self.norm_output is not None else prenorm
        return out, nxt

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft token per row, as TARGET ids: [T, H] -> [T] long."""
        d = self.lm_head(normed).argmax(dim=-1)  # [T] draft ids
        return d + self.d2t[d]

    def new_kv_cache(self, num_pages: int, page_size: int, dtype, device) -> torch.Tensor:
        """The draft's KV, indexed by the target's pages; the Llama head's has one more page,
        a scratch page that the padding rows of a CUDA-graph step write (no block table names
        it). The MLA head's backend skips padding rows (slot -1) itself."""
        c = self.config
        if c.kind == "llama":
            shape: tuple[int, ...] = (num_pages + 1, page_size, 2, c.num_key_value_heads,
                                      c.head_dim)  # fmt: skip
        else:
            shape = (num_pages, page_size, c.kv_lora_rank + c.qk_rope_head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)
