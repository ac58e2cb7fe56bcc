"""Speculative decoding on the fake model (logits a function of the whole history read back from
the paged cache, so a draft slot that is not overwritten shows up as a wrong token): config
parsing, the proposers, greedy output identical to no speculation under every scheduling
variation, the sampled output's distribution equal to the target's, and no leaked page."""

import json
import math
import random

import pytest
import torch

from k2serve.engine.config import EngineConfig
from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.spec_decode.config import SpeculativeConfig
from k2serve.engine.spec_decode.ngram import propose_ngram
from k2serve.engine.spec_decode.suffix import SuffixDecoder, SuffixTrie

from .conftest import make_fake_engine, run_to_completion
from .fakes import VOCAB, reference_greedy, reference_logits

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


# ---- config --------------------------------------------------------------------------------
def test_config_parses_vllm_json(tmp_path):
    c = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 3, 1, 3)  # fmt: skip
    assert (
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max
        == 5
    )
    s = SpeculativeConfig.parse(
        {
            "method": "suffix",
            "num_speculative_tokens": 8,
            "max_tree_depth": 12,
            "max_cached_requests": 3,
            "disable_by_batch_size": 4,
        }  # fmt: skip
    )
    assert s.suffix_decoding_max_tree_depth == 12 and s.suffix_decoding_max_cached_requests == 3
    (tmp_path / "config.json").write_text("{}")
    e = SpeculativeConfig.parse({"model": str(tmp_path), "num_speculative_tokens": 3})
    assert e.method == "eagle3"
    assert EngineConfig(speculative_config=json.dumps(NGRAM)).speculative_config.method == "ngram"


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown key"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),  # fmt: skip
        ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
        ({"method": "eagle3", "model": "/nonexistent/draft", "num_speculative_tokens": 2}, "draft"),
        ({"method": "suffix", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable"),
        ("{not json", "JSON"),
    ],
)
def test_bad_config_is_a_clear_error(bad, why):
    with pytest.raises(ValueError, match=why):
        EngineConfig(speculative_config=bad)


# ---- proposers -----------------------------------------------------------------------------
def test_ngram_longest_then_earliest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 1, 3, 2) == [4, 1]
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 1, 3, 9) == [4, 1, 2, 3]
    assert propose_ngram([5, 6, 7, 9, 6, 7, 8, 6, 7], 2, 2, 1) == [9]  # earliest "6 7"
    assert propose_ngram([1, 2, 3, 4, 5], 1, 3, 3) == []
    assert propose_ngram([3, 1, 2, 3], 2, 3, 3) == []  # no 2-gram match, min_n = 2


def test_suffix_trie_counts_and_removal_bound_memory():
    t = SuffixTrie(4)
    t.add([1, 2, 3, 1, 2, 4])
    node, m = t.match([9, 1, 2])
    assert m == 2 and {k: c.count for k, c in node.children.items()} == {3: 1, 4: 1}
    t.add([1, 2, 4])
    assert t.speculate(t.match([1, 2])[0], 5, 0.0)[0][0] == 4
    t.remove([1, 2, 4])
    t.remove([1, 2, 3, 1, 2, 4])
    assert t.root.children == {} and t.num_nodes == 0


def test_suffix_decoder_uses_own_context_and_recent_outputs():
    d = SuffixDecoder(8, 2, 1.0, 0.0, 0.1)
    prompt = [10, 11, 12, 13, 14, 10, 11]
    assert d.propose("a", prompt, 3) == [12, 13]  # match "10 11" (2 tokens): at most 2
    d.finish("a", [20, 21, 22, 23, 24])
    assert d.propose("b", [7, 20, 21, 22], 4) == [23, 24]  # from the global cache
    d.finish("b", [30])
    d.finish("c", [31])  # evicts a's output (max 2 cached)
    assert d.propose("d", [20, 21, 22], 4) == []


# ---- exactness on the fake model -------------------------------------------------------------
def oracle_drafter(engine, wrong_every: int = 6):
    """Drafts from the target's own greedy continuation with every `wrong_every`-th draft token
    corrupted, so drafts of every acceptance length occur."""
    count = iter(range(10**9))

    def propose(req, k):
        good = reference_greedy(req.all_token_ids, k, eos=False)
        return [(t + 1) % VOCAB if next(count) % wrong_every == 0 else t for t in good]

    engine.drafter.proposer.propose = propose


def prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def generate(engine, ps, params, stagger=False):
    done = {}
    pending = list(enumerate(ps))
    if not stagger:
        for i, p in pending:
            engine.add_request(str(i), p, params)
        pending = []
    while engine.has_unfinished_requests() or pending:
        if pending:  # continuous batching: one new request per step
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.request_id in done:
                done[out.request_id].merge(out)
            else:
                done[out.request_id] = out
        engine.check_integrity()
    assert engine.kv.pool.num_used_pages == 0
    return [done[str(i)] for i in range(len(ps))]


@pytest.mark.parametrize(
    "overrides, stagger",
    [
        ({}, False),
        ({"max_num_batched_tokens": 7}, True),  # chunked prefill, budget cuts drafts
        ({"enable_prefix_caching": False}, True),
        ({"num_kv_pages": 14, "max_model_len": 48}, False),  # preemption
    ],
)
@pytest.mark.parametrize("method", ["oracle", "ngram", "suffix", "oracle-flat"])
def test_greedy_identical_to_no_speculation(overrides, stagger, method):
    spec = dict(NGRAM, num_speculative_tokens=4)
    if method == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": 4}
    eng = make_fake_engine(speculative_config=spec, **overrides)
    if method.endswith("-flat"):  # verify tokens as one-token sequences (the CUDA layout)
        eng.runner.flatten_verify = True
        method = "oracle"
    if method == "oracle":
        oracle_drafter(eng)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, logprobs=2)
    ps = prompts() + [[5, 6, 7, 5, 6, 7, 5, 6]]
    got = generate(eng, ps, params, stagger)
    ref = generate(make_fake_engine(**overrides), ps, params, stagger)
    for g, r, p in zip(got, ref, ps, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids == reference_greedy(p, 17, False)
        assert len(g.outputs[0].logprobs) == 17
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5) for t in a)
        assert math.isclose(g.outputs[0].cumulative_logprob, r.outputs[0].cumulative_logprob,
                            abs_tol=1e-4)  # fmt: skip
    st = eng.drafter.stats
    if method == "oracle":
        assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens
        assert st.num_accepted_tokens_per_pos[3] > 0  # some drafts fully accepted


def _ban_after_repeat(output_token_ids, logits):
    """A history-dependent logits processor: the last output token is banned."""
    if output_token_ids:
        logits = logits.clone()
        logits[output_token_ids[-1]] = float("-inf")
    return logits


def test_stops_max_tokens_n_and_eos_through_verified_tokens():
    """EOS, stop tokens, stop strings and max_tokens met in the middle of a verified run end the
    request exactly where they would without drafts."""
    ps = prompts(6, seed=1)
    runs = []
    for spec in (NGRAM, None):
        eng = make_fake_engine(speculative_config=spec)
        if spec:
            oracle_drafter(eng, wrong_every=7)
        outs = []
        for params in (
            SamplingParams(temperature=0, max_tokens=13),  # EOS ends some
            SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, stop=["ab", "qq"]),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, stop_token_ids=[5, 9]),
            SamplingParams(temperature=0, max_tokens=7, n=3, ignore_eos=True),
            # history-dependent logits: each verify row sees its own drafts as history
            SamplingParams(temperature=0, max_tokens=13, min_tokens=9),
            SamplingParams(
                temperature=0,
                max_tokens=12,
                ignore_eos=True,
                frequency_penalty=1.5,
                repetition_penalty=1.3,
                presence_penalty=0.5,
            ),  # fmt: skip
            SamplingParams(
                temperature=0, max_tokens=10, ignore_eos=True, logits_processors=[_ban_after_repeat]
            ),  # fmt: skip
        ):
            outs.append([[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                         for o in generate(eng, ps, params)])  # fmt: skip
        runs.append(outs)
    assert runs[0] == runs[1]


def test_opt_out_and_disable_by_batch_size():
    eng = make_fake_engine(speculative_config=dict(NGRAM, disable_by_batch_size=2))
    oracle_drafter(eng, wrong_every=10**9)
    off = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, speculative_decoding=False)
    generate(eng, prompts(2), off)
    assert eng.drafter.stats.num_drafts == 0
    generate(eng, prompts(3), off.clone(speculative_decoding=True))  # 3 running > 2: off
    assert eng.drafter.stats.num_drafts == 0
    generate(eng, prompts(2), off.clone(speculative_decoding=True))
    assert eng.drafter.stats.num_drafts > 0


def test_abort_mid_verification_frees_everything():
    eng = make_fake_engine(speculative_config=NGRAM)
    oracle_drafter(eng)
    for i, p in enumerate(prompts(4)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert any(r.spec_token_ids for r in eng.scheduler.running)
    eng.abort_request(["0", "1", "2", "3"])
    run_to_completion(eng)
    assert all(not r.spec_token_ids for r in eng._requests.values())


# ---- the sampled distribution is the target's ------------------------------------------------
def _exact_marginals(prompt, temperature):
    """Exact distribution of output tokens 2 and 3 (after the first, sampled at prefill)."""

    def probs(toks):
        return torch.softmax(reference_logits(toks) / temperature, dim=-1)

    p1 = probs(prompt)
    p2 = torch.zeros(VOCAB)
    p3 = torch.zeros(VOCAB)
    for a in range(VOCAB):
        pa = probs(prompt + [a])
        p2 += p1[a] * pa
        for b in torch.nonzero(p1[a] * pa > 1e-6).flatten().tolist():
            p3 += p1[a] * pa[b] * probs(prompt + [a, b])
    return p2, p3


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([exp[big], exp[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    dof = int(big.sum())  # bins - 1
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("drafts", ["oracle", "constant"])
def test_sampled_output_has_the_target_distribution(drafts):
    temperature = 0.7
    prompt = [3, 14, 15, 9, 26]
    eng = make_fake_engine(speculative_config=NGRAM, max_num_seqs=512, num_kv_pages=2048,
                           max_num_batched_tokens=4096)  # fmt: skip
    if drafts == "oracle":
        oracle_drafter(eng, wrong_every=5)
    else:  # drafts the target rarely agrees with
        eng.drafter.proposer.propose = lambda req, k: [7, 7, 7][:k]
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True, n=500)
    outs = generate(eng, [prompt] * 8, params)
    toks = torch.tensor([c.token_ids for o in outs for c in o.outputs])  # [4000, 3]
    st = eng.drafter.stats
    assert st.num_drafts > 3000 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    p2, p3 = _exact_marginals(prompt, temperature)
    for col, p in ((1, p2), (2, p3)):
        counts = torch.bincount(toks[:, col], minlength=VOCAB).float()
        assert _chi2_pvalue(counts, p) > 1e-4, col
    # the test can fail: the first-token distribution under a wrong temperature is rejected
    p1_wrong = torch.softmax(reference_logits(prompt) / 1.5, dim=-1)
    assert _chi2_pvalue(torch.bincount(toks[:, 0], minlength=VOCAB).float(), p1_wrong) < 1e-4


def test_cli_flag_and_llm_api(ckpt):
    import argparse

    from k2serve import LLM

    ap = argparse.ArgumentParser()
    EngineConfig.add_cli_args(ap)
    args = ap.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert EngineConfig.from_cli_args(args).speculative_config.prompt_lookup_max == 3
    spec = {"method": "suffix", "num_speculative_tokens": 3}
    with LLM(ckpt, device="cpu", dtype="float32", num_kv_pages=64, max_model_len=128,
             speculative_config=spec) as llm:  # fmt: skip
        out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=9))
        assert len(out[0].outputs[0].token_ids) == 9
        assert llm.llm_engine.drafter.spec.method == "suffix"


def test_acceptance_length_log_line(caplog):
    import logging

    eng = make_fake_engine(speculative_config=NGRAM)
    oracle_drafter(eng)
    eng.drafter._logged = (0.0, 0, 0, 0)  # the last line long ago
    with caplog.at_level(logging.INFO, logger="k2serve.engine.spec_decode.drafter"):
        generate(eng, prompts(3), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding metrics" in r.getMessage()]
    assert lines and "Mean acceptance length: " in lines[0]
    assert "Per-position acceptance rate" in lines[0]
