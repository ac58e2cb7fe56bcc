"""Weight bytes of a DeepSeek-V3 / Kimi-K2 checkpoint, from `ModelConfig` shapes and dtypes.

Owns: the dtype sizes and the byte count of every weight group (attention, dense MLP, shared and
routed experts, router, embeddings, lm_head, vision tower) as stored, quantization scales
included. No torch import; pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k2serve.config import ModelConfig
from k2serve.memory import dtype_bytes

_dtype_bytes = dtype_bytes


# --------------------------------------------------------------------------------------------
# Weights


def linear_bytes(
    config: ModelConfig, module: str, out_features: int, in_features: int, quantized: bool = True
) -> int:
    """Bytes of one Linear weight as stored in the checkpoint (weight plus its scales).

    `module` is the checkpoint module name (with the K2.5 "language_model." prefix) so the
    compressed-tensors ignore list applies as it does at load time. `quantized=False` marks
    modules the format never quantizes (router, embeddings; lm_head under fp8).
    """
    q = config.quant
    base = int(_dtype_bytes(config.torch_dtype))
    if q is None or not quantized:
        return out_features * in_features * base
    if q.method == "fp8_block":
        # float8_e4m3fn weight + float32 weight_scale_inv [ceil(out/b0), ceil(in/b1)]
        b0, b1 = q.block_size
        return out_features * in_features + 4 * math.ceil(out_features / b0) * math.ceil(
            in_features / b1
        )
    if q.method == "int4_group":
        if q.is_ignored(module):
            return out_features * in_features * base
        # int32 weight_packed [out, in/8] + bf16 weight_scale [out, in/group] + int32 shape [2]
        packed = out_features * math.ceil(in_features / 8) * 4
        scales = out_features * math.ceil(in_features / q.group_size) * 2
        return packed + scales + 2 * 4
    raise ValueError(f"unknown quantization method {q.method!r}")


def _mlp_bytes(config: ModelConfig, module: str, inter: int) -> int:
    h = config.hidden_size
    return (
        linear_bytes(config, f"{module}.gate_proj", inter, h)
        + linear_bytes(config, f"{module}.up_proj", inter, h)
        + linear_bytes(config, f"{module}.down_proj", h, inter)
    )


@dataclass(frozen=True)
class WeightBreakdown:
    """Bytes per weight group, whole model (all layers), as stored.

    Attention is split into what tensor parallelism shards (q_b_proj, kv_b_proj, o_proj; or
    q_proj without q-LoRA) and what every TP rank replicates (q_a_proj, kv_a_proj_with_mqa,
    their norms and the layer norms), as vLLM's DeepseekV2 attention does.
    """

    attention_sharded: int
    attention_replicated: int
    dense_mlp: int
    shared_experts: int
    router: int
    routed_experts: int
    embeddings: int  # embed_tokens + lm_head + final norm
    lm_head: int  # the part of `embeddings` read for every decoded token
    vision: int  # K2.5 vision tower + mm_projector (bf16)
    expert_bytes: int  # one routed expert (gate + up + down with scales)
    num_moe_layers: int

    @property
    def attention(self) -> int:
        return self.attention_sharded + self.attention_replicated

    @property
    def non_expert(self) -> int:
        return self.total - self.routed_experts

    @property
    def total(self) -> int:
        return (
            self.attention
            + self.dense_mlp
            + self.shared_experts
            + self.router
            + self.routed_experts
            + self.embeddings
            + self.vision
        )


def _attention_bytes(config: ModelConfig, layer: int) -> tuple[int, int]:
    """(TP-sharded, replicated) bytes of one decoder layer's attention and layer norms."""
    p = f"{config.weight_prefix}model.layers.{layer}.self_attn"
    h, nh = config.hidden_size, config.num_attention_heads
    base = int(_dtype_bytes(config.torch_dtype))
    lin = lambda name, o, i: linear_bytes(config, f"{p}.{name}", o, i)
    kv_b_out = nh * (config.qk_nope_head_dim + config.v_head_dim)
    sharded = lin("kv_b_proj", kv_b_out, config.kv_lora_rank)
    sharded += lin("o_proj", h, nh * config.v_head_dim)
    replicated = lin("kv_a_proj_with_mqa", config.kv_lora_rank + config.qk_rope_head_dim, h)
    replicated += config.kv_lora_rank * base  # kv_a_layernorm
    if config.q_lora_rank:
        replicated += lin("q_a_proj", config.q_lora_rank, h) + config.q_lora_rank * base
        sharded += lin("q_b_proj", nh * config.qk_head_dim, config.q_lora_rank)
    else:
        sharded += lin("q_proj", nh * config.qk_head_dim, h)
    replicated += 2 * h * base  # input_layernorm, post_attention_layernorm
    return sharded, replicated


def vision_bytes(config: ModelConfig) -> int:
    """K2.5 MoonViT tower + patch-merger projector, bf16, from `vision_config` shapes."""
    vc = config.vision if config.has_vision else None
    if vc is None:
        return 0
    d, inter, p = vc.hidden_size, vc.intermediate_size, vc.patch_size
    merged, text = vc.merged_hidden_size, vc.text_hidden_size
    params = d * 3 * p * p + d  # patch_embed.proj weight [d, 3, p, p] + bias
    params += vc.pos_emb_height * vc.pos_emb_width * d
    block = 4 * d  # norm0, norm1 weight + bias
    block += 3 * d * d + 3 * d  # wqkv
    block += d * d + d  # wo
    block += inter * d + inter + d * inter + d  # mlp fc0, fc1
    params += vc.num_hidden_layers * block + 2 * d  # + final_layernorm
    params += 2 * d + merged * merged + merged + text * merged + text  # mm_projector
    return params * 2


def weight_breakdown(config: ModelConfig) -> WeightBreakdown:
    """Every weight of the checkpoint, grouped as the planner places them."""
    pre = config.weight_prefix
    h = config.hidden_size
    base = int(_dtype_bytes(config.torch_dtype))
    att_s = att_r = dense = shared = router = routed = 0
    expert = 0
    moe_layers = config.moe_layers
    for i in range(config.num_hidden_layers):
        s, r = _attention_bytes(config, i)
        att_s, att_r = att_s + s, att_r + r
        mlp = f"{pre}model.layers.{i}.mlp"
        if i in moe_layers:
            # router: gate.weight [E, hidden] bf16 + e_score_correction_bias [E] fp32
            router += config.n_routed_experts * h * base + config.n_routed_experts * 4
            if config.n_shared_experts:
                inter = config.n_shared_experts * config.moe_intermediate_size
                shared += _mlp_bytes(config, f"{mlp}.shared_experts", inter)
            expert = _mlp_bytes(config, f"{mlp}.experts.0", config.moe_intermediate_size)
            routed += config.n_routed_experts * expert
        else:
            dense += _mlp_bytes(config, mlp, config.intermediate_size)
    emb = config.vocab_size * h * base + h * base  # embed_tokens + final norm
    lm_head = config.vocab_size * h * base  # tied: the embedding matrix is read
    if not config.tie_word_embeddings:
        lm_q = config.quant is not None and config.quant.method == "int4_group"
        lm_head = linear_bytes(config, f"{pre}lm_head", config.vocab_size, h, quantized=lm_q)
        emb += lm_head
    return WeightBreakdown(
        attention_sharded=att_s,
        attention_replicated=att_r,
        dense_mlp=dense,
        shared_experts=shared,
        router=router,
        routed_experts=routed,
        embeddings=emb,
        lm_head=lm_head,
        vision=vision_bytes(config),
        expert_bytes=expert,
        num_moe_layers=len(moe_layers),
    )


def weight_bytes(config: ModelConfig, include_vision: bool = True) -> int:
    """Bytes of all weights as stored (= the checkpoint's tensor bytes)."""
    b = weight_breakdown(config)
    return b.total if include_vision else b.total - b.vision
