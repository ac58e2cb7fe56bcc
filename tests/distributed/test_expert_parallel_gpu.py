"""Expert-parallel MoE and data-parallel engines over NCCL (2 GPUs): the same checks as the gloo
tests. Skipped without 2 CUDA devices."""

import pytest
import torch

from k2serve.distributed.workers import WorkerGroup

from . import rank_fns_ep
from .test_expert_parallel import IDS, check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]


def test_ep_moe_over_nccl_equals_single_process(ckpts):
    g = WorkerGroup(2, "cuda")
    try:
        for redundant in (0, 2):
            tokens = [6, 0]
            ids = [IDS[0], []]
            out = g.run(rank_fns_ep.moe_vs_single, ckpts["bf16"], redundant, tokens, ids, "cuda")
            check(out, tokens, ids, 2)
    finally:
        g.shutdown()


def test_dp2_engine_on_two_gpus_greedy_equals_one_gpu():
    from k2serve.engine.llm import LLM
    from k2serve.engine.sampling_params import SamplingParams

    common = dict(device="cuda", dtype="float32", attention_backend="torch", moe_backend="torch",
                  kv_cache_memory="64MiB", max_num_seqs=4)  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello there", "The capital of France is", "1 2 3 4", "Kimi is", "a b"]
    with LLM(enforce_eager=True, **common) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    eplb = {"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}
    with LLM(data_parallel_size=2, enable_eplb=True, eplb_config=eplb, **common) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        assert all(n >= 1 for n, _, _ in llm.llm_engine.eplb_status())
    assert got == ref
