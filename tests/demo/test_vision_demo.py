"""The bundled K2.5 demo (kimi-k2.5-demo): the K2.5 layout, the text contract of the text demo,
and "What is in this image?" answered with the picture's colours."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from k2serve import LLM, SamplingParams
from k2serve.config import ModelConfig

try:
    from k2serve.demo import vision_demo_path

    PATH = vision_demo_path()
except FileNotFoundError:  # pragma: no cover - before the demo is trained
    PATH = None

pytestmark = pytest.mark.skipif(PATH is None, reason="the K2.5 demo is not built")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(PATH), device="cpu", num_kv_pages=256)


def test_layout():
    cfg = ModelConfig.from_hf(PATH)
    assert cfg.vision is not None and cfg.weight_prefix == "language_model."
    assert (PATH / "preprocessor_config.json").is_file()
    index = json.loads((PATH / "model.safetensors.index.json").read_text())["weight_map"]
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in index
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in index
    assert sum(f.stat().st_size for f in PATH.iterdir()) < 10e6


def test_names_the_colours(llm):
    from train_vision_demo import picture

    rng = random.Random(1234)
    right = 0
    n = 24
    for _ in range(n):
        img, answer = picture(rng)
        parts = [{"type": "image_pil", "image_pil": img},
                 {"type": "text", "text": "What is in this image?"}]  # fmt: skip
        msgs = [{"role": "user", "content": parts}]
        out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=96))[0].outputs[0]
        assert out.finish_reason == "stop"
        right += answer in out.text
    assert right >= n * 0.75, right


def test_text_still_works(llm):
    params = SamplingParams(temperature=0, max_tokens=48)
    out = llm.chat([{"role": "user", "content": "Hello"}], params)
    assert "Hello!" in out[0].outputs[0].text
