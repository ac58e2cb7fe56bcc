"""Workloads: lengths, range ratio, shared prefixes, ShareGPT and JSONL files, bad input."""

from __future__ import annotations

import json
import math

import pytest

from k2serve.bench.datasets import (
    WORDS,
    DatasetError,
    jsonl_dataset,
    prefix_dataset,
    random_dataset,
    sharegpt_dataset,
)


def test_random_fixed_lengths_and_determinism():
    a = random_dataset(20, input_len=64, output_len=16, seed=5)
    b = random_dataset(20, input_len=64, output_len=16, seed=5)
    c = random_dataset(20, input_len=64, output_len=16, seed=6)
    assert a == b and a != c
    for s in a:
        words = s.prompt.split()
        assert len(words) == s.prompt_len == 64
        assert set(words) <= set(WORDS)
        assert s.output_len == 16
    assert len({s.prompt for s in a}) == 20  # distinct prompts: no accidental prefix sharing


def test_random_range_ratio_is_uniform_over_the_range():
    r, n_in, n_out = 0.5, 100, 40
    samples = random_dataset(2000, n_in, n_out, range_ratio=r, seed=0)
    ins = [len(s.prompt.split()) for s in samples]
    outs = [s.output_len for s in samples]
    assert min(ins) >= 50 and max(ins) <= 150
    assert min(outs) >= 20 and max(outs) <= 60
    assert abs(sum(ins) / len(ins) - 100) < 3  # uniform: centred on the given length
    assert min(ins) <= 52 and max(ins) >= 148  # and reaching both ends


def test_random_prefix_is_shared():
    samples = random_dataset(5, 10, 4, prefix_len=7, seed=0)
    prefixes = {" ".join(s.prompt.split()[:7]) for s in samples}
    assert len(prefixes) == 1
    assert all(s.prompt_len == 17 and len(s.prompt.split()) == 17 for s in samples)


@pytest.mark.parametrize("bad", [1.0, -0.1])
def test_range_ratio_out_of_range_is_rejected(bad):
    with pytest.raises(DatasetError, match="random-range-ratio"):
        random_dataset(3, 10, 4, range_ratio=bad)


@pytest.mark.parametrize("ratio,num_prefixes", [(0.75, 1), (0.5, 3), (0.0, 1), (1.0, 2)])
def test_prefix_share_ratio(ratio, num_prefixes):
    n, plen = 40, 12
    samples = prefix_dataset(n, plen, suffix_len=8, output_len=4, share_ratio=ratio,
                             num_prefixes=num_prefixes, seed=1)  # fmt: skip
    heads = [" ".join(s.prompt.split()[:plen]) for s in samples]
    counts: dict[str, int] = {}
    for h in heads:
        counts[h] = counts.get(h, 0) + 1
    shared = {h for h, c in counts.items() if c > 1}
    assert len(shared) == (num_prefixes if ratio > 0 else 0)
    assert sum(counts[h] for h in shared) == round(ratio * n)
    assert all(len(s.prompt.split()) == plen + 8 == s.prompt_len for s in samples)
    # The suffixes differ, so only the prefix is common.
    assert len({s.prompt for s in samples}) == n


def test_prefix_bad_ratio():
    with pytest.raises(DatasetError, match="prefix-share-ratio"):
        prefix_dataset(4, 8, 4, 4, share_ratio=1.5)


def _sharegpt(tmp_path, jsonl: bool):
    recs = [
        {"conversations": [{"from": "human", "value": "hello there"},
                           {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "system", "value": "be nice"},
                           {"from": "human", "value": "second"},
                           {"from": "gpt", "value": "y" * 8}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]  # fmt: skip
    p = tmp_path / ("sg.jsonl" if jsonl else "sg.json")
    p.write_text("\n".join(json.dumps(r) for r in recs) if jsonl else json.dumps(recs))
    return p


@pytest.mark.parametrize("jsonl", [False, True])
def test_sharegpt_first_human_turn(tmp_path, jsonl):
    samples = sharegpt_dataset(_sharegpt(tmp_path, jsonl), num_prompts=5, seed=0)
    assert len(samples) == 5  # two usable records, cycled
    by_prompt = {s.prompt: s for s in samples}
    assert set(by_prompt) == {"hello there", "second"}
    # max_tokens estimated from the reference reply (~4 chars per token) unless given.
    assert by_prompt["hello there"].output_len == math.ceil(40 / 4)
    assert by_prompt["second"].output_len == 2
    fixed = sharegpt_dataset(_sharegpt(tmp_path, jsonl), num_prompts=2, output_len=33)
    assert {s.output_len for s in fixed} == {33}


def test_jsonl_prompt_and_messages(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text(
        json.dumps({"prompt": "a b c", "max_tokens": 7}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )  # fmt: skip
    s = jsonl_dataset(p, num_prompts=3)
    assert s[0].prompt == "a b c" and s[0].output_len == 7
    assert s[1].prompt == [{"role": "user", "content": "hi"}] and s[1].output_len is None
    assert s[2] == s[0]
    assert {x.output_len for x in jsonl_dataset(p, 2, output_len=3)} == {3}


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"prompt": "ok"}\n{"nope": 1}\n', r"w\.jsonl:2: needs 'prompt'"),
        ('{"prompt": "ok"}\n{not json\n', r"w\.jsonl:2: not valid JSON"),
        ('{"prompt": "ok", "max_tokens": -1}\n', r"w\.jsonl:1: 'max_tokens'"),
        ("", "no usable prompts"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, content, match):
    p = tmp_path / "w.jsonl"
    p.write_text(content)
    with pytest.raises(DatasetError, match=match):
        jsonl_dataset(p, 2)


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="not a file"):
        sharegpt_dataset(tmp_path / "nope.json", 2)
