"""Test helper: a transformers DeepseekV3ForCausalLM holding the same weights as a checkpoint.

Quantized tensors are dequantized by routes independent of k2serve: FP8 by a plain numpy
loop over 128x128 blocks, INT4 by the `compressed-tensors` package's unpack + dequantize.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors import safe_open


def hf_config(config_dict: dict):
    from transformers import DeepseekV3Config

    cfg = {k: v for k, v in config_dict.items() if k not in ("quantization_config", "auto_map")}
    cfg.pop("model_type", None)
    return DeepseekV3Config(**cfg)


def _fp8_dequant_numpy(w: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    wf = w.to(torch.float32).numpy()  # exact: every e4m3 value is a float32
    sf = s.numpy()
    out = np.empty_like(wf)
    rows, cols = wf.shape
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            out[i : i + block[0], j : j + block[1]] = (
                wf[i : i + block[0], j : j + block[1]] * sf[i // block[0], j // block[1]]
            )
    return torch.from_numpy(out)


def _int4_dequant_ct(packed, scale, shape, group_size: int) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=True
    )
    q = unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
    return dequantize(q, scale.to(torch.float32), args=args, dtype=torch.float32)


def read_dequantized(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint as float32 `weight`s (quantized triples dequantized)."""
    with open(os.path.join(ckpt_dir, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(set(wm.values())):
        with safe_open(os.path.join(ckpt_dir, shard), framework="pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    out = {}
    for k, t in raw.items():
        if k.endswith((".weight_scale_inv", ".weight_scale", ".weight_shape")):
            continue
        if k.endswith(".weight_packed"):
            base = k[: -len(".weight_packed")]
            gs = qc["config_groups"]["group_0"]["weights"]["group_size"]
            out[base + ".weight"] = _int4_dequant_ct(
                t, raw[base + ".weight_scale"], raw[base + ".weight_shape"], gs
            )
        elif k.endswith(".weight") and k[: -len(".weight")] + ".weight_scale_inv" in raw:
            out[k] = _fp8_dequant_numpy(t, raw[k[: -len(".weight")] + ".weight_scale_inv"])
        else:
            out[k] = t.to(torch.float32)
    return out


def hf_model(ckpt_dir: str, dtype: torch.dtype = torch.float32):
    """transformers' DeepseekV3ForCausalLM with the checkpoint's (dequantized) weights."""
    from transformers import DeepseekV3ForCausalLM

    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = hf_config(json.load(f))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.float32).eval()
    sd = read_dequantized(ckpt_dir)
    # transformers stores the routed experts fused: gate_up_proj [E, 2I, D], down_proj [E, D, I]
    fused: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in sd:
            continue
        E = cfg.n_routed_experts
        gate = [sd.pop(f"{p}.{e}.gate_proj.weight") for e in range(E)]
        up = [sd.pop(f"{p}.{e}.up_proj.weight") for e in range(E)]
        down = [sd.pop(f"{p}.{e}.down_proj.weight") for e in range(E)]
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        )
        fused[f"{p}.down_proj"] = torch.stack(down)
    sd.update(fused)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if not m.endswith("inv_freq")], missing
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model = model.to(dtype)
    # as from_pretrained(dtype=...) leaves them: rotary frequencies and router bias in float32
    model.model.rotary_emb.inv_freq = inv_freq
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    return model
