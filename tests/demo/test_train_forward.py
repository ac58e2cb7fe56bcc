"""The demo's packed training forward computes what the model's own forward computes."""

import torch

from k2serve.config import ModelConfig
from k2serve.demo.train_forward import packed_logits
from k2serve.model import DeepseekV3ForCausalLM
from k2serve.weights.loader import set_tensor
from k2serve.weights.presets import preset_config
from k2serve.weights.random_init import random_tensors


def _model():
    cfg = preset_config("tiny", "bf16")
    cfg.update(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, vocab_size=600,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(ModelConfig.from_hf(cfg), dtype=torch.float32)
    for name, t in random_tensors(model, seed=1):
        set_tensor(model, name, t)
    return model.eval()


def test_packed_equals_separate_forwards():
    model = _model()
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 600, (9,), generator=g)
    b = torch.randint(0, 600, (5,), generator=g)
    refs = [model.compute_logits(model(s, torch.arange(len(s)))) for s in (a, b)]
    with torch.no_grad():
        got = packed_logits(
            model, torch.cat([a, b]), torch.cat([torch.arange(9), torch.arange(5)]), [9, 5]
        )
        rows = packed_logits(
            model,
            torch.cat([a, b]),
            torch.cat([torch.arange(9), torch.arange(5)]),
            [9, 5],
            logit_rows=torch.tensor([3, 10]),
        )
    torch.testing.assert_close(got, torch.cat(refs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, torch.stack([refs[0][3], refs[1][1]]), rtol=1e-5, atol=1e-5)


def test_gradients_flow():
    model = _model()
    for p in model.parameters():
        p.requires_grad_(True)
    ids = torch.randint(0, 600, (12,))
    logits = packed_logits(model, ids, torch.cat([torch.arange(6)] * 2), [6, 6])
    logits.logsumexp(-1).sum().backward()
    assert model.model.layers[0].self_attn.kv_b_proj.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
