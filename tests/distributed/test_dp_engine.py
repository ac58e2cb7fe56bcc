"""Data-parallel attention engines with expert-parallel MoE (2 ranks over gloo, CPU): greedy
output identical to one process, with EPLB rebalancing (weights moved between the ranks) in the
middle of the run, requests spread over both ranks, no page leaked."""

import pytest

from k2serve.engine.llm import LLM
from k2serve.engine.sampling_params import SamplingParams

PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4", "Kimi is", "a b"]
COMMON = dict(device="cpu", dtype="float32", kv_cache_memory="8MiB", max_num_seqs=4)


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with LLM(**COMMON) as llm:
        return _greedy(llm)


def test_dp2_greedy_equals_one_process_with_eplb_midrun(reference):
    eplb = {"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}
    with LLM(data_parallel_size=2, enable_eplb=True, eplb_config=eplb, **COMMON) as llm:
        eng = llm.llm_engine
        got = _greedy(llm)
        status = eng.eplb_status()
        eng.check_integrity()
        stats = eng._stats
    assert got == reference
    for r, (n, imb, held) in enumerate(status):
        assert n >= 2, f"rank {r} rebalanced {n} times"
        print(
            f"rank {r}: {n} rebalances, last imbalance {imb[0]:.3f} -> {imb[1]:.3f}, experts {held}"
        )
    # both engines served requests (the front end spreads them by load)
    assert all(s.num_finished > 0 for s in stats)
