"""Oracle for the engine's greedy tokens: transformers' DeepseekV3ForCausalLM with the weights of
a bf16 k2serve checkpoint (read with safetensors, routed experts fused as transformers keeps
them), decoding by full recomputation each step (no KV cache)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def hf_model(ckpt_dir: str):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with open(os.path.join(ckpt_dir, "config.json")) as f:
        raw = json.load(f)
    assert "quantization_config" not in raw, "bf16 checkpoints only"
    cfg = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("auto_map", "model_type")})
    cfg._attn_implementation = "eager"
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    sd: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(ckpt_dir)):
        if name.endswith(".safetensors"):
            sd.update({k: v.float() for k, v in load_file(os.path.join(ckpt_dir, name)).items()})
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in sd:
            continue
        experts = range(cfg.n_routed_experts)
        gate_up = [
            torch.cat([sd.pop(f"{p}.{e}.gate_proj.weight"), sd.pop(f"{p}.{e}.up_proj.weight")])
            for e in experts
        ]
        sd[f"{p}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, D]
        sd[f"{p}.down_proj"] = torch.stack([sd.pop(f"{p}.{e}.down_proj.weight") for e in experts])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if not m.endswith("inv_freq")], missing
    return model


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_tokens: int, eos: frozenset[int]) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t in eos:
            break
    return out
