"""`k2serve make-checkpoint --draft ...`: random EAGLE-3 heads in the published layouts that
`load_eagle3` reads back against their target (and refuses against another target)."""

import argparse
import json

import pytest
import torch

from k2serve.config import ModelConfig
from k2serve.weights.eagle3 import DraftError, load_eagle3
from k2serve.weights.make_checkpoint import DRAFT_LAYOUTS, add_arguments, run
from k2serve.weights.presets import preset_config


@pytest.mark.parametrize("layout", DRAFT_LAYOUTS)
def test_make_checkpoint_draft_loads(tmp_path, layout):
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    out = tmp_path / layout
    assert run(ap.parse_args([str(out), "--preset", "tiny", "--draft", layout,
                              "--draft-vocab-size", "300"])) == 0  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"][0] == (
        "Eagle3DeepseekV2ForCausalLM" if layout.endswith("mla") else "LlamaForCausalLMEagle3"
    )
    target = ModelConfig.from_hf(preset_config("tiny", "bf16"))
    head, ids = load_eagle3(str(out), target, torch.float32, "cpu")
    assert head.config.eagle31 == layout.startswith("eagle3.1")
    assert head.lm_head.weight.shape == (300, target.hidden_size)
    assert len(ids) == 3 and all(0 <= i < target.num_hidden_layers for i in ids)
    # the d2t map lands inside the target vocabulary, in increasing order
    t = torch.arange(300) + head.d2t
    assert bool((t[1:] > t[:-1]).all()) and int(t.max()) < target.vocab_size
    other = ModelConfig.from_hf(preset_config("small", "bf16"))
    with pytest.raises(DraftError):
        load_eagle3(str(out), other, torch.float32, "cpu")
