import pytest

from k2serve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"logits_processors": [3]}, "logits_processors"),
    ],
)
def test_invalid_values_name_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy
    q = p.clone(temperature=0.7)
    assert not q.greedy and p.greedy
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0)
