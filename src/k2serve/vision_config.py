"""K2.5 / K2.6 vision settings: the MoonViT tower (`vision_config`) and the image preprocessor
(`preprocessor_config.json`), read from either spelling.

Two spellings exist for each (shared/spec/kimi_format.md section 8):
- the original checkpoint's: `vision_config.vt_hidden_size`, `vt_num_hidden_layers`,
  `init_pos_emb_height`, ..., top-level `media_placeholder_token_id`; preprocessor
  `media_proc_cfg.{in_patch_limit, patch_limit_on_one_side, ...}`;
- the one transformers writes (`Kimi_K25Config.save_pretrained`): `vision_config.hidden_size`,
  `num_hidden_layers`, `pos_emb_height`, ..., top-level `image_token_id`; preprocessor
  `max_patches`, `size.max_height`, `merge_size`.
Both give the same frozen dataclasses; nothing here imports a layer of k2serve.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

MEDIA_PLACEHOLDER_TOKEN_ID = 163605  # <|media_pad|> in the Kimi vocabulary


class VisionConfigError(ValueError):
    """vision_config / preprocessor_config.json is unusable; the message names the field."""


def _pick(d: dict, *keys: str, default=None):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    if default is None:
        raise VisionConfigError(f"vision_config has none of {', '.join(keys)}")
    return default


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT tower + patch-merger projector shapes."""

    patch_size: int = 14
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    media_placeholder_token_id: int = MEDIA_PLACEHOLDER_TOKEN_ID

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token (4 * 1152 = 4608 for K2.5)."""
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, cfg: dict, text_hidden_size: int) -> VisionConfig:
        """From a kimi_k25 config.json dict (its `vision_config` and top-level keys)."""
        vc = cfg.get("vision_config")
        if not isinstance(vc, dict):
            raise VisionConfigError("vision_config must be an object")
        rope = vc.get("rope_parameters") or {}
        mk = _pick(vc, "merge_kernel_size", default=[2, 2])
        if isinstance(mk, int):
            mk = [mk, mk]
        out = cls(
            patch_size=int(_pick(vc, "patch_size", default=14)),
            hidden_size=int(_pick(vc, "vt_hidden_size", "hidden_size")),
            intermediate_size=int(_pick(vc, "vt_intermediate_size", "intermediate_size")),
            num_hidden_layers=int(_pick(vc, "vt_num_hidden_layers", "num_hidden_layers")),
            num_attention_heads=int(_pick(vc, "vt_num_attention_heads", "num_attention_heads")),
            pos_emb_height=int(_pick(vc, "init_pos_emb_height", "pos_emb_height", default=64)),
            pos_emb_width=int(_pick(vc, "init_pos_emb_width", "pos_emb_width", default=64)),
            pos_emb_time=int(_pick(vc, "init_pos_emb_time", "pos_emb_time", default=4)),
            merge_kernel_size=(int(mk[0]), int(mk[1])),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            projector_ln_eps=float(
                _pick(vc, "projector_ln_eps", default=cfg.get("projection_layer_norm_eps", 1e-5))
            ),
            text_hidden_size=int(vc.get("text_hidden_size") or text_hidden_size),
            media_placeholder_token_id=int(
                _pick(
                    cfg,
                    "media_placeholder_token_id",
                    "image_token_id",
                    default=MEDIA_PLACEHOLDER_TOKEN_ID,
                )
            ),
        )
        if out.hidden_size % out.num_attention_heads or out.head_dim % 4:
            raise VisionConfigError(
                f"vision hidden size {out.hidden_size} / {out.num_attention_heads} heads must give "
                "a head dim divisible by 4 (2D RoPE)"
            )
        if out.text_hidden_size != text_hidden_size:
            raise VisionConfigError(
                f"vision_config.text_hidden_size={out.text_hidden_size} differs from the text "
                f"model's hidden_size={text_hidden_size}"
            )
        ph = vc.get("projector_hidden_act", "gelu")
        if ph != "gelu":
            raise VisionConfigError(f"projector_hidden_act={ph!r} is not supported (only gelu)")
        return out


def _triple(v) -> tuple[float, float, float]:
    if isinstance(v, (int, float)):
        return (float(v),) * 3
    a, b, c = (float(x) for x in v)
    return (a, b, c)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Kimi_K25ImageProcessor's settings (NaViT resize, pad to patch * merge, normalize)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dict(cls, d: dict) -> ImageProcessorConfig:
        mpc = d.get("media_proc_cfg")
        m: dict = mpc if isinstance(mpc, dict) else d
        sz = m.get("size")
        size: dict = sz if isinstance(sz, dict) else {}
        mk = m.get("merge_kernel_size", m.get("merge_size", 2))
        if isinstance(mk, (list, tuple)):
            mk = mk[0]
        return cls(
            patch_size=int(m.get("patch_size", 14)),
            merge_kernel_size=int(mk),
            in_patch_limit=int(m.get("in_patch_limit", m.get("max_patches", 16384))),
            patch_limit_on_one_side=int(
                m.get("patch_limit_on_one_side", size.get("max_height", 512))
            ),
            image_mean=_triple(m.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=_triple(m.get("image_std", (0.5, 0.5, 0.5))),
        )

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike | None) -> ImageProcessorConfig:
        """preprocessor_config.json of `model_dir`; the K2.5 defaults when there is none."""
        if model_dir is None:
            return cls()
        path = os.path.join(os.fspath(model_dir), "preprocessor_config.json")
        if not os.path.exists(path):
            return cls()
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_json(self) -> dict:
        """preprocessor_config.json as the K2.5 checkpoint ships it (media_proc_cfg)."""
        return {
            "auto_map": {
                "AutoProcessor": "kimi_k25_processor.KimiK25Processor",
                "AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
            },
            "media_proc_cfg": {
                "in_patch_limit": self.in_patch_limit,
                "patch_size": self.patch_size,
                "image_mean": list(self.image_mean),
                "image_std": list(self.image_std),
                "merge_kernel_size": self.merge_kernel_size,
                "fixed_output_tokens": None,
                "patch_limit_on_one_side": self.patch_limit_on_one_side,
                "in_patch_limit_each_frame": 4096,
                "in_patch_limit_video": None,
                "sample_fps": 2.0,
                "max_num_frames_each_video": None,
                "temporal_merge_kernel_size": 4,
                "timestamp_mode": "hh:mm:ss.fff",
                "config_type": "image",
            },
        }
