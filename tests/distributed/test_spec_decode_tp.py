"""Speculative decoding with tensor_parallel_size=2 (gloo, CPU): n-gram drafts, and EAGLE-3
(the head on rank 0 alone); the verify steps' flat batch goes to the workers like any other,
greedy output equals TP=1 without drafts, and EAGLE-3's drafts equal TP=1's."""

import os
from collections import Counter

import pytest
import torch

from k2serve import LLM, SamplingParams
from k2serve.weights.eagle3 import write_eagle3_checkpoint

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


def _record_drafts(llm) -> dict[str, list[list[int]]]:
    """Every draft the EAGLE-3 proposer makes, by request, in order."""
    eagle = llm.llm_engine.drafter.eagle
    seen: dict[str, list[list[int]]] = {}
    propose = eagle.propose

    def wrapped(want, sched):
        propose(want, sched)
        for r, _ in want:
            if r.spec_token_ids:
                seen.setdefault(r.request_id, []).append(list(r.spec_token_ids))

    eagle.propose = wrapped
    return seen


def _draft_over(path, llm, layout: str, outputs: list[list[int]]) -> str:
    """A random EAGLE-3 head whose draft vocabulary is the 3 tokens `outputs` hold most (so
    that some drafts are accepted; which of them the head drafts is its own choice)."""
    from safetensors.torch import load_file, save_file

    d = str(path)
    write_eagle3_checkpoint(d, llm.llm_engine.model_config, layout, seed=1, draft_vocab_size=3)
    common = Counter(t for out in outputs for t in out).most_common(3)
    keep = torch.tensor(sorted(t for t, _ in common))
    f = os.path.join(d, "model.safetensors")
    tensors = load_file(f)
    tensors["d2t"] = keep - torch.arange(3)
    tensors["t2d"] = torch.zeros_like(tensors["t2d"]).index_fill_(0, keep, True)
    save_file(tensors, f, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("layout", ["llama", "mla"])
def test_tp2_eagle3_greedy_and_drafts_equal_tp1(ckpts, tmp_path, layout):
    """EAGLE-3 at TP=2: the head runs on rank 0 on its (replicated) auxiliary states; greedy
    output equals no speculation at TP=1 and TP=2, and every draft (so the acceptance) equals
    TP=1's with the same head."""
    prompts = [
        [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
        [11, 12, 13, 11, 12],
        [200 + i % 7 for i in range(30)],  # chunked prefill (16-token steps)
    ]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tp1 = LLM(ckpts["bf16"], **ENGINE)
    ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, params)]
    d = _draft_over(tmp_path / f"draft-{layout}", tp1, layout, ref)
    spec = {"method": "eagle3", "model": d, "num_speculative_tokens": 3}
    runs = {}
    for tp in (1, 2):
        llm = LLM(ckpts["bf16"], tensor_parallel_size=tp, speculative_config=spec, **ENGINE)
        try:
            seen = _record_drafts(llm)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            llm.llm_engine.check_integrity()
            st = llm.llm_engine.drafter.stats
        finally:
            if tp == 2:
                llm.llm_engine.runner.shutdown()
        assert got == ref, tp
        assert st.num_drafts > 5 and st.num_accepted_tokens > 0
        runs[tp] = (
            sorted(seen.values()),
            (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens),
            list(st.num_accepted_tokens_per_pos),
        )
    plain = LLM(ckpts["bf16"], tensor_parallel_size=2, **ENGINE)  # speculation off at TP=2
    try:
        assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == ref
    finally:
        plain.llm_engine.runner.shutdown()

    assert runs[2] == runs[1]


def test_tp2_aux_hidden_states_equal_tp1(ckpts, tmp_path):
    """Rank 0's auxiliary hidden states at TP=2 (the residual stream after the all-reduces)
    equal the unsharded model's."""
    prompt = list(range(20, 32))  # one prefill step (< 16 tokens)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    tp1 = LLM(ckpts["bf16"], **ENGINE)
    d = str(tmp_path / "draft")
    write_eagle3_checkpoint(d, tp1.llm_engine.model_config, "llama", seed=1)
    spec = {"method": "eagle3", "model": d, "num_speculative_tokens": 2}
    llm = LLM(ckpts["bf16"], tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        llm.generate([prompt], params)
        model = llm.llm_engine.model
        got = model.aux_hidden_states  # [12, 3 * hidden], rank 0's of the prefill step
        ids = model.aux_hidden_state_layers
    finally:
        llm.llm_engine.runner.shutdown()
    ref_model = tp1.llm_engine.model
    ref_model.aux_hidden_state_layers = ids
    with torch.inference_mode():
        ref_model(torch.tensor(prompt), torch.arange(len(prompt)))  # one causal sequence
    ref = ref_model.aux_hidden_states
    hidden = ref_model.config.hidden_size
    assert got is not None and got.shape == ref.shape == (len(prompt), 3 * hidden)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_tp2_ep_eagle3_trained_demo_draft_acceptance_equals_tp1():
    """The demo model with its trained EAGLE-3 draft (real acceptance): at TP=2 (experts
    placed whole, the INT4 groups do not split in two) the output equals TP=1 without drafts
    and the acceptance equals TP=1's, position by position."""
    from k2serve.demo import demo_eagle3_path, demo_path

    eng = dict(ENGINE, num_kv_pages=128, max_model_len=512)
    msgs = [[{"role": "user", "content": q}] for q in ("What is the weather in Paris?",
                                                       "Tell me a story about a cat.")]  # fmt: skip
    params = SamplingParams(max_tokens=32, temperature=0)
    spec = {"method": "eagle3", "model": str(demo_eagle3_path()), "num_speculative_tokens": 3}
    ref = [o.outputs[0].token_ids for o in LLM(str(demo_path()), **eng).chat(msgs, params)]
    runs = {}
    for tp in (1, 2):
        llm = LLM(str(demo_path()), tensor_parallel_size=tp, enable_expert_parallel=tp > 1,
                  speculative_config=spec, **eng)  # fmt: skip
        try:
            assert [o.outputs[0].token_ids for o in llm.chat(msgs, params)] == ref, tp
            st = llm.llm_engine.drafter.stats
        finally:
            if tp == 2:
                llm.llm_engine.runner.shutdown()
        runs[tp] = (st.num_drafts, st.num_accepted_tokens, list(st.num_accepted_tokens_per_pos))
    assert runs[1][1] > runs[1][0]  # a trained draft: > 1 accepted token per draft on average
    assert runs[2] == runs[1]
