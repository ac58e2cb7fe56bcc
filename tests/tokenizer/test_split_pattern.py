"""Kimi's pre-tokenization pattern: expected pieces are written by hand from the regex's intent
(spec §4) and checked against both `regex` (V1, an independent engine) and tiktoken's Rust
regex, the one that really runs."""

import itertools

import pytest
import regex
import tiktoken

from k2serve.tokenizer.special import PAT_STR

CASES = [
    # Han runs are their own pieces; the space before them is not glued to them.
    ("你好世界", ["你好世界"]),
    ("Hello 你好world", ["Hello", " ", "你好", "world"]),
    # Latin words take one leading non-letter; contractions stay attached to the word.
    ("I don't think we'll", ["I", " don't", " think", " we'll"]),
    ("don't", ["don't"]),
    ("HELLO World", ["HELLO", " World"]),
    ("It's", ["It's"]),
    # digits in groups of 1-3
    ("12345", ["123", "45"]),
    ("a1234567b", ["a", "123", "456", "7", "b"]),
    # punctuation runs with an optional leading space, trailing newlines absorbed
    ('x = {"a": 1}', ["x", " =", ' {"', "a", '":', " ", "1", "}"]),
    ("end.\n\nNext", ["end", ".\n\n", "Next"]),
    # whitespace: a run keeps its last space for the next word, newlines grouped
    ("a   b", ["a", "  ", " b"]),
    ("a\n\n  b", ["a", "\n\n", " ", " b"]),
    ("tail   ", ["tail", "   "]),
    # accented Latin (\p{M} combining marks included) and Cyrillic
    ("café naïve Привет", ["café", " naïve", " Привет"]),
]


@pytest.mark.parametrize("text,pieces", CASES)
def test_regex_v1_pieces(text, pieces):
    assert regex.findall(PAT_STR, text, flags=regex.V1) == pieces


def test_regex_v0_gotcha():
    # Documented trap: without V1 the `&&` branches never match, so letters get lost.
    assert regex.findall(PAT_STR, "Hello", flags=regex.V0) != ["Hello"]


def _all_substring_encoding(text):
    """A vocab holding every byte substring of `text`: BPE then collapses each
    pre-tokenized piece into exactly one token, so tokens == tiktoken's pieces."""
    data = text.encode("utf-8")
    subs = {data[i:j] for i, j in itertools.combinations(range(len(data) + 1), 2)}
    ranks = {bytes([b]): b for b in range(256)}
    for s in sorted(subs, key=lambda s: (len(s), s)):
        if s not in ranks:
            ranks[s] = len(ranks)
    return tiktoken.Encoding("t", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})


@pytest.mark.parametrize("text,pieces", CASES)
def test_tiktoken_rust_regex_pieces(text, pieces):
    enc = _all_substring_encoding(text)
    got = [enc.decode_single_token_bytes(t).decode("utf-8") for t in enc.encode_ordinary(text)]
    assert got == pieces
