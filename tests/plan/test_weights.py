"""Weight and KV byte counts checked against hand arithmetic and published checkpoint sizes."""

from __future__ import annotations

import pytest

from k2serve.config import ModelConfig, known_model_config
from k2serve.plan import kv_bytes_per_token, weight_breakdown, weight_bytes

GiB = 2**30


def cfg(name: str) -> ModelConfig:
    return ModelConfig.from_hf(known_model_config(name))


@pytest.mark.parametrize("name", ["kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"])
def test_latent_kv_bytes_per_token(name):
    c = cfg(name)
    assert kv_bytes_per_token(c) == 61 * (512 + 64) * 2 == 70272
    assert kv_bytes_per_token(c, "bf16") == 61 * 576 * 2
    assert kv_bytes_per_token(c, "fp8") == 61 * 576 * 1


def test_kv_dtype_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_bytes_per_token(cfg("kimi-k2-thinking"), "int3")


def test_int4_routed_experts_from_shapes():
    b = weight_breakdown(cfg("kimi-k2-thinking"))
    params = 60 * 384 * 3 * 7168 * 2048
    packed = params // 2  # 4 bits each
    scales = params // 32 * 2  # one bf16 scale per 32 weights
    shapes = 60 * 384 * 3 * 2 * 4  # int32 weight_shape [2] per linear
    assert b.routed_experts == packed + scales + shapes
    # one expert: 22.0 MB of INT4 + 2.75 MB of scales (field.md derived figure)
    assert b.expert_bytes == 3 * 7168 * 2048 // 2 + 3 * 7168 * 2048 // 32 * 2 + 3 * 8


def test_fp8_routed_experts_from_shapes():
    b = weight_breakdown(cfg("kimi-k2-instruct"))
    w = 3 * 7168 * 2048  # 1 byte each
    s = (16 * 56 * 2 + 56 * 16) * 4  # float32 128x128 block scales: gate, up [16,56]; down [56,16]
    assert b.expert_bytes == w + s
    assert b.routed_experts == 60 * 384 * (w + s)


def test_bf16_groups_of_int4_model():
    b = weight_breakdown(cfg("kimi-k2-thinking"))
    # attention stays bf16 (ignore list re:.*self_attn.*)
    per_layer = (
        1536 * 7168
        + 1536  # q_a_proj + q_a_layernorm
        + 64 * 192 * 1536  # q_b_proj
        + 576 * 7168
        + 512  # kv_a_proj_with_mqa + kv_a_layernorm
        + 64 * (128 + 128) * 512  # kv_b_proj
        + 7168 * 64 * 128  # o_proj
        + 2 * 7168  # input / post-attention layer norms
    )
    assert b.attention == 61 * per_layer * 2
    assert b.dense_mlp == 3 * 18432 * 7168 * 2
    assert b.shared_experts == 60 * 3 * 2048 * 7168 * 2
    assert b.router == 60 * (384 * 7168 * 2 + 384 * 4)
    assert b.embeddings == (2 * 163840 * 7168 + 7168) * 2
    assert b.vision == 0


@pytest.mark.parametrize(
    "name,published_gib",
    # Total tensor bytes of the real checkpoints (shared/spec/kimi_format.md §2.1, §2.2).
    [("kimi-k2-instruct", 958.51), ("kimi-k2.5", 554.30)],
)
def test_total_matches_published_checkpoint(name, published_gib):
    assert weight_bytes(cfg(name)) / GiB == pytest.approx(published_gib, rel=2e-4)


def test_k25_vision_tower_counted():
    b = weight_breakdown(cfg("kimi-k2.5"))
    d, i = 1152, 4304
    block = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * i * d + i + d
    tower = d * 3 * 14 * 14 + d + 64 * 64 * d + 27 * block + 2 * d
    projector = 2 * d + 4608 * 4608 + 4608 + 7168 * 4608 + 7168
    assert b.vision == (tower + projector) * 2
    assert weight_bytes(cfg("kimi-k2.5"), include_vision=False) == weight_bytes(
        cfg("kimi-k2-thinking")
    )
