"""A headless node (`k2serve serve --headless --node-rank R`): its ranks of a multi-node group.

`run_headless(spec, device, model_dir)` spawns one process per local rank (device
`cuda:<local rank>` or cpu); each connects to node 0 (k2serve.distributed.nodes), joins the
process group and runs node 0's calls until node 0 stops it. The node exits 0 when node 0
shut it down, 1 when any of its ranks failed or lost node 0 (the other ranks are then stopped),
so an orchestrator (Kubernetes, SLURM) sees the failure. No HTTP server runs here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k2serve.distributed.nodes import NodeSpec, _beat, authkey, connect, heartbeat_interval_s
from k2serve.distributed.nodes import heartbeat_timeout_s as _hb_timeout
from k2serve.distributed.workers import POLL_S, WorkerState, serve_calls

logger = logging.getLogger(__name__)


def _die(rank: int, why: str) -> None:
    print(f"k2serve worker rank {rank}: {why}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _heartbeat(rank: int, hb, stopping: threading.Event, where: str) -> None:
    """A headless rank's side of the heartbeat: exit the process when node 0 is gone.

    NOTE: node 0 starts beating once every rank of every node has joined; until its first
    ping only a closed connection counts (a node 0 that vanishes while others still join is
    caught by init_process_group's timeout)."""
    interval, timeout = heartbeat_interval_s(), _hb_timeout()
    last = None
    while not stopping.wait(interval):
        why, got = _beat(hb)
        now = time.monotonic()
        if got:
            last = now
        if why is None and last is not None and now - last > timeout:
            why = f"no heartbeat for {now - last:.0f}s"
        if why is not None:
            if not stopping.is_set():
                _die(rank, f"lost node 0 ({where}): {why}")
            return


def remote_worker_main(
    rank: int, local_rank: int, spec: NodeSpec, device_type: str, model_dir: str | None
) -> None:
    """One rank of a headless node (a spawned process)."""
    parent = os.getppid()
    key = authkey()
    deadline = time.monotonic() + spec.join_timeout_s
    where = "{}:{}".format(*spec.control_address)
    try:
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        conn, welcome = connect(spec, "data", rank, deadline, key)
        hb, _ = connect(spec, "hb", rank, deadline, key)
    except (ConnectionError, TimeoutError, OSError, EOFError) as e:
        _die(rank, str(e))
    backend = welcome["backend"]
    if backend == "nccl" and device.type != "cuda":
        conn.send(("err", f"node 0 uses nccl but rank {rank} runs on {device}"))
        _die(rank, f"node 0 uses nccl but this node runs on {device}: give --device cuda")
    stopping = threading.Event()
    threading.Thread(
        target=_heartbeat, args=(rank, hb, stopping, where), name="k2serve-heartbeat", daemon=True
    ).start()
    try:
        conn.send(("started", None))
        dist.init_process_group(
            backend,
            init_method=spec.init_method,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=welcome["timeout_s"]),
        )
        state = WorkerState(rank, spec.world_size, device)
        if model_dir is not None:
            state.data["model_dir"] = model_dir  # this node's copy of the checkpoint
        conn.send(("ok", None))
    except BaseException:
        try:
            conn.send(("err", traceback.format_exc()))
        finally:
            os._exit(1)

    def driver_alive() -> bool:
        return os.getppid() == parent

    try:
        clean = serve_calls(state, conn, conn, driver_alive)
    finally:
        stopping.set()
    if not clean:
        _die(rank, f"lost node 0 ({where}): its connection closed")
    conn.close()
    hb.close()


def run_headless(spec: NodeSpec, device: str, model_dir: str | None = None) -> int:
    """Run this node's ranks until node 0 stops them. -> exit code (0: node 0 shut down)."""
    if spec.node_rank == 0:
        raise ValueError("--headless is for worker nodes: node 0 (--node-rank 0) serves HTTP")
    device_type = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else (
        "cpu" if device == "auto" else device)).type  # fmt: skip
    n = spec.ranks_per_node
    if device_type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size={spec.world_size} over {spec.nnodes} nodes needs {n} GPUs on "
            f"each node; {torch.cuda.device_count()} visible here"
        )
    ctx = mp.get_context("spawn")
    procs = []
    for local_rank, rank in enumerate(spec.local_ranks()):
        p = ctx.Process(
            target=remote_worker_main,
            args=(rank, local_rank, spec, device_type, model_dir),
            name=f"k2serve-tp-worker-{rank}",
        )
        p.start()
        procs.append(p)
    ranks = spec.local_ranks()
    logger.info(
        "node %d of %d: ranks %d..%d on %s (pids %s), joining node 0 at %s:%d",
        spec.node_rank,
        spec.nnodes,
        ranks[0],
        ranks[-1],
        device_type,
        " ".join(str(p.pid) for p in procs),
        *spec.control_address,
    )
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        logger.info("received %s: stopping this node's ranks", signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(POLL_S):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                p = failed[0]
                logger.error(
                    "rank %s (pid %d) exited with code %d: stopping node %d",
                    p.name.rsplit("-", 1)[-1],
                    p.pid,
                    p.exitcode,
                    spec.node_rank,
                )
                return 1
            if all(p.exitcode == 0 for p in procs):
                logger.info("node 0 shut the group down")
                return 0
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
