"""The whole engine with tensor_parallel_size=2 (gloo, CPU): greedy generation equals
tensor_parallel_size=1, a dead or failing worker is a clear error, shutdown stops the workers."""

import os
import signal

import pytest
import torch

from k2serve import LLM, SamplingParams
from k2serve.distributed.workers import WorkerError, WorkerGroup

from . import rank_fns

PROMPTS = [[5, 17, 99, 3, 1000, 42, 7, 8], [11, 12, 13], [200 + i for i in range(30)], [9]]
ENGINE = dict(device="cpu", dtype="float32", num_kv_pages=64, page_size=4, max_model_len=128,
              max_num_batched_tokens=16)  # fmt: skip  # 16: the 30-token prompt is chunked


def _generate(llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, params)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize(("fmt", "ep"), [("bf16", False), ("int4", True)])
def test_llm_tp2_greedy_equals_tp1(ckpts, fmt, ep):
    ref = _generate(LLM(ckpts[fmt], **ENGINE))
    llm = LLM(ckpts[fmt], tensor_parallel_size=2, enable_expert_parallel=ep, **ENGINE)
    try:
        got = _generate(llm)
        llm.llm_engine.check_integrity()
    finally:
        llm.llm_engine.runner.shutdown()
    for r, g in zip(ref, got, strict=True):
        assert g.token_ids == r.token_ids
        assert g.cumulative_logprob == pytest.approx(r.cumulative_logprob, rel=1e-4, abs=1e-4)
    assert len({tuple(r.token_ids) for r in ref}) > 1  # prompts lead to different outputs


def test_dead_worker_is_a_clear_error_and_shutdown_stops_workers(ckpts):
    llm = LLM(ckpts["bf16"], tensor_parallel_size=2, **ENGINE)
    group = llm.llm_engine.runner.group
    try:
        assert _generate(llm)[0].token_ids
        os.kill(group._procs[0].pid, signal.SIGKILL)
        group._procs[0].join(5)
        with pytest.raises(WorkerError, match="worker rank 1"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    finally:
        llm.llm_engine.runner.shutdown()
    assert not torch.distributed.is_initialized()


def test_worker_exception_is_reported_with_its_traceback():
    g = WorkerGroup(2, "cpu")
    try:
        assert g.run(rank_fns.echo_rank) == [0, 1]
        with pytest.raises(WorkerError, match="rank 1") as e:
            g.run(rank_fns.fail_on_worker, "boom in the worker")
        assert "RuntimeError: boom in the worker" in str(e.value)  # the worker's traceback
        assert not g.alive
        with pytest.raises(WorkerError, match="rank 1"):
            g.run(rank_fns.echo_rank)  # the group stays failed
    finally:
        g.shutdown()
    assert all(p.exitcode is not None for p in g._procs)
    assert not torch.distributed.is_initialized()


def test_tp_needs_the_engine_to_load_the_shards(ckpts):
    """An injected (unsharded) model cannot be spread over ranks: a clear error, no spawn."""
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine
    from k2serve.weights.loader import load_model

    model = load_model(ckpts["bf16"], dtype=torch.float32, progress=False)
    cfg = EngineConfig(tensor_parallel_size=2, num_kv_pages=8, max_model_len=32, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs rank 0's shard"):
        LLMEngine(cfg, model=model)
    assert not torch.distributed.is_initialized()


def test_tp2_host_kv_tier_copies_on_every_rank(ckpts, monkeypatch):
    """TP=2 with a host KV tier (forced on the CPU) and a device pool of 10 pages of 4 tokens
    under sessions sharing 24 tokens: outputs equal TP=1 without the tier, and the worker rank
    moved the same bytes into the same host pages as rank 0."""
    monkeypatch.setenv("K2SERVE_KV_HOST_TIER_ON_CPU", "1")
    shared = [300 + i for i in range(24)]
    sessions = [shared + [7 * i + j for j in range(1, 6)] for i in range(4)]
    filler = [[900 + 36 * i + j for j in range(36)] for i in range(2)]  # evicts the device pool
    turns = [sessions, filler, sessions]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    small = dict(ENGINE, num_kv_pages=10, max_model_len=40)

    def run(llm):
        return [[o.outputs[0].token_ids for o in llm.generate(t, params)] for t in turns]

    ref = run(LLM(ckpts["bf16"], **small))
    llm = LLM(ckpts["bf16"], tensor_parallel_size=2, kv_offloading_size=1 / 2**10, **small)
    llm.llm_engine.kv.host.immediate_bytes = 0  # restored requests wait for their copy
    try:
        got = run(llm)
        eng = llm.llm_engine
        eng.check_integrity()
        host = eng.kv.host.pool
        held = [p for p in range(host.num_pages) if host.page_hash[p] or host.ref_count[p]]
        r0, r1 = eng.runner.group.run(rank_fns.kv_tier_state, held)
    finally:
        llm.llm_engine.runner.shutdown()
    assert got == ref
    assert eng.get_stats().host_cache_hits > 0
    assert r0["bytes_h2d"] > 0 and r0 == r1
