"""write_tokenizer_files: real-format files of any vocab size that load back."""

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k2serve.tokenizer import KimiTokenizer, write_tokenizer_files

REAL_OFFSETS = {  # spec §4: real id - 163584
    "[BOS]": (0, True),
    "[EOS]": (1, True),
    "<|im_end|>": (2, True),
    "<|im_user|>": (3, True),
    "<|im_assistant|>": (4, True),
    "<|im_system|>": (10, True),
    "<|tool_calls_section_begin|>": (11, False),
    "<|tool_calls_section_end|>": (12, False),
    "<|tool_call_begin|>": (13, False),
    "<|tool_call_argument_begin|>": (14, False),
    "<|tool_call_end|>": (15, False),
    "<|im_middle|>": (17, True),
    "<think>": (22, False),
    "</think>": (23, False),
    "[UNK]": (254, True),
    "[PAD]": (255, True),
}


@pytest.mark.parametrize("vocab_size", [1024, 3001, 163840])
def test_sizes_and_special_ids(tmp_path, vocab_size):
    write_tokenizer_files(tmp_path, vocab_size)
    lines = (tmp_path / "tiktoken.model").read_text().splitlines()
    assert len(lines) == vocab_size - 256
    assert [int(line.split()[1]) for line in lines] == list(range(vocab_size - 256))
    assert base64.b64decode(lines[65].split()[0]) == b"A"
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.vocab_size == vocab_size
    nb = vocab_size - 256
    for name, (k, special) in REAL_OFFSETS.items():
        assert tok.token_to_id(name) == nb + k, name
        assert (nb + k in tok.special_ids) == special, name
    assert tok.id_to_token(nb + 5) == f"<|reserved_token_{nb + 5}|>"
    text = "Hi! What's the weather in Paris?<|im_end|> 你好 2024\n\n  ok"
    assert tok.decode(tok.encode(text)) == text
    if vocab_size == 163840:
        assert tok.bos_token_id == 163584 and tok.token_to_id("<|im_end|>") == 163586


def test_config_json(tmp_path):
    write_tokenizer_files(tmp_path, 1024)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "TikTokenTokenizer"
    assert cfg["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == (
        "[BOS]",
        "[EOS]",
        "[PAD]",
        "[UNK]",
    )
    assert "<|im_end|>" in cfg["additional_special_tokens"]
    assert "<think>" not in cfg["additional_special_tokens"]
    assert cfg["added_tokens_decoder"]["768"] == {
        "content": "[BOS]",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    assert cfg["model_max_length"] > 1e29


def test_deterministic_and_learns_corpus(tmp_path):
    corpus = "the weather in Paris is sunny. " * 50
    write_tokenizer_files(tmp_path / "a", 600, corpus=corpus)
    write_tokenizer_files(tmp_path / "b", 600, corpus=corpus)
    a = (tmp_path / "a" / "tiktoken.model").read_bytes()
    assert a == (tmp_path / "b" / "tiktoken.model").read_bytes()
    tok = KimiTokenizer.from_dir(tmp_path / "a")
    # frequent words become single tokens
    assert len(tok.encode(" weather")) == 1 and len(tok.encode(" Paris")) == 1


def test_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be"):
        write_tokenizer_files(tmp_path, 300)


@settings(max_examples=80, deadline=None)
@given(
    parts=st.lists(
        st.one_of(
            st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
            st.sampled_from(["<|im_end|>", "<think>", " ", "\n", "'s", "1", "天"]),
        ),
        max_size=10,
    )
)
def test_roundtrip_any_text(tok, parts):
    text = "".join(parts)
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, allow_special=False)) == text
    assert all(i < tok.num_base_tokens for i in tok.encode(text, allow_special=False))
