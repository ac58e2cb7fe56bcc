"""Speculative decoding (n-gram drafts) with tensor_parallel_size=2 (gloo, CPU): the verify
steps' flat batch goes to the workers like any other, and greedy output equals TP=1 without
drafts."""

from k2serve import LLM, SamplingParams

from .test_executor import ENGINE


def test_tp2_ngram_greedy_equals_tp1_plain(ckpts):
    prompts = [
        [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
        [11, 12, 13, 11, 12],
        [200 + i % 7 for i in range(30)],
    ]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(ckpts["bf16"], **ENGINE).generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(ckpts["bf16"], tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.llm_engine.check_integrity()
        assert llm.llm_engine.drafter.stats.num_drafts > 0
    finally:
        llm.llm_engine.runner.shutdown()
    assert got == ref
