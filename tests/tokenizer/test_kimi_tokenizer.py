"""KimiTokenizer loading and encode/decode, on hand-built files in the real format."""

import base64
import json

import pytest

from k2serve.tokenizer import KimiTokenizer, TokenizerError
from k2serve.tokenizer.kimi import split_whitespaces_or_nonwhitespaces


def _write_dir(path, merges, added):
    """tiktoken.model: the 256 bytes then `merges`; tokenizer_config with `added`."""
    tokens = [bytes([b]) for b in range(256)] + merges
    with open(path / "tiktoken.model", "w") as f:
        for rank, t in enumerate(tokens):
            f.write(f"{base64.b64encode(t).decode()} {rank}\n")
    cfg = {
        "added_tokens_decoder": {
            str(i): {"content": c, "special": s} for i, (c, s) in added.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def small(tmp_path):
    # 259 base tokens -> special ids start at 259.
    added = {
        259: ("[BOS]", True),
        260: ("[EOS]", True),
        261: ("<|im_end|>", True),
        270: ("<|tool_calls_section_begin|>", False),
        281: ("<think>", False),
    }
    _write_dir(tmp_path, [b"aa", b"he", b"hel"], added)
    return KimiTokenizer.from_dir(tmp_path)


def test_ids_and_names(small):
    assert small.num_base_tokens == 259
    assert small.vocab_size == 259 + 256
    assert small.bos_token_id == 259 and small.eos_token_id == 260
    assert small.token_to_id("<|im_end|>") == 261
    assert small.token_to_id("<think>") == 281
    assert small.token_to_id("he") == 257
    assert small.token_to_id("zzz") is None
    # unnamed ids in the special range are reserved tokens, named by their id
    assert small.id_to_token(262) == "<|reserved_token_262|>"
    assert small.id_to_token(259 + 255) == "<|reserved_token_514|>"
    assert small.special_ids == {259, 260, 261}


def test_encode_special_and_plain(small):
    text = "hello<|im_end|><think>"
    ids = small.encode(text)
    assert ids == [258, ord("l"), ord("o"), 261, 281]
    assert small.decode(ids) == text
    # allow_special=False: the names are plain text
    plain = small.encode(text, allow_special=False)
    assert 261 not in plain and 281 not in plain
    assert small.decode(plain) == text
    # only flagged-special tokens are skipped
    assert small.decode(ids, skip_special_tokens=True) == "hello<think>"


def test_reserved_name_is_a_token(small):
    assert small.encode("<|reserved_token_300|>") == [300]


def test_decode_bad_id(small):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        small.decode([10_000])


def test_bad_dirs(tmp_path):
    with pytest.raises(TokenizerError, match="no tiktoken.model"):
        KimiTokenizer.from_dir(tmp_path)
    _write_dir(tmp_path, [], {999: ("[BOS]", True)})
    with pytest.raises(TokenizerError, match="outside the special range"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        KimiTokenizer.from_dir(tmp_path)


def test_split_runs():
    assert [len(p) for p in split_whitespaces_or_nonwhitespaces("a" * 60001, 25000)] == [
        25000,
        25000,
        10001,
    ]
    assert list(split_whitespaces_or_nonwhitespaces("ab  cd", 25000)) == ["ab  cd"]
    assert list(split_whitespaces_or_nonwhitespaces("", 3)) == [""]


def test_encode_cuts_long_runs(small):
    # "b" + 25001 a's is one pre-token. Cut at 25000 characters: "b"+24999 a's | "aa".
    # Uncut, BPE pairs the a's from the left and the lone "a" would come last.
    ids = small.encode("b" + "a" * 25001)
    aa, a = 256, ord("a")
    assert ids[0] == ord("b")
    assert ids[1:12500] == [aa] * 12499
    assert ids[12500:] == [a, aa]


def test_special_token_at_cut_survives(small):
    text = "a" * 24998 + "<|im_end|>" + "a" * 10
    ids = small.encode(text)
    assert 261 in ids and small.decode(ids) == text


def test_chat_template_from_config(tmp_path):
    _write_dir(tmp_path, [], {259: ("[BOS]", True)})
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}!"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert KimiTokenizer.from_dir(tmp_path).chat_template == "{{ messages[0]['content'] }}!"
    (tmp_path / "chat_template.jinja").write_text("file wins")
    assert KimiTokenizer.from_dir(tmp_path).chat_template == "file wins"


def test_encode_cuts_every_400k_chars(small):
    # Words of 12 a's + a space never reach 25k-long runs, but 400000 = 30769 * 13 + 3 cuts
    # word 30770 after 3 a's: "aaa" -> [aa, a] and the other 9 -> [aa]*4 + [a]. Every other
    # word is 6 x "aa", so exactly two lone "a" tokens appear.
    ids = small.encode(("a" * 12 + " ") * 31000)
    assert ids.count(ord("a")) == 2
    assert small.decode(ids) == ("a" * 12 + " ") * 31000
