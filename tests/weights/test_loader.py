"""Streaming loader, writer, presets and make-checkpoint (issue 2, items 4-5)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k2serve.cli import main as cli_main
from k2serve.config import ModelConfig
from k2serve.weights.loader import CheckpointError, load_model
from k2serve.weights.make_checkpoint import make_checkpoint
from k2serve.weights.presets import preset_config


def _tiny(fmt="bf16", **kw) -> dict:
    cfg = preset_config("tiny", fmt, layers=2)
    cfg.update(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        bos_token_id=256,
        eos_token_id=257,
    )
    cfg.update(kw)
    return cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_checkpoint(d, _tiny(), seed=0, max_shard_bytes=200_000, tokenizer=False, progress=False)
    return str(d)


def _copy(src: str, dst, edit) -> str:
    """Copy a checkpoint, letting edit(tensors: dict, index: dict) change it."""
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(src, shard), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg = edit(tensors, cfg) or cfg
    save_file(tensors, os.path.join(dst, "model-00001-of-00001.safetensors"))
    wm = {k: "model-00001-of-00001.safetensors" for k in tensors}
    json.dump({"metadata": {}, "weight_map": wm}, open(dst / "model.safetensors.index.json", "w"))
    json.dump(cfg, open(dst / "config.json", "w"))
    return str(dst)


def _logits(model, n=9):
    ids = torch.arange(n) * 7 % model.config.vocab_size
    return model.compute_logits(model(ids, torch.arange(n)))


def test_layout_is_sharded_with_index(ckpt):
    files = sorted(os.listdir(ckpt))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(f"-of-{len(shards):05d}" in s for s in shards)
    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index["weight_map"]
    assert "lm_head.weight" in index["weight_map"]
    assert ModelConfig.from_hf(ckpt).num_hidden_layers == 2
    assert os.path.exists(os.path.join(ckpt, "generation_config.json"))


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t, c: t.pop("model.layers.1.self_attn.o_proj.weight"), ["missing", "o_proj"]),
        (
            lambda t, c: t.update({"model.layers.0.mlp.foo.weight": torch.zeros(2)}),
            ["unexpected", "mlp.foo"],
        ),
        (
            lambda t, c: t.update({"model.norm.weight": torch.zeros(7)}),
            ["model.norm.weight", "shape"],
        ),
        (
            lambda t, c: t.update({"model.norm.weight": torch.zeros(128, dtype=torch.int32)}),
            ["model.norm.weight", "int32"],
        ),
        (
            lambda t, c: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.float8_e4m3fn)}),
            ["lm_head.weight", "weight_scale_inv"],
        ),
    ],
)
def test_bad_tensors_are_named(ckpt, tmp_path, edit, words):
    d = _copy(ckpt, tmp_path, lambda t, c: (edit(t, c), None)[1])
    with pytest.raises(CheckpointError) as e:
        load_model(d, progress=False)
    for w in words:
        assert w in str(e.value)


def test_skips_mtp_layers_inv_freq_and_k25_vision(ckpt, tmp_path):
    base = _logits(load_model(ckpt, dtype=torch.float32, progress=False))

    def to_k25(t, cfg):
        for k in list(t):
            t["language_model." + k] = t.pop(k)
        t["language_model.model.layers.2.self_attn.q_a_proj.weight"] = torch.zeros(3)  # MTP
        t["language_model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(16)
        t["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3)
        t["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
        return {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": cfg,  # no vision_config: the tower's tensors are skipped
        }

    d = _copy(ckpt, tmp_path, to_k25)
    model = load_model(d, dtype=torch.float32, progress=False)
    assert model.config.weight_prefix == "language_model."
    torch.testing.assert_close(_logits(model), base, rtol=0, atol=0)


def test_single_file_checkpoint_and_no_index(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path, lambda t, c: None)
    os.rename(
        os.path.join(d, "model-00001-of-00001.safetensors"), os.path.join(d, "model.safetensors")
    )
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    load_model(d, progress=False)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d, progress=False)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_dummy_load_any_format_without_disk(fmt):
    cfg = ModelConfig.from_hf(_tiny(fmt))
    m = load_model(None, load_format="dummy", config=cfg, dtype=torch.float32, progress=False)
    assert not any(p.is_meta for p in m.parameters())
    logits = _logits(m)
    assert torch.isfinite(logits).all() and logits.std() > 0.05
    again = load_model(None, load_format="dummy", config=cfg, dtype=torch.float32, progress=False)
    torch.testing.assert_close(_logits(again), logits, rtol=0, atol=0)  # seeded


def test_presets_have_real_keys_and_sizes():
    k2 = preset_config("k2-slice", "int4")
    c = ModelConfig.from_hf(k2)
    assert (c.hidden_size, c.num_attention_heads, c.n_routed_experts) == (7168, 64, 384)
    assert (c.moe_intermediate_size, c.vocab_size, c.num_hidden_layers) == (2048, 163840, 4)
    assert c.quant.method == "int4_group" and c.quant.group_size == 32
    assert ModelConfig.from_hf(preset_config("small", "fp8", layers=2)).quant.method == "fp8_block"
    for name in ("tiny", "small"):
        c = ModelConfig.from_hf(preset_config(name, "bf16"))
        for d in (c.hidden_size, c.moe_intermediate_size, c.intermediate_size, c.kv_lora_rank):
            assert d % 128 == 0
    with pytest.raises(ValueError, match="preset"):
        preset_config("huge")


def test_make_checkpoint_cli(tmp_path, capsys):
    out = tmp_path / "ck"
    rc = cli_main(
        [
            "make-checkpoint",
            str(out),
            "--preset",
            "tiny",
            "--format",
            "int4",
            "--layers",
            "2",
            "--seed",
            "3",
            "--no-tokenizer",
        ]
    )
    assert rc == 0
    cfg = json.load(open(out / "config.json"))
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    index = json.load(open(out / "model.safetensors.index.json"))
    assert "model.layers.1.mlp.experts.0.up_proj.weight_packed" in index["weight_map"]
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in index["weight_map"]
    m = load_model(str(out), progress=False)
    assert torch.isfinite(_logits(m)).all()


def test_make_checkpoint_writes_matching_tokenizer(tmp_path):
    tok = pytest.importorskip("k2serve.tokenizer")
    cfg = _tiny()
    cfg["num_hidden_layers"] = 1
    make_checkpoint(tmp_path, cfg, tokenizer=True, progress=False)
    t = tok.KimiTokenizer.from_dir(str(tmp_path))
    assert t.vocab_size == cfg["vocab_size"]
    assert (t.bos_token_id, t.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert (tmp_path / "chat_template.jinja").exists()
