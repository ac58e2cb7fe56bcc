"""The full-size model built on the meta device has exactly the real checkpoints' tensors.

Expected figures come from the published tensor lists (shared/spec/kimi_format.md §2), not from
k2serve: K2-Instruct has 139,644 tensors / 958.51 GiB including one `rotary_emb.inv_freq` per
layer (61, ignored by the loader); K2.5 has 208,550 tensors / 554.30 GiB including the vision
tower and projector (335 tensors, ~0.88 GiB: 27 blocks x 12 + 3 patch-embed + 2 final norm + 6
projector).
"""

from __future__ import annotations

import pytest
import torch

from k2serve.config import ModelConfig, known_model_config
from k2serve.weights.loader import build_meta_model


@pytest.mark.parametrize(
    "name, tensors, gib",
    [
        ("kimi-k2-instruct", 139_644 - 61, 958.51),
        ("kimi-k2.5", 208_550, 554.30),  # the vision tower and projector included
    ],
)
def test_full_model_tensor_count_and_bytes_match_real_checkpoint(name, tensors, gib):
    config = ModelConfig.from_hf(known_model_config(name))
    sd = build_meta_model(config, torch.bfloat16).state_dict()
    assert len(sd) == tensors
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    assert nbytes / 2**30 == pytest.approx(gib, rel=1e-3)
    # spot-check real shapes and dtypes (spec §2.1 / §2.2)
    if config.quant.method == "fp8_block":
        assert sd["model.layers.5.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 56)
        assert sd["model.layers.5.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    else:
        assert sd["model.layers.5.mlp.experts.3.gate_proj.weight_packed"].shape == (2048, 896)
        assert sd["model.layers.5.mlp.experts.3.down_proj.weight_scale"].shape == (7168, 64)
        assert sd["model.layers.5.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.5.mlp.gate.e_score_correction_bias"].dtype == torch.float32
