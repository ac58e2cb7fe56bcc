"""`SamplingParams` as a vLLM user builds it: wrong types are ValueErrors that name the field."""

from __future__ import annotations

import pytest

from k2serve import SamplingParams


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"stop": 5}, "stop"),
        ({"stop": [5]}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_wrong_types_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_vllm_spellings_accepted():
    p = SamplingParams(stop="x", stop_token_ids=(3, 4), top_k=-1, max_tokens=4)
    assert p.stop == ["x"] and list(p.stop_token_ids) == [3, 4]
