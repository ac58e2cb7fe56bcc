"""Property test: random workloads (requests, sampling params, aborts, cache sizes, budgets)
through the real scheduler / cache / runner / sampler with the paged fake model. Every step keeps
the cache consistent, every request ends, greedy requests give the oracle's tokens, and no page
is leaked at the end."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2serve.engine.sampling_params import SamplingParams

from .conftest import draw_prompt, drive, engine_configs, make_fake_engine
from .fakes import VOCAB, reference_greedy


@st.composite
def workloads(draw):
    cfg = draw(engine_configs())
    max_model_len = cfg["max_model_len"]
    bases = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12)) for _ in range(2)]
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        prompt = draw_prompt(draw, bases, max_model_len)
        max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
        temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.3]))
        params = SamplingParams(
            n=draw(st.integers(1, 3)),
            temperature=temperature,
            top_p=draw(st.sampled_from([1.0, 0.8])),
            top_k=draw(st.sampled_from([0, 5])),
            min_p=draw(st.sampled_from([0.0, 0.1])),
            seed=draw(st.one_of(st.none(), st.integers(0, 100))),
            max_tokens=max_tokens,
            ignore_eos=draw(st.booleans()),
            stop=draw(st.sampled_from([None, ["ab"], ["q", "zz"]])),
            presence_penalty=draw(st.sampled_from([0.0, 0.5])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.2])),
            logprobs=draw(st.sampled_from([None, 0, 2])),
        )
        arrival = draw(st.integers(0, 10))
        abort_at = draw(st.one_of(st.none(), st.integers(0, 25)))
        reqs.append((prompt, params, arrival, abort_at))
    return cfg, reqs


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_random_workload_keeps_cache_consistent(workload):
    cfg, reqs = workload
    eng = make_fake_engine(**cfg)
    outputs = drive(eng, reqs, max_steps=10_000)
    eng.kv.pool.check_integrity()
    assert set(outputs) == {str(i) for i in range(len(reqs))}
    for i, (prompt, params, _, _) in enumerate(reqs):
        out = outputs[str(i)]
        assert out.finished and len(out.outputs) == params.n
        for o in out.outputs:
            assert o.finish_reason in ("stop", "length", "abort")
            assert len(o.token_ids) <= params.max_tokens
            if o.finish_reason == "length":
                assert len(o.token_ids) == params.max_tokens
            if params.logprobs is not None:
                assert len(o.logprobs) == len(o.token_ids)
            plain = (
                params.greedy
                and not params.stop
                and not params.needs_penalties
                and o.finish_reason != "abort"
            )
            if plain:
                ref = reference_greedy(prompt, params.max_tokens, eos=not params.ignore_eos)
                assert o.token_ids == ref
