"""IncrementalDetokenizer: deltas never split a UTF-8 character and add up to decode()."""

from hypothesis import given, settings
from hypothesis import strategies as st

from k2serve.tokenizer import IncrementalDetokenizer


def test_han_one_byte_at_a_time(tok):
    text = "天气 in 北京: 晴"
    # force byte tokens so that every Han character spans three ids
    ids = list(text.encode("utf-8"))
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    # the first two bytes of 天 give nothing yet, the third gives the character
    assert deltas[:3] == ["", "", "天"]


def test_skip_special_keeps_markers(tok):
    text = (
        "<think>hi</think>ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )
    ids = tok.encode(text)
    for skip, want in ((True, text.replace("<|im_end|>", "")), (False, text)):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = "".join(detok.add(i) for i in ids) + detok.flush()
        assert out == want


def test_cut_character_at_end_is_replaced(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.add(list("é".encode()[:1])) == ""
    assert detok.flush() == "\ufffd"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_ids_any_chunking(tok, data):
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    skip = data.draw(st.booleans())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out, prev = [], 0
    for c in [*cuts, len(ids)]:
        out.append(detok.add(ids[prev:c]))
        prev = c
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids, skip_special_tokens=skip)
