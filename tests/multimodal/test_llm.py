"""The offline API with images: LLM.chat with image parts (PIL, data URL), placeholder rules,
limits, a model without a tower, and a request aborted while its image is half prefilled."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from k2serve import LLM, SamplingParams
from k2serve.engine.request import RequestStatus
from k2serve.weights.make_checkpoint import make_checkpoint
from k2serve.weights.presets import preset_config

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_k25_llm")
    make_checkpoint(d, preset_config("tiny-k2.5"), progress=False)
    return LLM(str(d), device="cpu", dtype="float32", num_kv_pages=128, page_size=4,
               limit_mm_per_prompt={"image": 2}, max_num_batched_tokens=8)  # fmt: skip


def _img(w, h, seed=0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


def _data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_image_parts_equals_generate(llm):
    img = _img(56, 84)
    msgs = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(img)}},
        {"type": "text", "text": "What is in this image?"},
    ]}]  # fmt: skip
    a = llm.chat(msgs, PARAMS)[0]
    b = llm.chat([{**msgs[0], "content": [{"type": "image_pil", "image_pil": img},
                                          msgs[0]["content"][1]]}], PARAMS)[0]  # fmt: skip
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    tok = llm.get_tokenizer()
    pad = tok.token_to_id("<|media_pad|>")
    assert a.prompt_token_ids.count(pad) == (4 * 6) // 4  # expanded: one per merged token
    text = tok.apply_chat_template([{**msgs[0], "content": [{"type": "image"},
                                                            msgs[0]["content"][1]]}])  # fmt: skip
    c = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, PARAMS)[0]
    assert c.outputs[0].token_ids == a.outputs[0].token_ids


def test_placeholder_count_must_match(llm):
    pad = llm.get_tokenizer().token_to_id("<|media_pad|>")
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": _img(28, 28)}})
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt_token_ids": [5, pad, 7, pad],
                      "multi_modal_data": {"image": [_img(28, 28)]}})  # fmt: skip
    with pytest.raises(ValueError, match="at most 2"):
        llm.generate({"prompt_token_ids": [5, pad, 7, pad, 8, pad],
                      "multi_modal_data": {"image": [_img(28, 28)] * 3}})  # fmt: skip
    with pytest.raises(ValueError, match="video"):
        llm.generate({"prompt_token_ids": [5, pad], "multi_modal_data": {"video": [1]}})
    with pytest.raises(ValueError, match="no pixels"):
        llm.generate(
            {"prompt_token_ids": [5, pad], "multi_modal_data": {"image": Image.new("RGB", (0, 0))}}
        )
    llm.llm_engine.check_integrity()


def test_abort_while_the_image_is_prefilled_frees_everything(llm):
    eng = llm.llm_engine
    pad = eng.mm.placeholder_id
    ids, mm = eng.mm.process([5, pad, 6, 7], [_img(112, 112)])  # 16 image tokens
    eng.add_request("half", ids, PARAMS, mm_inputs=mm)
    eng.step()  # 8 tokens: the image is half prefilled
    req = eng._requests["half"]
    assert 0 < req.num_computed_tokens < mm[0].end
    eng.abort_request("half")
    while eng.has_unfinished_requests():
        eng.step()
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert eng.kv.num_pages_of(req) == 0
    eng.check_integrity()


def test_text_model_refuses_images(tmp_path):
    make_checkpoint(tmp_path, preset_config("tiny"), progress=False)
    llm = LLM(str(tmp_path), device="cpu", num_kv_pages=32)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": _img(28, 28)}})
