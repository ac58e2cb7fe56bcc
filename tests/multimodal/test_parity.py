"""Greedy parity with transformers' Kimi_K25ForConditionalGeneration (float32, random tiny
configs): one image, several images of different sizes in one prompt, image requests batched
with text-only ones, and an image whose tokens a chunked prefill splits over steps."""

from __future__ import annotations

import numpy as np
import pytest
from tests.multimodal.k25_ref import PLACEHOLDER, greedy, make_reference, random_image

from k2serve import LLM, SamplingParams

pytest.importorskip("transformers.models.kimi_k25")
from PIL import Image  # noqa: E402

STEPS = 16


@pytest.fixture(scope="module", params=[0, 1])
def ref(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"k25_{request.param}")
    model = make_reference(path, seed=request.param)
    return path, model


def _llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "8MiB")
    return LLM(str(path), dtype="float32", device="cpu", **kw)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def _prompt(rng, n_images: int, n_text: int = 6) -> list[int]:
    ids = [int(t) for t in rng.integers(10, 250, size=n_text)]
    for k in range(n_images):  # placeholders apart (the template puts tokens between them)
        ids[1 + 2 * k : 1 + 2 * k] = [PLACEHOLDER]
    return ids


def test_one_image(ref):
    path, model = ref
    rng = np.random.default_rng(3)
    img = random_image(rng, 56, 84)
    prompt = _prompt(rng, 1)
    want = greedy(model, prompt, [img], STEPS)
    llm = _llm(path)
    out = llm.generate(
        {"prompt_token_ids": prompt, "multi_modal_data": {"image": Image.fromarray(img)}},
        _params(),
    )[0]
    assert out.outputs[0].token_ids == want
    assert len(out.prompt_token_ids) == len(prompt) - 1 + (4 * 6) // 4  # image tokens counted


def test_several_images_and_batched_with_text(ref):
    path, model = ref
    rng = np.random.default_rng(4)
    imgs = [random_image(rng, h, w) for h, w in ((28, 28), (112, 56), (56, 140))]
    p_multi = _prompt(rng, 3, n_text=9)
    p_text = _prompt(rng, 0, n_text=11)
    p_one = _prompt(rng, 1)
    want = [
        greedy(model, p_multi, imgs, STEPS),
        greedy(model, p_text, [], STEPS),
        greedy(model, p_one, imgs[1:2], STEPS),
    ]
    llm = _llm(path)
    pil = [Image.fromarray(i) for i in imgs]
    outs = llm.generate(
        [
            {"prompt_token_ids": p_multi, "multi_modal_data": {"image": pil}},
            p_text,
            {"prompt_token_ids": p_one, "multi_modal_data": {"image": [Image.fromarray(imgs[1])]}},
        ],
        _params(),
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == want


def test_chunked_prefill_splits_an_image_encoded_once(ref):
    path, model = ref
    rng = np.random.default_rng(5)
    img = random_image(rng, 112, 112)  # 16 tokens
    prompt = _prompt(rng, 1)
    want = greedy(model, prompt, [img], STEPS)
    llm = _llm(path, max_num_batched_tokens=5, enable_prefix_caching=False)
    out = llm.generate(
        {"prompt_token_ids": prompt, "multi_modal_data": {"image": Image.fromarray(img)}},
        _params(),
    )[0]
    assert out.outputs[0].token_ids == want
    assert llm.llm_engine.runner.encoder_cache.num_encoded == 1


def test_prefix_cache_keys_include_the_image(ref):
    """Same text + another image never hits the first image's pages; the same image does."""
    path, model = ref
    rng = np.random.default_rng(6)
    a, b = random_image(rng, 56, 56), random_image(rng, 56, 56)
    prompt = [int(t) for t in rng.integers(10, 250, size=9)]
    prompt[8:8] = [PLACEHOLDER]  # 8 text tokens (two pages of 4), the image, then text
    prompt += [int(t) for t in rng.integers(10, 250, size=9)]
    llm = _llm(path, page_size=4)

    def run(img):
        mm = {"image": Image.fromarray(img)}
        return llm.generate({"prompt_token_ids": prompt, "multi_modal_data": mm}, _params())[0]

    first = run(a)
    other = run(b)
    again = run(a)
    assert other.outputs[0].token_ids == greedy(model, prompt, [b], STEPS)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 8  # the text before the image only
    assert again.num_cached_tokens >= 8 + 4 + 4  # through the image and beyond
    llm.llm_engine.kv.check_integrity()
    assert llm.llm_engine.runner.encoder_cache.num_encoded == 2  # a, b; a again from cache
