"""Tensor parallel (2 ranks, gloo on CPU) with images: greedy tokens equal transformers' in both
--mm-encoder-tp-mode values ("data": each rank encodes a share of the step's images)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.multimodal.k25_ref import PLACEHOLDER, greedy, make_reference, random_image

from k2serve import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_k25")
from PIL import Image  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["data", "weights"])
def test_tp2_images(tmp_path, mode):
    model = make_reference(tmp_path, seed=2)
    rng = np.random.default_rng(7)
    imgs = [random_image(rng, 56, 84), random_image(rng, 28, 56), random_image(rng, 84, 84)]
    prompt = [int(t) for t in rng.integers(10, 250, size=10)]
    prompt[2:2] = [PLACEHOLDER]
    prompt[5:5] = [PLACEHOLDER]
    prompt[8:8] = [PLACEHOLDER]
    want = greedy(model, prompt, imgs, 8)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", tensor_parallel_size=2,
              mm_encoder_tp_mode=mode, kv_cache_memory="8MiB")  # fmt: skip
    try:
        out = llm.generate(
            {"prompt_token_ids": prompt,
             "multi_modal_data": {"image": [Image.fromarray(i) for i in imgs]}},
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        )[0]  # fmt: skip
        llm.llm_engine.check_integrity()
    finally:
        llm.close()
    assert out.outputs[0].token_ids == want
