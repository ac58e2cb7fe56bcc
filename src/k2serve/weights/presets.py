"""Checkpoint presets: config.json dicts of Kimi-shaped models of three sizes.

- `tiny`: a few MB, for tests and the demo (hidden 256, 16 experts, vocab 2048).
- `small`: a few hundred MB, for CPU engine benchmarks (hidden 1024, 64 experts).
- `k2-slice`: the real Kimi-K2 sizes (hidden 7168, 64 heads, 384 experts of width 2048, vocab
  163840) with few layers (default 4: one dense + three MoE), for GPU benchmarks.
- `tiny-k2.5`, `k2.5-slice`: the same text models inside the K2.5 multimodal wrapper
  (`KimiK25ForConditionalGeneration`, `text_config`, `vision_config` with the original keys,
  weights under `language_model.` beside `vision_tower.` / `mm_projector.`): a 2-layer tower of
  width 64 for the tiny one, the full-size MoonViT (27 x 1152) for the slice.

Invariants: every dict has the real config.json keys (derived from the real Kimi-K2 config) and
the real `quantization_config` for the format; dims are multiples of 128 (FP8 blocks) and of 32
(INT4 groups); bos/eos sit where the tokenizer puts [BOS]/[EOS] (vocab - 256, vocab - 255).
"""

from __future__ import annotations

import copy

from k2serve.config import INT4_QUANT_CONFIG, known_model_config

PRESETS = ("tiny", "small", "k2-slice", "tiny-k2.5", "k2.5-tiny", "k2.5-slice")
FORMATS = ("bf16", "fp8", "int4")

FP8_QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

_SIZES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        vocab_size=2048,
    ),
    "small": dict(
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=1,
        vocab_size=32768,
    ),
    "k2-slice": dict(num_hidden_layers=4),
}


_TINY_VISION = dict(
    vt_num_hidden_layers=2,
    vt_hidden_size=64,
    vt_intermediate_size=128,
    vt_num_attention_heads=4,
    init_pos_emb_height=16,
    init_pos_emb_width=16,
    mm_hidden_size=64,
)
_K25_PRESETS = {
    "tiny-k2.5": ("tiny", _TINY_VISION),
    "k2.5-tiny": ("tiny", _TINY_VISION),
    "k2.5-slice": ("k2-slice", {}),
}


def vision_preset(name: str) -> str:
    """`make-checkpoint --vision`: the K2.5 form of a text preset."""
    return {"tiny": "tiny-k2.5", "small": "small-k2.5", "k2-slice": "k2.5-slice"}.get(name, name)


def preset_config(name: str, fmt: str = "bf16", layers: int | None = None) -> dict:
    """The config.json dict of preset `name` in format `fmt` ("bf16", "fp8", "int4")."""
    if name in _K25_PRESETS:
        return k25_config(*_K25_PRESETS[name], fmt, layers)
    if name == "small-k2.5":
        return k25_config("small", _TINY_VISION, fmt, layers)
    if name not in _SIZES:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    cfg = known_model_config("kimi-k2-instruct")
    cfg.pop("quantization_config", None)
    cfg.update(copy.deepcopy(_SIZES[name]))
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        cfg["num_hidden_layers"] = int(layers)
    vocab = cfg["vocab_size"]
    cfg["bos_token_id"] = vocab - 256
    cfg["eos_token_id"] = vocab - 255
    if fmt == "fp8":
        cfg["quantization_config"] = copy.deepcopy(FP8_QUANT_CONFIG)
    elif fmt == "int4":
        cfg["quantization_config"] = copy.deepcopy(INT4_QUANT_CONFIG)
    return cfg


def k25_config(text_preset: str, vision: dict, fmt: str, layers: int | None) -> dict:
    """A K2.5-format config.json: text preset `text_preset` as `text_config`, the K2.5
    `vision_config` with `vision` overriding its sizes; quantization at the top level."""
    text = preset_config(text_preset, fmt, layers)
    cfg = known_model_config("kimi-k2.5")
    quant = text.pop("quantization_config", None)
    if text_preset == "k2-slice":
        text = dict(cfg["text_config"], num_hidden_layers=text["num_hidden_layers"])
        text.pop("quantization_config", None)
    cfg["text_config"] = text
    cfg["vision_config"].update(vision, text_hidden_size=text["hidden_size"])
    vocab = text["vocab_size"]
    # bos / eos / the image placeholder where the tokenizer puts them in a vocab of this size
    cfg["bos_token_id"], cfg["eos_token_id"] = text["bos_token_id"], text["eos_token_id"]
    cfg["media_placeholder_token_id"] = vocab - 256 + 21  # <|media_pad|> (tokenizer.special)
    cfg["pad_token_id"] = text.get("pad_token_id", vocab - 1)
    if quant is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = quant
    return cfg
