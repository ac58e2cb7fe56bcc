"""EncoderCache: one tower run per image content, LRU bound, and calls split at max_patches
(the same embeddings as one call)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from k2serve.engine.multimodal import EncoderCache
from k2serve.multimodal.image import ImageProcessor
from k2serve.multimodal.inputs import ImageInput
from k2serve.weights.loader import load_model
from k2serve.weights.make_checkpoint import make_checkpoint
from k2serve.weights.presets import preset_config


def _images(sizes, seed=0) -> list[ImageInput]:
    rng = np.random.default_rng(seed)
    proc = ImageProcessor()
    return [
        ImageInput.from_processed(proc(Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8))))
        for w, h in sizes
    ]


def test_split_calls_equal_one_call_and_lru(tmp_path):
    make_checkpoint(tmp_path, preset_config("tiny-k2.5"), progress=False, tokenizer=False)
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    imgs = _images([(56, 56), (112, 84), (28, 56), (140, 140)])
    calls = []
    encode = model.encode_images

    def counting(pv, grids):
        calls.append(pv.shape[0])
        return encode(pv, grids)

    model.encode_images = counting
    whole = EncoderCache(model).encode(imgs)
    assert calls == [sum(i.pixel_values.shape[0] for i in imgs)]
    calls.clear()
    small = EncoderCache(model, max_patches=60)
    split = small.encode(imgs)
    assert len(calls) > 1 and all(c <= 60 or c == 100 for c in calls)  # 100: one 140x140 image
    for img in imgs:
        torch.testing.assert_close(split[img.mm_hash], whole[img.mm_hash], rtol=1e-5, atol=1e-6)
    calls.clear()
    small.encode(imgs[:2])
    assert calls == []  # cached
    lru = EncoderCache(model, max_tokens=30)
    lru.encode(imgs)
    assert sum(1 for i in imgs if i.mm_hash in lru) < len(imgs)  # bounded
    assert imgs[-1].mm_hash in lru  # the newest stays
