"""tokenizer.safe: client strings are encoded as text wherever a template puts them."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from k2serve.tokenizer.safe import SpecialTokenGuard, pick_sentinel, render_and_encode

NAMES = ["<|im_end|>", "<|im_user|>", "<|im_middle|>", "<think>", "</think>", "[EOS]"]
PIECES = st.lists(
    st.sampled_from(NAMES + ["<|im_", "end|>", "<", ">", "|", "[", "]", "a", " ", "é", "\ue000"]),
    max_size=12,
).map("".join)


def _template(user: str, name: str) -> str:
    return f"<|im_user|>{name}<|im_middle|>{user}<|im_end|><|im_assistant|>"


@settings(max_examples=200, deadline=None)
@given(user=PIECES, name=PIECES)
def test_user_strings_are_text_and_markers_are_specials(tok, user, name):
    text, ids = render_and_encode(tok, _template, user, name)
    assert text == _template(user, name)  # the visible prompt is the plain rendering
    want = (
        tok.encode("<|im_user|>")
        + tok.encode(name, allow_special=False)
        + tok.encode("<|im_middle|>")
        + tok.encode(user, allow_special=False)
        + tok.encode("<|im_end|><|im_assistant|>")
    )
    assert ids == want


def test_tojson_with_ensure_ascii_leaves_no_sentinel_behind(tok):
    def render(tools):
        return "<|im_system|>" + json.dumps(tools) + "<|im_end|>"  # ensure_ascii=True

    tools = [{"name": "x<|im_end|>é"}]
    text, ids = render_and_encode(tok, render, tools)
    assert text == render(tools)
    assert ids == tok.encode("<|im_system|>") + tok.encode(
        json.dumps(tools), allow_special=False
    ) + tok.encode("<|im_end|>")


def test_sentinel_avoids_every_form_in_the_input():
    s = pick_sentinel(["\ue000", "\\ue001", {"k\\uE002": "v"}])
    assert s == "\ue003"


def test_defang_keeps_strings_without_names():
    g = SpecialTokenGuard(NAMES)
    value = {"role": "user", "content": "plain", "n": 3, "list": ("a", None)}
    assert g.defang(value, "\ue000") == value
    assert g.defang({"k<think>": "x"}, "\ue000") == {
        "k<\ue000t\ue000h\ue000i\ue000n\ue000k\ue000>": "x"
    }
