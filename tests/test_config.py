"""ModelConfig.from_hf on the real config.json variants, and the errors it gives (issue 2)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from k2serve.config import ConfigError, ModelConfig, known_model_config
from k2serve.model.layers import rope_parameters


def test_k2_instruct_fp8():
    c = ModelConfig.from_hf(known_model_config("kimi-k2-instruct"))
    assert c.quant.method == "fp8_block" and c.quant.block_size == (128, 128)
    assert c.kv_cache_dim == 576 and c.qk_head_dim == 192
    assert c.moe_layers == list(range(1, 61)) and c.weight_prefix == ""
    assert c.eos_token_ids == (163585,)
    # spec §3.4: factor 32 -> scale 0.1308608
    assert c.softmax_scale == pytest.approx(0.1308608, abs=1e-7)


def test_k2_thinking_int4_and_ignore_list():
    c = ModelConfig.from_hf(known_model_config("kimi-k2-thinking"))
    q = c.quant
    assert q.method == "int4_group" and q.group_size == 32
    assert c.softmax_scale == pytest.approx(0.1446796, abs=1e-7)  # factor 64
    assert not q.is_ignored("model.layers.3.mlp.experts.7.gate_proj")
    for name in (
        "lm_head",
        "model.layers.3.self_attn.q_a_proj",
        "model.layers.3.mlp.shared_experts.down_proj",
        "model.layers.0.mlp.up_proj",
    ):
        assert q.is_ignored(name), name


def test_k25_wrapper_prefix_and_vision(caplog, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(known_model_config("kimi-k2.5")))
    with caplog.at_level(logging.WARNING):
        c = ModelConfig.from_hf(tmp_path)
    assert c.weight_prefix == "language_model." and c.has_vision
    assert c.rms_norm_eps == 1e-5 and c.rope_scaling["beta_fast"] == 32.0
    assert c.quant.is_ignored("language_model.model.layers.1.self_attn.kv_b_proj")
    assert not c.quant.is_ignored("language_model.model.layers.1.mlp.experts.0.down_proj")
    assert not [r for r in caplog.records if "vision" in r.message]  # the tower is served
    v = c.vision
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads) == (1152, 27, 16)
    assert (v.intermediate_size, v.pos_emb_height, v.merge_kernel_size) == (4304, 64, (2, 2))
    assert v.media_placeholder_token_id == 163605 and v.merged_hidden_size == 4608


def test_plain_deepseek_v3_grouped_routing():
    cfg = known_model_config("kimi-k2-instruct")
    cfg.update(
        model_type="deepseek_v3",
        n_routed_experts=256,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
    )
    c = ModelConfig.from_hf(cfg)
    assert (c.n_group, c.topk_group) == (8, 4) and c.moe_layers[0] == 3


@pytest.mark.parametrize("name", ["kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5"])
def test_yarn_matches_transformers(name):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = known_model_config(name)
    tc = raw.get("text_config", raw)
    c = ModelConfig.from_hf(raw)
    hf = DeepseekV3Config(**{k: v for k, v in tc.items() if k != "quantization_config"})
    ref_inv, ref_att = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    inv, att = rope_parameters(
        c.qk_rope_head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
    )
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(ref_att)


def test_yarn_ramp_boundaries_k2():
    """spec §3.3: for K2-Instruct dims i <= 19 keep the base frequency, i >= 20 are / 32."""
    c = ModelConfig.from_hf(known_model_config("kimi-k2-instruct"))
    inv, att = rope_parameters(64, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    base = 1.0 / (50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    torch.testing.assert_close(inv[:20], base[:20])
    torch.testing.assert_close(inv[20:], base[20:] / 32)
    assert att == 1.0 and math.isclose(c.softmax_scale, 192**-0.5 * 1.813260, rel_tol=1e-6)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"num_key_value_heads": 8}, "num_key_value_heads"),
        ({"n_group": 5}, "n_group"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        (
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e5m2",
                    "weight_block_size": [128, 128],
                }
            },
            "fmt",
        ),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ],
)
def test_unsupported_fields_are_named(change, field):
    cfg = known_model_config("kimi-k2-instruct")
    cfg.update(change)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(cfg)


def test_missing_field_and_missing_file(tmp_path):
    cfg = known_model_config("kimi-k2-instruct")
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(cfg)
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path)
