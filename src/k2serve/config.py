"""Model configuration: one frozen dataclass read from a checkpoint's config.json.

Over 500 lines on purpose: the built-in configs of the real models (Kimi-K2, K2.5, DeepSeek-V3,
as data) and the field-by-field checks of every config.json variant belong with the dataclass
they fill; the parsing itself is short.

Owns: parsing of the Kimi-K2 / Kimi-K2.5 / DeepSeek-V3 config.json variants into `ModelConfig`
and `QuantConfig`, the built-in configs of the real models (used by `plan`, `make-checkpoint
--preset k2-slice` and tests), and the checks that refuse fields k2serve cannot honour.

Invariants:
- Every value the model code needs is a field here; nothing reads the raw dict later except
  `raw` for writing it back out.
- A field k2serve cannot honour raises `ConfigError` naming the field and its value.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from k2serve.vision_config import VisionConfig, VisionConfigError

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config.json that k2serve cannot serve; the message names the field."""


# --------------------------------------------------------------------------------------------
# Quantization


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's linear weights are stored.

    method:
      "fp8_block"  - float8_e4m3fn weights + float32 `weight_scale_inv` per `block_size` block
                     (multiplied, not divided). Which modules are fp8 is read from the tensors
                     present (a `weight_scale_inv` next to the weight).
      "int4_group" - compressed-tensors pack-quantized: int32 `weight_packed` (8 nibbles, value+8,
                     lowest nibble = lowest column), bf16 `weight_scale` per `group_size` columns,
                     int32 `weight_shape`. Modules matching `ignore` stay bf16.
    """

    method: str
    block_size: tuple[int, int] = (128, 128)  # fp8_block
    group_size: int = 32  # int4_group
    num_bits: int = 4  # int4_group
    ignore: tuple[str, ...] = ()  # int4_group: names and "re:<regex>" entries
    targets: tuple[str, ...] = ("Linear",)
    raw: dict = field(default_factory=dict, compare=False, hash=False)

    @staticmethod
    def from_hf(qc: dict | None) -> QuantConfig | None:
        if not qc:
            return None
        qm = qc.get("quant_method")
        if qm == "fp8":
            fmt = qc.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise ConfigError(f"quantization_config.fmt={fmt!r} is not supported (only 'e4m3')")
            bs = qc.get("weight_block_size")
            if not bs or len(bs) != 2:
                raise ConfigError(
                    f"quantization_config.weight_block_size={bs!r}: k2serve needs [rows, cols] "
                    "block scales (per-tensor FP8 is not supported)"
                )
            act = qc.get("activation_scheme", "dynamic")
            if act != "dynamic":
                raise ConfigError(
                    f"quantization_config.activation_scheme={act!r} is not supported "
                    "(only 'dynamic')"
                )
            return QuantConfig(method="fp8_block", block_size=(int(bs[0]), int(bs[1])), raw=qc)
        if qm == "compressed-tensors":
            fmt = qc.get("format")
            if fmt != "pack-quantized":
                raise ConfigError(
                    f"quantization_config.format={fmt!r} is not supported (only 'pack-quantized')"
                )
            groups = qc.get("config_groups") or {}
            if len(groups) != 1:
                raise ConfigError(
                    f"quantization_config.config_groups has {len(groups)} groups; "
                    "k2serve supports one"
                )
            ((gname, group),) = groups.items()
            w = group.get("weights") or {}
            p = f"quantization_config.config_groups.{gname}.weights"
            checks = {
                "num_bits": (w.get("num_bits"), 4),
                "type": (w.get("type"), "int"),
                "strategy": (w.get("strategy"), "group"),
                "symmetric": (w.get("symmetric"), True),
            }
            for key, (got, want) in checks.items():
                if got != want:
                    raise ConfigError(
                        f"{p}.{key}={got!r} is not supported (k2serve needs {want!r})"
                    )
            if w.get("actorder") not in (None, False):
                raise ConfigError(f"{p}.actorder={w.get('actorder')!r} is not supported")
            if w.get("dynamic"):
                raise ConfigError(f"{p}.dynamic=True is not supported")
            if group.get("input_activations"):
                raise ConfigError(
                    f"quantization_config.config_groups.{gname}.input_activations is set; "
                    "k2serve supports weight-only INT4"
                )
            gs = int(w.get("group_size") or 0)
            if gs <= 0:
                raise ConfigError(f"{p}.group_size={w.get('group_size')!r} must be a positive int")
            return QuantConfig(
                method="int4_group",
                group_size=gs,
                num_bits=4,
                ignore=tuple(qc.get("ignore") or ()),
                targets=tuple(group.get("targets") or ("Linear",)),
                raw=qc,
            )
        raise ConfigError(
            f"quantization_config.quant_method={qm!r} is not supported "
            "(k2serve reads 'fp8' block and 'compressed-tensors' pack-quantized)"
        )

    def is_ignored(self, module_name: str) -> bool:
        """compressed-tensors rule: a module stays unquantized if it matches an ignore entry.

        `module_name` is the full module path as in the checkpoint, without the ".weight" suffix
        (e.g. "language_model.model.layers.3.mlp.experts.7.gate_proj").
        """
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif module_name == entry or module_name.endswith("." + entry):
                return True
        return False


# --------------------------------------------------------------------------------------------
# Model


_KNOWN_ARCHS = (
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "Kimi_K25ForConditionalGeneration",  # the name transformers' save_pretrained writes
)


@dataclass(frozen=True)
class ModelConfig:
    """The text model's hyper-parameters (DeepSeek-V3 architecture)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    quant: QuantConfig | None = None
    # Where the text model's tensors live in the checkpoint: "" for model.* / lm_head.*,
    # "language_model." for the K2.5 multimodal wrapper.
    weight_prefix: str = ""
    model_type: str = "kimi_k2"
    has_vision: bool = False
    num_nextn_predict_layers: int = 0
    vision: VisionConfig | None = None  # K2.5 MoonViT tower + projector (k2serve.vision_config)
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer in the absorbed MLA form (512 + 64 for Kimi)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim (as transformers)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs and rs.get("mscale_all_dim"):
            m = yarn_get_mscale(float(rs.get("factor", 1.0)), float(rs["mscale_all_dim"]))
            scale = scale * m * m
        return scale

    # ---- construction ------------------------------------------------------------------------
    @staticmethod
    def from_hf(path_or_dict: str | os.PathLike | dict) -> ModelConfig:
        """Read a checkpoint directory (or its config.json path, or the parsed dict)."""
        if isinstance(path_or_dict, dict):
            cfg = path_or_dict
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.exists(p):
                raise ConfigError(f"no config.json at {p}")
            with open(p) as f:
                try:
                    cfg = json.load(f)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{p} is not valid JSON: {e}") from None
            if not isinstance(cfg, dict):
                raise ConfigError(f"{p} must hold a JSON object")
        return _from_dict(cfg)

    def to_hf(self) -> dict:
        """The config.json dict this config was read from (or made for)."""
        return copy.deepcopy(self.raw)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_scaling(tc: dict) -> dict | None:
    rs = tc.get("rope_scaling")
    if rs is None and isinstance(tc.get("rope_parameters"), dict):  # transformers 5 layout
        rs = dict(tc["rope_parameters"])
        rs.pop("rope_theta", None)
    if not rs:
        return None
    rs = dict(rs)
    kind = rs.get("type", rs.get("rope_type"))
    if kind in (None, "default"):
        return None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"rope_scaling.type={kind!r} is not supported (only 'yarn')")
    rs["type"] = "yarn"
    rs.pop("rope_type", None)
    return rs


def _rope_theta(tc: dict) -> float:
    if "rope_theta" in tc:
        return float(tc["rope_theta"])
    rp = tc.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return 10000.0


# config.json fields read as integers / numbers: a value of another type is an error naming it
_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "moe_layer_freq",
    "max_position_embeddings",
    "num_nextn_predict_layers",
)
_FLOAT_FIELDS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")


def _from_dict(cfg: dict) -> ModelConfig:
    archs = cfg.get("architectures") or ["DeepseekV3ForCausalLM"]
    arch = archs[0]
    if arch not in _KNOWN_ARCHS:
        raise ConfigError(
            f"architectures={archs!r} is not supported (k2serve serves {', '.join(_KNOWN_ARCHS)})"
        )
    prefix = ""
    has_vision = False
    tc = cfg
    top_quant = cfg.get("quantization_config")
    if arch != "DeepseekV3ForCausalLM" or cfg.get("model_type") == "kimi_k25":
        text_config = cfg.get("text_config")
        if not isinstance(text_config, dict):
            raise ConfigError("text_config is missing: a kimi_k25 config.json must have one")
        tc = text_config
        prefix = "language_model."
        has_vision = "vision_config" in cfg

    def need(key: str) -> Any:
        if key not in tc:
            raise ConfigError(f"config.json field {key!r} is missing")
        return tc[key]

    for key in _INT_FIELDS:
        v = tc.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"config.json field {key}={v!r} must be an integer")
    for key in _FLOAT_FIELDS:
        v = tc.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"config.json field {key}={v!r} must be a number")

    act = tc.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
    if tc.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (Kimi/DeepSeek-V3 have no biases)")
    scoring = tc.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func={scoring!r} is not supported (only 'sigmoid')")
    topk_method = tc.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"topk_method={topk_method!r} is not supported (only 'noaux_tc')")
    nh, nkv = int(need("num_attention_heads")), tc.get("num_key_value_heads")
    if nkv is not None and int(nkv) != nh:
        raise ConfigError(
            f"num_key_value_heads={nkv} differs from num_attention_heads={nh}; MLA needs them equal"
        )
    n_routed = int(tc.get("n_routed_experts") or 0)
    topk = int(tc.get("num_experts_per_tok") or 0)
    n_group = int(tc.get("n_group") or 1)
    topk_group = int(tc.get("topk_group") or 1)
    if n_routed:
        if not 0 < topk <= n_routed:
            raise ConfigError(
                f"num_experts_per_tok={topk} must be in 1..n_routed_experts={n_routed}"
            )
        if n_routed % n_group:
            raise ConfigError(f"n_group={n_group} does not divide n_routed_experts={n_routed}")
        if not 0 < topk_group <= n_group:
            raise ConfigError(f"topk_group={topk_group} must be in 1..n_group={n_group}")
        if topk > topk_group * (n_routed // n_group):
            raise ConfigError(
                f"num_experts_per_tok={topk} exceeds the experts in topk_group={topk_group} groups"
            )
    eos = tc.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    quant = QuantConfig.from_hf(tc.get("quantization_config") or top_quant)
    q_lora = tc.get("q_lora_rank")
    return ModelConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        moe_intermediate_size=int(tc.get("moe_intermediate_size") or 0),
        num_hidden_layers=int(need("num_hidden_layers")),
        num_attention_heads=nh,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=int(need("qk_nope_head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim")),
        v_head_dim=int(need("v_head_dim")),
        n_routed_experts=n_routed,
        n_shared_experts=int(tc.get("n_shared_experts") or 0),
        num_experts_per_tok=topk,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(tc.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(tc.get("norm_topk_prob", True)),
        first_k_dense_replace=int(tc.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(tc.get("moe_layer_freq", 1)),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(tc),
        rope_scaling=_rope_scaling(tc),
        max_position_embeddings=int(need("max_position_embeddings")),
        # NOTE: in a kimi_k25 wrapper the top-level flag is the one transformers acts on
        tie_word_embeddings=bool(
            cfg.get("tie_word_embeddings")
            if prefix and "tie_word_embeddings" in cfg
            else tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        ),
        bos_token_id=tc.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=eos_ids,
        pad_token_id=tc.get("pad_token_id", cfg.get("pad_token_id")),
        torch_dtype=str(tc.get("torch_dtype") or tc.get("dtype") or "bfloat16"),
        quant=quant,
        weight_prefix=prefix,
        model_type=str(cfg.get("model_type", "kimi_k2")),
        has_vision=has_vision,
        num_nextn_predict_layers=int(tc.get("num_nextn_predict_layers") or 0),
        vision=_vision(cfg, int(need("hidden_size"))) if has_vision else None,
        raw=copy.deepcopy(cfg),
    )


def _vision(cfg: dict, text_hidden_size: int) -> VisionConfig:
    try:
        return VisionConfig.from_hf(cfg, text_hidden_size)
    except (VisionConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"vision_config: {e}") from None


# --------------------------------------------------------------------------------------------
# The real models' config.json, as published (see shared/spec/kimi_format.md §1-2).

_K2_INSTRUCT: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "model_type": "kimi_k2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

INT4_QUANT_CONFIG: dict = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _variant(base: dict, **changes: Any) -> dict:
    out = copy.deepcopy(base)
    out.update(copy.deepcopy(changes))
    return out


_ROPE_64 = {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 64.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}

_K2_0905 = _variant(_K2_INSTRUCT, max_position_embeddings=262144, rope_scaling=_ROPE_64)
_K2_THINKING = _variant(
    _K2_INSTRUCT,
    max_position_embeddings=262144,
    rope_scaling=_ROPE_64,
    quantization_config=INT4_QUANT_CONFIG,
)
_K25_TEXT = _variant(
    _K2_THINKING,
    rms_norm_eps=1e-05,
    pad_token_id=163839,
    rope_scaling=dict(_ROPE_64, beta_fast=32.0),
)
_K25: dict = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    },
    "model_type": "kimi_k25",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "media_placeholder_token_id": 163605,
    "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "tie_word_embeddings": False,
    "quantization_config": INT4_QUANT_CONFIG,
    "text_config": _K25_TEXT,
    "vision_config": {
        "patch_size": 14,
        "vt_num_hidden_layers": 27,
        "vt_hidden_size": 1152,
        "vt_intermediate_size": 4304,
        "vt_num_attention_heads": 16,
        "init_pos_emb_height": 64,
        "init_pos_emb_width": 64,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": 1152,
        "text_hidden_size": 7168,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
    },
}

# name -> (config.json dict, Hugging Face repo id)
KNOWN_MODELS: dict[str, tuple[dict, str]] = {
    "kimi-k2-instruct": (_K2_INSTRUCT, "moonshotai/Kimi-K2-Instruct"),
    "kimi-k2-instruct-0905": (_K2_0905, "moonshotai/Kimi-K2-Instruct-0905"),
    "kimi-k2-thinking": (_K2_THINKING, "moonshotai/Kimi-K2-Thinking"),
    "kimi-k2.5": (_K25, "moonshotai/Kimi-K2.5"),
}


def known_model_config(name: str) -> dict:
    """A deep copy of a built-in real model's config.json dict."""
    key = name.lower()
    if key not in KNOWN_MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return copy.deepcopy(KNOWN_MODELS[key][0])
