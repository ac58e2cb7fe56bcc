"""EAGLE-3 draft checkpoints: loading one against its target, and writing random ones.

Loading (`load_eagle3`) reads config.json and the safetensors of a draft directory in either
published layout (`model.eagle3.Eagle3Head`), maps the other spellings of the tensor names
(`model.` prefix, `layers.0.` for `midlayer.`, `draft_id_to_target_id` for `d2t`, a fused
`fused_qkv_a_proj` / `gate_up_proj` split in two) and checks the draft against the target: its
hidden size, the target hidden size its `fc` expects (3 auxiliary states), its vocabulary and
vocabulary map, its auxiliary layer ids, and every tensor's shape. Anything that does not fit is
a `DraftError` (a ValueError) naming it. EAGLE3.1 heads are recognised by their `fc_norm` /
`norm_output` tensors. A head without `embed_tokens` shares the target's embedding.

Writing (`write_eagle3_checkpoint`, `k2serve make-checkpoint --draft ...`): a random head for a
given target config in the Llama-layer or the MLA layout (optionally EAGLE3.1), with a reduced
draft vocabulary and its `d2t` / `t2d` maps, so the loader and the engine are tested on the
layouts the published heads use.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from k2serve.config import ModelConfig
from k2serve.model.eagle3 import Eagle3Config, Eagle3Head


class DraftError(ValueError):
    pass


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM / SpecForge default: (2, N // 2, N - 3), clamped into [0, N)."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def _normalize(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]
    return name.replace("draft_id_to_target_id", "d2t")


def read_draft_tensors(draft_dir: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(draft_dir, "*.safetensors")))
    if not files:
        raise DraftError(f"draft {draft_dir!r} has no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[_normalize(k)] = f.get_tensor(k)
    return out


def _split_fused(t: dict[str, torch.Tensor], c: Eagle3Config) -> None:
    for fused in ("midlayer.self_attn.fused_qkv_a_proj.weight",
                  "midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"):  # fmt: skip
        w = t.pop(fused, None)
        if w is not None:
            q, kv = w.split([c.q_lora_rank or 0, c.kv_lora_rank + c.qk_rope_head_dim], dim=0)
            t["midlayer.self_attn.q_a_proj.weight"] = q
            t["midlayer.self_attn.kv_a_proj_with_mqa.weight"] = kv
    w = t.pop("midlayer.mlp.gate_up_proj.weight", None)
    if w is not None:
        t["midlayer.mlp.gate_proj.weight"], t["midlayer.mlp.up_proj.weight"] = w.chunk(2, dim=0)


def load_eagle3(
    draft_dir: str, target: ModelConfig, dtype: torch.dtype, device, backend=None
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The draft head on `device` and the target layer ids whose hidden states it reads."""
    path = os.path.join(draft_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DraftError(f"cannot read the draft's config.json: {e}") from None
    tensors = read_draft_tensors(draft_dir)
    raw = dict(raw, eagle31="fc_norm.weight" in tensors or raw.get("eagle31", False))
    try:
        c = Eagle3Config.from_hf(raw)
    except (KeyError, TypeError) as e:
        raise DraftError(f"draft config.json lacks or mistypes {e}") from None
    _check_fits(c, target)
    ids = c.aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers)
    if len(ids) != 3 or not all(0 <= i < target.num_hidden_layers for i in ids):
        raise DraftError(
            f"draft auxiliary layer ids {list(ids)} must be 3 target layers in "
            f"[0, {target.num_hidden_layers})"
        )
    _split_fused(tensors, c)
    tensors.pop("t2d", None)
    head = Eagle3Head(c, dtype, backend)
    if "embed_tokens.weight" in tensors:
        from k2serve.model.deepseek_v3 import Embedding

        head.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype)
    if "d2t" not in tensors:
        if c.draft_vocab_size != c.vocab_size:
            raise DraftError("the draft vocabulary is reduced but the checkpoint has no d2t map")
        tensors["d2t"] = torch.zeros(c.vocab_size, dtype=torch.long)
    persistent = set(head.state_dict())
    want: dict[str, torch.Tensor] = dict(head.named_parameters())
    want.update((n, b) for n, b in head.named_buffers() if n in persistent)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(k for k in set(tensors) - set(want) if "rotary_emb" not in k)
    if missing or extra:
        raise DraftError(f"draft tensors do not match its layout: missing {missing[:8]}, "
                         f"unexpected {extra[:8]}")  # fmt: skip
    for name, p in want.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise DraftError(
                f"draft tensor {name} has shape {tuple(t.shape)}, the head needs "
                f"{tuple(p.shape)} (does the draft fit this target?)"
            )
        p.data = t.to(device=device, dtype=p.dtype if p.is_floating_point() else torch.long)
    d2t: torch.Tensor = head.d2t
    targets = torch.arange(c.draft_vocab_size, device=d2t.device) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= target.vocab_size:
        raise DraftError("the draft's d2t map points outside the target vocabulary")
    head.to(device)
    return head.eval(), tuple(ids)


def _check_fits(c: Eagle3Config, t: ModelConfig) -> None:
    if c.target_hidden_size != t.hidden_size:
        raise DraftError(
            f"the draft reads target hidden states of size {c.target_hidden_size}, the target's "
            f"hidden size is {t.hidden_size}"
        )
    if c.hidden_size != t.hidden_size:
        raise DraftError(f"draft hidden_size {c.hidden_size} != target {t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        raise DraftError(f"draft vocab_size {c.vocab_size} != target {t.vocab_size}")
    if not 0 < c.draft_vocab_size <= c.vocab_size:
        raise DraftError(f"draft_vocab_size {c.draft_vocab_size} not in [1, {c.vocab_size}]")


# ---- writing random heads ----------------------------------------------------------------------
def eagle3_config_dict(
    target: ModelConfig, layout: str, eagle31: bool = False, draft_vocab_size: int | None = None
) -> dict:
    if layout not in ("llama", "mla"):
        raise ValueError(f"draft layout {layout!r} is not llama or mla")
    t = target
    d: dict = {
        "hidden_size": t.hidden_size,
        "target_hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_hidden_layers": 1,
        "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab_size or t.vocab_size,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(default_aux_layer_ids(t.num_hidden_layers)),
            "use_aux_hidden_state": True,
        },
    }
    if eagle31:
        d["eagle31"] = True
    if layout == "llama":
        d.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                 num_key_value_heads=t.num_attention_heads,
                 head_dim=t.hidden_size // t.num_attention_heads,
                 rope_theta=t.rope_theta)  # fmt: skip
    else:
        d.update(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v3",
                 q_lora_rank=t.q_lora_rank, kv_lora_rank=t.kv_lora_rank,
                 qk_nope_head_dim=t.qk_nope_head_dim, qk_rope_head_dim=t.qk_rope_head_dim,
                 v_head_dim=t.v_head_dim, rope_theta=t.rope_theta,
                 rope_scaling=t.rope_scaling)  # fmt: skip
    return d


def write_eagle3_checkpoint(
    out_dir: str,
    target: ModelConfig,
    layout: str,
    *,
    eagle31: bool = False,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    fused_qkv_a: bool = False,
) -> dict:
    """Write a random EAGLE-3 head for `target` into `out_dir`; returns its config dict."""
    from safetensors.torch import save_file

    d = eagle3_config_dict(target, layout, eagle31, draft_vocab_size)
    c = Eagle3Config.from_hf(d)
    head = Eagle3Head(c, torch.float32)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in head.named_parameters():
        if p.dim() == 1:  # RMSNorm weights
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        tensors[name] = v.to(torch.bfloat16)
    V, dv = c.vocab_size, c.draft_vocab_size
    keep = torch.randperm(V, generator=g)[:dv].sort().values  # the draft vocabulary (target ids)
    tensors["d2t"] = keep - torch.arange(dv)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    tensors["t2d"] = t2d
    if fused_qkv_a and layout == "mla":
        q = tensors.pop("midlayer.self_attn.q_a_proj.weight")
        kv = tensors.pop("midlayer.self_attn.kv_a_proj_with_mqa.weight")
        tensors["midlayer.self_attn.fused_qkv_a_proj.weight"] = torch.cat([q, kv])
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
    return d
