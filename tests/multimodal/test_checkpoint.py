"""K2.5-format checkpoints: `make-checkpoint --preset tiny-k2.5` writes the original layout
(config.json keys, preprocessor_config.json, tensor names), k2serve loads it, and transformers
loads it too (no missing or unexpected tensor) and computes the same image features."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from k2serve.config import ModelConfig
from k2serve.weights.loader import load_model
from k2serve.weights.make_checkpoint import make_checkpoint
from k2serve.weights.presets import preset_config


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_k25")
    make_checkpoint(d, preset_config("tiny-k2.5"), progress=False)
    return d


def _names(d) -> set[str]:
    out: set[str] = set()
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as g:
            out |= set(g.keys())
    return out


def test_layout(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["model_type"] == "kimi_k25" and "text_config" in cfg
    vc = cfg["vision_config"]
    for key in ("vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads",
                "vt_intermediate_size", "init_pos_emb_height", "merge_kernel_size",
                "mm_projector_type", "text_hidden_size"):  # fmt: skip
        assert key in vc
    assert cfg["media_placeholder_token_id"] == cfg["text_config"]["vocab_size"] - 256 + 21
    pp = json.loads((ckpt / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert (pp["patch_size"], pp["in_patch_limit"], pp["patch_limit_on_one_side"]) == (
        14, 16384, 512)  # fmt: skip
    names = _names(ckpt)
    blk = "vision_tower.encoder.blocks"
    for n in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
              f"{blk}.1.wqkv.weight", f"{blk}.0.wo.bias", f"{blk}.0.mlp.fc0.weight",
              f"{blk}.0.norm1.bias", "vision_tower.encoder.final_layernorm.weight",
              "mm_projector.pre_norm.weight", "mm_projector.proj.0.weight",
              "mm_projector.proj.2.bias", "language_model.model.embed_tokens.weight",
              "language_model.lm_head.weight"):  # fmt: skip
        assert n in names, n
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in names)


def test_k25_slice_has_the_full_size_tower():
    c = ModelConfig.from_hf(preset_config("k2.5-slice", "int4"))
    v = c.vision
    assert (v.hidden_size, v.num_hidden_layers, v.intermediate_size) == (1152, 27, 4304)
    assert c.hidden_size == 7168 == v.text_hidden_size and c.quant.method == "int4_group"


def test_cli_writes_the_format(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "k2serve.cli", "make-checkpoint", str(tmp_path / "c"),
         "--preset", "tiny-k2.5", "--no-tokenizer"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c" / "preprocessor_config.json").exists()
    r = subprocess.run(
        [sys.executable, "-m", "k2serve.cli", "make-checkpoint", str(tmp_path / "v"),
         "--preset", "tiny", "--vision", "--format", "int4", "--no-tokenizer"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    c = ModelConfig.from_hf(tmp_path / "v")
    assert c.vision is not None and c.quant.method == "int4_group"
    load_model(tmp_path / "v", progress=False)


def test_transformers_loads_it_and_agrees(ckpt, tmp_path):
    pytest.importorskip("transformers.models.kimi_k25")
    import shutil

    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    d = tmp_path / "hf"
    shutil.copytree(ckpt, d)
    raw = json.loads((ckpt / "config.json").read_text())
    vc = raw["vision_config"]
    hf = Kimi_K25Config(
        text_config=dict(raw["text_config"], model_type="deepseek_v3"),
        vision_config=dict(
            patch_size=14, pos_emb_height=vc["init_pos_emb_height"],
            pos_emb_width=vc["init_pos_emb_width"],
            num_attention_heads=vc["vt_num_attention_heads"],
            num_hidden_layers=vc["vt_num_hidden_layers"], hidden_size=vc["vt_hidden_size"],
            intermediate_size=vc["vt_intermediate_size"],
        ),
        projection_hidden_size=vc["vt_hidden_size"],
        image_token_id=raw["media_placeholder_token_id"],
        tie_word_embeddings=False,
    )  # fmt: skip
    hf.save_pretrained(d)
    ref, info = Kimi_K25ForConditionalGeneration.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = load_model(ckpt, dtype=torch.float32, progress=False)
    grids = [(4, 6), (16, 16), (20, 8)]  # the table is 16 x 16: one grid uses it as is
    g = torch.Generator().manual_seed(0)
    pv = torch.randn(sum(h * w for h, w in grids), 3, 14, 14, generator=g)
    got = ours.encode_images(pv, grids)
    with torch.no_grad():
        want = ref.model.get_image_features(
            pv, torch.tensor([[1, h, w] for h, w in grids])
        ).pooler_output
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
