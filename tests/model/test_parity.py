"""k2serve vs transformers' DeepseekV3ForCausalLM on the same checkpoint (issue 2, item 6)."""

from __future__ import annotations

import pytest
import torch
from tests.model.hf_ref import hf_model

from k2serve.weights.loader import load_model


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _k2_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


@torch.no_grad()
def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[None]).logits[0].float()


def _greedy(step, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.clone()
    out = []
    for _ in range(n):
        nxt = int(step(ids)[-1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
    return out


PROMPT = torch.tensor([3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33, 83, 279, 502])


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("kind", ["kimi", "deepseek"])
def test_fp32_parity_with_transformers(make_ckpt, kind, fmt):
    d = make_ckpt(kind, fmt)
    ours = load_model(d, dtype=torch.float32, progress=False)
    ref = hf_model(d, torch.float32)
    assert _rel_err(_k2_logits(ours, PROMPT), _hf_logits(ref, PROMPT)) <= 1e-4
    a = _greedy(lambda ids: _k2_logits(ours, ids), PROMPT, 32)
    b = _greedy(lambda ids: _hf_logits(ref, ids), PROMPT, 32)
    assert a == b
    assert len(set(a)) > 3  # a degenerate continuation would prove little


def test_bf16_parity_with_transformers(make_ckpt):
    d = make_ckpt("deepseek", "bf16")
    ours = load_model(d, dtype=torch.bfloat16, progress=False)
    ref = hf_model(d, torch.bfloat16)
    assert _rel_err(_k2_logits(ours, PROMPT), _hf_logits(ref, PROMPT)) <= 2e-2


def test_weights_are_not_trivial(make_ckpt):
    """The parity above would be vacuous if routing or the bias had no effect."""
    d = make_ckpt("deepseek", "bf16")
    ours = load_model(d, dtype=torch.float32, progress=False)
    base = _k2_logits(ours, PROMPT)
    gate = ours.model.layers[1].mlp.gate
    gate.e_score_correction_bias.data = torch.zeros_like(gate.e_score_correction_bias)
    assert _rel_err(_k2_logits(ours, PROMPT), base) > 1e-3
