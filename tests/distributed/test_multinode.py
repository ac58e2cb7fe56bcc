"""Several processes on this machine acting as nodes over gloo (CPU): `--nnodes 2`.

Node 0 is either an in-process LLM or a `k2serve serve` subprocess; the other node is always a
`k2serve serve --headless` subprocess. Checked: greedy output equals one process; a node that
never joins, a rank that dies, a node that goes silent (SIGSTOP) or a lost node 0 each end in a
clear message and an exit within a bound, never a hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from k2serve import LLM, SamplingParams
from k2serve.distributed.nodes import NodeSpec
from k2serve.distributed.workers import WorkerError

PROMPTS = [[5, 17, 99, 3, 1000, 42, 7, 8], [11, 12, 13], [200 + i for i in range(30)], [9]]
ENGINE = dict(device="cpu", dtype="float32", num_kv_pages=64, page_size=4, max_model_len=128,
              max_num_batched_tokens=16)  # fmt: skip
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (node 0 listens on both)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.abspath(SRC))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _k2serve(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "k2serve.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or _env(),
    )


def _headless(port: int, tp: int = 2, *extra, env=None) -> subprocess.Popen:
    return _k2serve("--headless", "--device", "cpu", "-tp", str(tp), "--nnodes", "2",
                    "--node-rank", "1", "--master-port", str(port), *extra, env=env)  # fmt: skip


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _rank_pids(p: subprocess.Popen, timeout_s: float = 60.0) -> list[int]:
    """The rank pids a headless node logs when it starts them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if "(pids " in line:
            return [int(x) for x in line.split("(pids ")[1].split(")")[0].split()]
        if not line and p.poll() is not None:
            break
    raise AssertionError("the headless node did not log its ranks")


def _outputs(llm) -> list:
    return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]


# ---- in-process node 0 -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fmt", "tp", "ep", "kill"),
    [("bf16", 2, False, False), pytest.param("int4", 4, True, True, marks=pytest.mark.slow)],
)
def test_two_nodes_greedy_equals_one_process(ckpts, fmt, tp, ep, kill):
    """TP over two 'nodes' (tp=4: two ranks each, local pipes and remote sockets mixed). With
    `kill`: a remote rank killed while idle breaks the group's health (what /health reports)
    within the bound, and the next step is a WorkerError naming it."""
    ref = _outputs(LLM(ckpts[fmt], **ENGINE))
    port = _free_port_pair()
    extra = ["--enable-expert-parallel"] if ep else []
    node1 = _headless(port, tp, *extra, env=_env(K2SERVE_DIST_SECRET="s3cret"))
    os.environ["K2SERVE_DIST_SECRET"] = "s3cret"
    try:
        pids = _rank_pids(node1)
        llm = LLM(ckpts[fmt], tensor_parallel_size=tp, enable_expert_parallel=ep, nnodes=2,
                  master_port=port, dist_join_timeout=120, **ENGINE)  # fmt: skip
        try:
            got = _outputs(llm)
            llm.llm_engine.check_integrity()
            llm.llm_engine.runner.check_health()
            if kill:
                os.kill(pids[-1], signal.SIGKILL)
                deadline = time.monotonic() + 10
                # the killed rank, or its node-mate that node 1 stops when one of its ranks dies
                with pytest.raises(WorkerError, match="worker rank [23] on node 1 .* is gone"):
                    while time.monotonic() < deadline:
                        llm.llm_engine.runner.check_health()
                        time.sleep(0.1)
                with pytest.raises(WorkerError, match="worker rank [23] on node 1"):
                    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        finally:
            llm.close()
        assert node1.wait(30) == (1 if kill else 0)  # node 0's shutdown stops node 1 cleanly
    finally:
        os.environ.pop("K2SERVE_DIST_SECRET", None)
        _stop(node1)
    for r, g in zip(ref, got, strict=True):
        assert g.token_ids == r.token_ids
        assert g.cumulative_logprob == pytest.approx(r.cumulative_logprob, rel=1e-4, abs=1e-4)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_a_late_node_does_not_time_out_the_early_ones(ckpts, monkeypatch):
    """Four nodes of one rank; node 3 starts after more than a heartbeat timeout: the nodes
    already connected keep waiting (heartbeats start when all joined), output is exact."""
    ref = _outputs(LLM(ckpts["bf16"], **ENGINE))
    port = _free_port_pair()
    monkeypatch.setenv("K2SERVE_HEARTBEAT_TIMEOUT_S", "2")
    env = _env(K2SERVE_HEARTBEAT_TIMEOUT_S=2, K2SERVE_HEARTBEAT_INTERVAL_S=0.5)

    def node(rank):
        return _k2serve("--headless", "--device", "cpu", "-tp", "4", "--nnodes", "4",
                        "--node-rank", str(rank), "--master-port", str(port), env=env)  # fmt: skip

    early = [node(1), node(2)]
    late = []
    llm = None
    result = {}

    def start_engine():
        result["llm"] = LLM(ckpts["bf16"], tensor_parallel_size=4, nnodes=4, master_port=port,
                            dist_join_timeout=120, **ENGINE)  # fmt: skip

    t = threading.Thread(target=start_engine)
    try:
        for p in early:
            _rank_pids(p)
        t.start()
        time.sleep(6)  # > 2 s heartbeat timeout with node 1 and 2 connected
        assert all(p.poll() is None for p in early)
        late.append(node(3))
        t.join(120)
        llm = result["llm"]
        got = _outputs(llm)
    finally:
        if llm is not None:
            llm.close()
        _stop(*early, *late)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]


def test_a_node_that_never_joins_fails_within_the_join_timeout(ckpts):
    port = _free_port_pair()
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"node 1 \(rank 1\) did not join within "
                       r"--dist-join-timeout 2s.*--headless"):  # fmt: skip
        LLM(ckpts["bf16"], tensor_parallel_size=2, nnodes=2, master_port=port,
            dist_join_timeout=2, **ENGINE)  # fmt: skip
    assert time.monotonic() - t0 < 30
    assert not torch.distributed.is_initialized()
    with socket.socket() as s:  # the control port was released
        s.bind(("", port + 1))


@pytest.mark.slow
def test_a_node_with_another_secret_or_layout_is_refused_with_the_reason(ckpts):
    """A wrong secret is refused (node 0 keeps waiting: it may be a stranger); a node with
    another --tensor-parallel-size is rejected and node 0 fails at once, both saying why."""
    port = _free_port_pair()
    errors = []

    def node0():
        try:
            LLM(ckpts["bf16"], tensor_parallel_size=2, nnodes=2, master_port=port,
                dist_join_timeout=60, **ENGINE)  # fmt: skip
        except WorkerError as e:
            errors.append(e)

    t = threading.Thread(target=node0)
    t.start()
    wrong_key = _headless(port, 2, "--dist-join-timeout", "30",
                          env=_env(K2SERVE_DIST_SECRET="other"))  # fmt: skip
    wrong_tp = None
    try:
        out_key = wrong_key.communicate(timeout=40)[0]
        t0 = time.monotonic()
        wrong_tp = _headless(port, 4, "--dist-join-timeout", "30")  # node 0 runs tp=2
        out_tp = wrong_tp.communicate(timeout=40)[0]
        t.join(30)
    finally:
        _stop(wrong_key, *([wrong_tp] if wrong_tp else []))
    assert not t.is_alive() and time.monotonic() - t0 < 30
    assert wrong_key.returncode == 1 and "refused this node's K2SERVE_DIST_SECRET" in out_key
    assert wrong_tp.returncode == 1
    why = "runs with tensor_parallel_size=4 but node 0 with 2"
    assert why in out_tp
    assert len(errors) == 1 and why in str(errors[0])
    assert not torch.distributed.is_initialized()


def test_node_layout_errors_name_the_flag(capsys, tmp_path):
    from k2serve.cli import main
    from k2serve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size=3 is not a multiple of nnodes=2"):
        EngineConfig(tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank=2 must be in \[0, nnodes=2\)"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)
    assert NodeSpec(2, 1, "10.0.0.1", 29500, 16).local_ranks() == range(8, 16)
    assert NodeSpec(2, 0, "::1", 29500, 2).init_method == "tcp://[::1]:29500"
    # a worker node needs no --headless (as SGLang), and checks its checkpoint before joining
    worker = ["serve", "--device", "cpu", "-tp", "2", "--nnodes", "2", "--node-rank", "1"]
    assert main([*worker, "--model", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["serve", "--headless", "--device", "cpu"]) == 2
    assert "--nnodes N" in capsys.readouterr().err
    assert main(["serve", "--dist-init-addr", "nohost", "--device", "cpu"]) == 2
    assert "is not HOST:PORT" in capsys.readouterr().err


# ---- node 0 as `k2serve serve` -----------------------------------------------------------------
def _get(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, json.loads(r.read() or b"null")


def _wait_healthy(base: str, node0: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert node0.poll() is None, node0.communicate()[0]
        try:
            if _get(base + "/health")[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.3)
    raise AssertionError("node 0 did not become healthy")


def _serve_two_nodes(hb_timeout: float):
    from k2serve.demo import demo_path

    port, http = _free_port_pair(), _free_port_pair()
    env = _env(K2SERVE_HEARTBEAT_TIMEOUT_S=hb_timeout, K2SERVE_HEARTBEAT_INTERVAL_S=0.5)
    # the demo checkpoint's experts split only whole (INT4 groups): expert parallel
    node0 = _k2serve(str(demo_path()), "--device", "cpu", "-tp", "2", "--enable-expert-parallel",
                     "--dist-init-addr", f"127.0.0.1:{port}", "--nnodes", "2", "--port", str(http),
                     "--max-model-len", "256", env=env)  # fmt: skip
    node1 = _headless(port, 2, "--enable-expert-parallel", env=env)
    return node0, node1, f"http://127.0.0.1:{http}"


def _answer_then_kill_a_worker_rank(node0, node1, base: str):
    """Node 0's completion equals one process's; then SIGKILL node 1's first rank.
    -> (node 1's rank pids, node 0's log, seconds node 0 took to exit)."""
    from k2serve.demo import demo_path

    pids = _rank_pids(node1)
    _wait_healthy(base, node0)
    body = dict(model="kimi-k2-demo", prompt=[5, 17, 99, 3], max_tokens=6, temperature=0)
    status, out = _get(base + "/v1/completions", body)
    assert status == 200
    with LLM(str(demo_path()), device="cpu", max_model_len=256) as one:
        ref = one.generate([[5, 17, 99, 3]], SamplingParams(max_tokens=6, temperature=0))
    assert out["choices"][0]["text"] == ref[0].outputs[0].text
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    log0 = node0.communicate(timeout=20)[0]
    return pids, log0, time.monotonic() - t0


def test_serve_two_nodes_answers_then_exits_when_a_worker_rank_dies():
    node0, node1, base = _serve_two_nodes(hb_timeout=30)
    try:
        pids, log0, took = _answer_then_kill_a_worker_rank(node0, node1, base)
        log1 = node1.communicate(timeout=20)[0]
    finally:
        _stop(node0, node1)
    assert node0.returncode == 1 and took < 10, (took, log0)
    assert "worker rank 1 on node 1" in log0 and f"pid {pids[0]}" in log0 and "exiting" in log0
    assert node1.returncode == 1 and "stopping node 1" in log1


@pytest.mark.slow
def test_serve_exits_when_a_node_goes_silent_and_a_node_exits_when_node_0_is_gone():
    node0, node1, base = _serve_two_nodes(hb_timeout=3)
    try:
        pids = _rank_pids(node1)
        _wait_healthy(base, node0)
        os.kill(pids[0], signal.SIGSTOP)  # alive but silent: only the heartbeat can tell
        t0 = time.monotonic()
        log0 = node0.communicate(timeout=30)[0]
        took = time.monotonic() - t0
    finally:
        os.kill(pids[0], signal.SIGCONT)
        _stop(node0, node1)
    assert node0.returncode == 1 and took < 3 + 5, (took, log0)
    assert "no heartbeat for" in log0 and "worker rank 1 on node 1" in log0

    node0, node1, base = _serve_two_nodes(hb_timeout=3)
    try:
        _rank_pids(node1)
        _wait_healthy(base, node0)
        node0.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        log1 = node1.communicate(timeout=30)[0]
        took = time.monotonic() - t0
    finally:
        _stop(node0, node1)
    assert node1.returncode == 1 and took < 3 + 5, (took, log1)
    assert "lost node 0" in log1
