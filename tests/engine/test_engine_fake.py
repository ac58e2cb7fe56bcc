"""Engine behaviour through the real scheduler, cache manager, runner and sampler, with a fake
model whose logits depend on the whole token history as read from the paged cache."""

import random

import pytest

from k2serve.engine.errors import PromptTooLongError
from k2serve.engine.sampling_params import SamplingParams

from .conftest import run_to_completion
from .fakes import EOS, VOCAB, reference_greedy


def prompts(n, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_batched_greedy_matches_reference_and_one_at_a_time(fake_engine):
    ps = prompts(12, seed=1)
    eng = fake_engine()
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, greedy())
    batched = run_to_completion(eng)
    assert max(eng.model.batch_sizes) > 1  # really batched
    for i, p in enumerate(ps):
        one = fake_engine()
        one.add_request("x", p, greedy())
        alone = run_to_completion(one)["x"].outputs[0].token_ids
        assert batched[str(i)].outputs[0].token_ids == alone == reference_greedy(p, 12)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 1000])
def test_chunked_prefill_matches_unchunked(fake_engine, chunk):
    ps = prompts(6, seed=2, lo=20, hi=60)
    eng = fake_engine(max_num_batched_tokens=chunk, num_kv_pages=200)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, greedy(8))
    out = run_to_completion(eng)
    for i, p in enumerate(ps):
        assert out[str(i)].outputs[0].token_ids == reference_greedy(p, 8)


def test_unchunked_mode_runs_whole_prompts(fake_engine):
    ps = prompts(5, seed=3, lo=10, hi=30)
    eng = fake_engine(enable_chunked_prefill=False, max_num_batched_tokens=256)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, greedy(5))
    out = run_to_completion(eng)
    for i, p in enumerate(ps):
        assert out[str(i)].outputs[0].token_ids == reference_greedy(p, 5)


def test_prefix_cache_hit_equals_miss(fake_engine):
    shared = prompts(1, seed=4, lo=30, hi=30)[0]
    tails = prompts(4, seed=5, lo=1, hi=9)
    eng = fake_engine()
    eng.add_request("first", shared + tails[0], greedy())
    run_to_completion(eng)
    for i, t in enumerate(tails):
        eng.add_request(f"r{i}", shared + t, greedy())
    out = run_to_completion(eng)
    stats = eng.get_stats()
    assert stats.prefix_cache_hits >= 4 * 28  # 7 full pages of 4 shared tokens each
    for i, t in enumerate(tails):
        assert out[f"r{i}"].num_cached_tokens >= 28
        assert out[f"r{i}"].outputs[0].token_ids == reference_greedy(shared + t, 12)
    no_cache = fake_engine(enable_prefix_caching=False)
    no_cache.add_request("m", shared + tails[1], greedy())
    miss = run_to_completion(no_cache)["m"]
    assert miss.num_cached_tokens == 0
    assert miss.outputs[0].token_ids == out["r1"].outputs[0].token_ids


def test_full_prompt_hit_still_computes_last_token(fake_engine):
    p = prompts(1, seed=6, lo=16, hi=16)[0]  # exactly 4 pages
    eng = fake_engine()
    eng.add_request("a", p, greedy(4))
    a = run_to_completion(eng)["a"]
    eng.add_request("b", p, greedy(4))
    b = run_to_completion(eng)["b"]
    assert b.num_cached_tokens == 12
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == reference_greedy(p, 4)


def test_preemption_under_tiny_cache_gives_same_tokens(fake_engine):
    ps = prompts(8, seed=7, lo=5, hi=20)
    eng = fake_engine(num_kv_pages=14, page_size=4, max_model_len=52)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, greedy(30, ignore_eos=True))
    out = run_to_completion(eng)
    assert eng.get_stats().num_preemptions > 0
    for i, p in enumerate(ps):
        assert out[str(i)].outputs[0].token_ids == reference_greedy(p, 30, eos=False)


def test_eos_and_stop_token_and_length(fake_engine):
    eng = fake_engine()
    # find a prompt whose greedy continuation hits EOS within 64 tokens
    rng = random.Random(8)
    while True:
        p = [rng.randrange(1, VOCAB) for _ in range(5)]
        ref = reference_greedy(p, 64)
        if ref[-1] == EOS and len(ref) > 2:
            break
    eng.add_request("eos", p, greedy(64))
    eng.add_request("ign", p, greedy(len(ref) + 3, ignore_eos=True))
    eng.add_request("stoptok", p, greedy(64, stop_token_ids=[ref[1]]))
    out = run_to_completion(eng)
    assert out["eos"].outputs[0].token_ids == ref
    assert out["eos"].outputs[0].finish_reason == "stop"
    assert out["eos"].outputs[0].stop_reason is None
    assert out["ign"].outputs[0].finish_reason == "length"
    assert len(out["ign"].outputs[0].token_ids) == len(ref) + 3
    st = out["stoptok"].outputs[0]
    assert st.token_ids == ref[: ref.index(ref[1]) + 1]
    assert st.finish_reason == "stop" and st.stop_reason == ref[1]


def test_min_tokens_suppresses_eos(fake_engine):
    rng = random.Random(9)
    while True:
        p = [rng.randrange(1, VOCAB) for _ in range(5)]
        ref = reference_greedy(p, 64)
        if ref[-1] == EOS and len(ref) < 20:
            break
    eng = fake_engine()
    eng.add_request("m", p, greedy(40, min_tokens=len(ref) + 2))
    out = run_to_completion(eng)["m"].outputs[0]
    assert len(out.token_ids) >= len(ref) + 2
    assert EOS not in out.token_ids[: len(ref) + 2]
    assert out.token_ids[: len(ref) - 1] == ref[:-1]


def test_stop_string_spanning_tokens(fake_engine):
    from .fakes import FakeTokenizer

    tok = FakeTokenizer()
    p = prompts(1, seed=10, lo=6, hi=6)[0]
    ref = reference_greedy(p, 20, eos=False)
    text = tok.decode(ref, skip_special_tokens=True)
    # a stop string that starts in the middle of token 3 and ends inside token 5
    stop = text[7:10] if EOS not in ref[:6] else None
    if stop is None:
        pytest.skip("unlucky prompt")
    for include in (False, True):
        eng = fake_engine()
        eng.add_request(
            "s",
            p,
            greedy(20, ignore_eos=True, stop=[stop, "zzzzzz"], include_stop_str_in_output=include),
        )
        deltas = []
        while eng.has_unfinished_requests():
            deltas += eng.step()
        o = deltas[-1].outputs[0]
        full = "".join(d.outputs[0].text for d in deltas)
        j = text.find(stop)
        assert full == (text[: j + len(stop)] if include else text[:j])
        assert o.finish_reason == "stop" and o.stop_reason == stop
        # the token that completed the stop string is the last one returned
        assert sum(len(d.outputs[0].token_ids) for d in deltas) == (j + len(stop) + 1) // 2
        eng.check_integrity()


def test_abort_frees_pages_at_any_moment(fake_engine):
    ps = prompts(6, seed=11, lo=10, hi=30)
    for abort_at in range(0, 12, 3):
        eng = fake_engine(max_num_batched_tokens=16)
        for i, p in enumerate(ps):
            eng.add_request(str(i), p, greedy(20, ignore_eos=True))
        early = [o for _ in range(abort_at) for o in eng.step()]
        eng.abort_request(["1", "4"])
        eng.abort_request("not-there")
        eng.check_integrity()
        out = run_to_completion(eng)
        for o in reversed(early):  # prepend what the first steps returned
            if o.request_id in out:
                o.merge(out[o.request_id])
            out[o.request_id] = o
        for i in (1, 4):
            assert out[str(i)].finished and out[str(i)].outputs[0].finish_reason == "abort"
        for i in (0, 2, 3, 5):
            assert out[str(i)].outputs[0].token_ids == reference_greedy(ps[i], 20, eos=False)
        assert eng.kv.pool.num_used_pages == 0


def test_n_samples_and_seeded_reproducible_across_batches(fake_engine):
    p = prompts(1, seed=12)[0]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=15, n=3, ignore_eos=True)
    eng = fake_engine()
    eng.add_request("alone", p, params)
    alone = run_to_completion(eng)["alone"]
    assert [o.index for o in alone.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1  # different samples
    eng2 = fake_engine(max_num_batched_tokens=7)
    others = prompts(5, seed=13)
    for i, q in enumerate(others[:3]):
        eng2.add_request(f"o{i}", q, SamplingParams(temperature=0.8, max_tokens=9))
    eng2.add_request("crowd", p, params)
    for i, q in enumerate(others[3:]):
        eng2.add_request(f"p{i}", q, SamplingParams(temperature=1.2, seed=i, max_tokens=20))
    crowd = run_to_completion(eng2)["crowd"]
    assert [o.token_ids for o in crowd.outputs] == [o.token_ids for o in alone.outputs]


def test_prompt_too_long_error_gives_numbers(fake_engine):
    eng = fake_engine(max_model_len=50)
    with pytest.raises(PromptTooLongError, match=r"prompt \(40 tokens\) \+ max_tokens \(20\)"):
        eng.add_request("a", [1] * 40, SamplingParams(max_tokens=20))
    with pytest.raises(PromptTooLongError, match="50"):
        eng.add_request("b", [1] * 50, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("c", [VOCAB + 5], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("d", [], SamplingParams())
    unchunked = fake_engine(
        enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=None
    )
    with pytest.raises(PromptTooLongError, match="max_num_batched_tokens=16"):
        unchunked.add_request("f", [1] * 17, SamplingParams())
    eng.add_request("e", [1] * 40, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    out = run_to_completion(eng)["e"].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_logprobs(fake_engine):
    p = prompts(1, seed=14)[0]
    eng = fake_engine()
    eng.add_request("g", p, greedy(5, logprobs=3, ignore_eos=True))
    o = run_to_completion(eng)["g"].outputs[0]
    assert len(o.logprobs) == 5
    for tok, entry in zip(o.token_ids, o.logprobs, strict=True):
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
    assert o.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs, strict=True))
    )


def test_preempted_seeded_requests_continue_their_random_stream(fake_engine):
    ps = prompts(6, seed=15, lo=5, hi=15)
    params = [
        SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=25, ignore_eos=True)
        for i in range(6)
    ]

    def run(**cfg):
        eng = fake_engine(**cfg)
        for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
            eng.add_request(str(i), p, sp)
        out = run_to_completion(eng)
        return [out[str(i)].outputs[0].token_ids for i in range(6)], eng.get_stats()

    roomy, s1 = run()
    tight, s2 = run(num_kv_pages=12, max_model_len=44)
    assert s1.num_preemptions == 0 and s2.num_preemptions > 0
    assert tight == roomy


def test_cache_salt_separates_prefix_caches(fake_engine):
    p = prompts(1, seed=16, lo=21, hi=21)[0]
    eng = fake_engine()

    def cached(rid, salt):
        eng.add_request(rid, p, greedy(3), cache_salt=salt)
        out = run_to_completion(eng)[rid]
        assert out.outputs[0].token_ids == reference_greedy(p, 3)
        return out.num_cached_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("b1", "tenant-b") == 0  # same tokens, other salt: no hit
    assert cached("a2", "tenant-a") == 20
    assert cached("n1", None) == 0
