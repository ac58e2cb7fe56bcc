"""--stream-interval (EngineConfig.stream_interval): a request's outputs carry its new tokens
every N tokens, the first token and the end at once; the merged result is the same as with
every token streamed (tokens, text, logprobs, finish reason), for sync and async engines."""

import pytest

from k2serve.engine.config import EngineConfig
from k2serve.engine.sampling_params import SamplingParams

from .conftest import make_fake_engine


def stream(eng, reqs) -> dict:
    """request id -> the list of outputs it got (one per step that had news for it)."""
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    got: dict = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            got.setdefault(out.request_id, []).append(out)
    assert not eng.has_unfinished_requests() and eng.kv.pool.num_used_pages == 0
    return got


def merged(outs):
    first = outs[0]
    for o in outs[1:]:
        first.merge(o)
    c = first.outputs[0]
    lps = None if c.logprobs is None else [sorted(e.items()) for e in c.logprobs]
    return c.token_ids, c.text, c.finish_reason, lps


REQS = [
    ("len", [1, 2, 3], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=1)),
    ("stop", [5, 6], SamplingParams(temperature=0, max_tokens=40, stop=["q"])),
    ("one", [7], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("every", [2, 3, 7])
def test_outputs_come_every_n_tokens_with_the_same_result(every, async_scheduling):
    ref = stream(make_fake_engine(async_scheduling=async_scheduling), REQS)
    eng = make_fake_engine(async_scheduling=async_scheduling, stream_interval=every)
    got = stream(eng, REQS)
    for rid in ref:
        sizes = [len(o.outputs[0].token_ids) for o in got[rid]]  # before merging (in place)
        assert sizes[0] == 1  # the first token at once (TTFT)
        assert all(s >= every for s in sizes[1:-1]), sizes  # then every N
        assert got[rid][-1].finished and not any(o.finished for o in got[rid][:-1])
        if len(ref[rid]) > 2:
            assert len(got[rid]) < len(ref[rid])
        assert merged(got[rid]) == merged(ref[rid]), rid
    eng.shutdown()


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
    assert EngineConfig().stream_interval == 1
