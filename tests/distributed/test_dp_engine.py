"""Data-parallel attention engines with expert-parallel MoE (2 ranks over gloo, CPU): greedy
output identical to one process, with EPLB rebalancing (weights moved between the ranks) in the
middle of the run, requests spread over both ranks, no page leaked."""

import pytest

from k2serve.distributed.errors import WorkerError
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


def test_dp_aborts_then_dead_rank_is_detected():
    with LLM(data_parallel_size=2, **COMMON) as llm:
        eng = llm.llm_engine
        sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        for i in range(4):
            eng.add_request(f"r{i}", [5, 6, 7, 8 + i], sp)
        eng.abort_request("r0")  # before it reached its rank
        outs = {o.request_id: o for o in eng.step()}
        assert outs["r0"].finished and outs["r0"].outputs[0].finish_reason == "abort"
        eng.step()
        eng.abort_request(["r1", "r2", "r3"])  # mid-run, on both ranks
        outs = {o.request_id: o for o in eng.step()}
        assert all(outs[r].finished for r in ("r1", "r2", "r3"))
        assert not eng.has_unfinished_requests()
        eng.check_integrity()  # every page came back on every rank
        with pytest.raises(ValueError, match="already in use"):
            eng.add_request("x", [1, 2], sp)
            eng.add_request("x", [1, 2], sp)
        eng.abort_request("x")
        while eng.has_unfinished_requests():
            eng.step()
        proc = eng.group._procs[0]  # rank 1
        proc.kill()
        proc.join(10)
        with pytest.raises(WorkerError, match="rank 1"):
            llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3))


@pytest.mark.slow
def test_dp_two_nodes_of_two_ranks_greedy_equals_one_process(reference, monkeypatch):
    """-dp 4 over two 'nodes' (this process + a `serve --headless` subprocess), EPLB on."""
    from .test_multinode import _env, _free_port_pair, _k2serve, _rank_pids, _stop

    port = _free_port_pair()
    dp = ["--data-parallel-size", "4", "--data-parallel-size-local", "2",
          "--data-parallel-rpc-port", str(port)]  # fmt: skip
    node1 = _k2serve("--headless", "--device", "cpu", *dp, "--data-parallel-start-rank", "2",
                     env=_env(K2SERVE_DIST_SECRET="s3cret"))  # fmt: skip
    monkeypatch.setenv("K2SERVE_DIST_SECRET", "s3cret")
    eplb = {"window_size": 8, "step_interval": 4, "num_redundant_experts": 4}
    try:
        _rank_pids(node1)
        with LLM(data_parallel_size=4, data_parallel_size_local=2, data_parallel_rpc_port=port,
                 enable_eplb=True, eplb_config=eplb, dist_join_timeout=120,
                 **COMMON) as llm:  # fmt: skip
            got = _greedy(llm)
            status = llm.llm_engine.eplb_status()
            llm.llm_engine.check_integrity()
        assert node1.wait(30) == 0
    finally:
        _stop(node1)
    assert got == reference
    assert all(n >= 1 for n, _, _ in status)


@pytest.mark.slow
def test_serve_dp_over_two_nodes_with_deploy_flags_answers_then_exits_when_a_rank_dies():
    """`serve -dp 2 --nnodes 2 ...` (the flags the deploy templates pass), node 1 headless:
    the completion equals one process; a killed rank makes node 0 exit with the reason."""
    from k2serve.demo import demo_path

    from .test_multinode import (
        _answer_then_kill_a_worker_rank,
        _env,
        _free_port_pair,
        _k2serve,
        _stop,
    )

    port, http = _free_port_pair(), _free_port_pair()
    env = _env(K2SERVE_HEARTBEAT_TIMEOUT_S=30, K2SERVE_HEARTBEAT_INTERVAL_S=0.5)
    node0 = _k2serve(str(demo_path()), "--device", "cpu", "-dp", "2", "--nnodes", "2",
                     "--dist-init-addr", f"127.0.0.1:{port}", "--port", str(http),
                     "--max-model-len", "256", "--enable-eplb", "--eplb-config",
                     '{"window_size": 2, "step_interval": 2}', env=env)  # fmt: skip
    node1 = _k2serve("--headless", "--device", "cpu", "-dp", "2", "--nnodes", "2",
                     "--node-rank", "1", "--master-port", str(port), env=env)  # fmt: skip
    base = f"http://127.0.0.1:{http}"
    try:
        _, log0, took = _answer_then_kill_a_worker_rank(node0, node1, base)
    finally:
        _stop(node0, node1)
    assert node0.returncode == 1 and took < 10, (took, log0)
    assert "rank 1" in log0 and "exiting" in log0
