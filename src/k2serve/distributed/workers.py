"""WorkerGroup: this process as rank 0 plus world_size - 1 worker ranks: spawned processes on
this node (over pipes) and, in a multi-node group, the other nodes' ranks (over authenticated
sockets, k2serve.distributed.nodes); both are driven through the same peer interface.

Rank 0 calls `run(fn, *args)`: the call (a module-level function, pickled by reference, and its
small arguments) is sent to every worker over its own pipe, then `fn(state, *args)` runs here
too; each rank's `WorkerState` holds what earlier calls left on it (the model, the KV caches).
Collectives inside `fn` go over torch.distributed (the default process group, set up here).

Invariants:
- Only one WorkerGroup per process (it owns the default process group); `shutdown()` (also run
  at garbage collection and interpreter exit) stops the workers and destroys the group.
- Workers wait for calls on a pipe with no timeout and exit when the parent process is gone.
- A worker that raises sends its traceback and exits; a worker that dies or fails makes the next
  (or current) `run` raise `WorkerError` naming its rank, and the group is then unusable.
- Worker devices: `cuda:{local rank}` on CUDA, cpu otherwise.
- Multi-node: a watchdog thread heartbeats every remote rank and watches the local workers; the
  first loss breaks the group and calls `on_failure(message)`; `health()` reads no connection,
  so the server's /health may call it from any thread.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k2serve import envs
from k2serve.distributed.errors import WorkerError
from k2serve.distributed.nodes import ControlServer, NodeSpec, Watchdog

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting side checks that the other is alive


@dataclass
class WorkerState:
    rank: int
    world_size: int
    device: torch.device
    data: dict = field(default_factory=dict)  # what calls leave behind (model, kv_caches)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"distributed_backend='nccl' needs a CUDA device, got {device}")
    return backend


def _worker_main(rank, world_size, backend, init_method, timeout_s, device_type, inbox, outbox):
    parent = os.getppid()
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        outbox.send(("started", None))
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        state = WorkerState(rank, world_size, device)
        outbox.send(("ok", None))
    except BaseException:
        outbox.send(("err", traceback.format_exc()))
        os._exit(1)
    if not serve_calls(state, inbox, outbox, lambda: os.getppid() == parent):
        os._exit(0)  # the engine is gone


def serve_calls(state: WorkerState, inbox, outbox, driver_alive) -> bool:
    """A worker's loop: run the calls from `inbox` until the stop message (None): then leave
    the process group and return True. Returns False at once (no collective) on EOF: the
    driver is gone. Exits the process when `driver_alive()` says nobody will send a call."""
    while True:
        if not inbox.poll(POLL_S):
            if not driver_alive():  # the engine is gone: nobody will send a call
                os._exit(0)
            continue
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return False
        if msg is None:
            break
        fn, args, reply = msg
        try:
            result = fn(state, *args)
            if reply:
                outbox.send(("ok", result))
        except BaseException:
            # NOTE: exit at once (no destroy_process_group): peers blocked in a collective
            # with this rank then fail instead of waiting for it.
            try:
                outbox.send(("err", traceback.format_exc()))
            finally:
                os._exit(1)
    state.data.clear()
    dist.destroy_process_group()
    return True


@dataclass
class _LocalPeer:
    """A worker process on this node, spawned by the group, talked to over two pipes."""

    rank: int
    proc: Any  # multiprocessing Process
    inbox: Any  # Connection we send calls on
    outbox: Any  # Connection we read replies from

    def describe(self) -> str:
        return f"tensor-parallel worker rank {self.rank} (pid {self.proc.pid})"

    def send(self, msg) -> None:
        self.inbox.send(msg)

    def poll(self, timeout_s: float = 0.0) -> bool:
        return self.outbox.poll(timeout_s)

    def recv(self):
        return self.outbox.recv()

    def exit_reason(self) -> str | None:
        code = self.proc.exitcode
        return None if code is None else f"it exited with code {code}"

    def join(self, timeout_s: float) -> None:
        self.proc.join(timeout_s)

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


def _shutdown(peers, watchdog, control, timeout_s: float) -> None:
    if watchdog is not None:
        watchdog.stop()
    for p in peers:
        try:
            p.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout_s
    for p in peers:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in peers:
        proc = getattr(p, "proc", None)
        if proc is None:
            continue
        if proc.is_alive():
            logger.warning("tensor-parallel worker pid %d did not stop; terminating it", proc.pid)
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for p in peers:
        p.close()
    if control is not None:
        control.close()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort while tearing down
            logger.exception("destroy_process_group failed")


class WorkerGroup:
    def __init__(
        self,
        world_size: int,
        device: torch.device | str,
        backend: str = "auto",
        timeout_s: float | None = None,
        start_timeout_s: float | None = None,
        nodes: NodeSpec | None = None,
        on_failure=None,
    ) -> None:
        """Spawn this node's ranks 1..L-1, wait for the other nodes' ranks (with `nodes`, see
        k2serve.distributed.nodes) and join them all in the default process group as rank 0.

        `timeout_s` (K2SERVE_DIST_TIMEOUT_S, default 600): the collectives' timeout.
        `start_timeout_s` (K2SERVE_WORKER_START_TIMEOUT_S, default 300): for workers to start.
        `on_failure(message)`: called once, from the watchdog thread, when a rank on another
        node (or, in a multi-node group, on this one) is lost; the group is then broken.
        """
        if world_size < 2:
            raise ValueError(f"a WorkerGroup needs world_size >= 2, got {world_size}")
        if dist.is_initialized():
            raise WorkerError(
                "torch.distributed is already initialised in this process: only one "
                "tensor-parallel engine per process (shut the other one down first)"
            )
        nodes = nodes if nodes is not None and nodes.nnodes > 1 else None
        if nodes is not None and (nodes.node_rank != 0 or nodes.world_size != world_size):
            raise ValueError(
                f"the engine runs on node 0 with the whole world ({world_size} ranks), got "
                f"node_rank={nodes.node_rank}, world_size={nodes.world_size}"
            )
        local = nodes.ranks_per_node if nodes is not None else world_size
        device = torch.device(device)
        backend = resolve_backend(backend, device)
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {local} GPUs on this node, "
                f"{torch.cuda.device_count()} visible"
            )
        self.world_size = world_size
        self.backend = backend
        self.nodes = nodes
        self.on_failure = on_failure
        self.timeout_s = timeout_s or envs.dist_timeout_s()
        start_timeout = start_timeout_s or envs.worker_start_timeout_s()
        self.state = WorkerState(0, world_size, device)
        self._broken: str | None = None
        self._watchdog = None
        self._control = None
        ctx = mp.get_context("spawn")
        if nodes is not None:
            init_method = nodes.init_method
            # listen before spawning: a bad port fails before anything starts
            self._control = ControlServer(nodes, backend, self.timeout_s)
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._procs: list[Any] = []
        self._peers: list[Any] = []  # _LocalPeer, then (multi-node) RemotePeer
        for rank in range(1, local):
            in_r, in_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, backend, init_method, self.timeout_s, device.type, in_r,
                      out_w),
                name=f"k2serve-tp-worker-{rank}",
                daemon=False,
            )  # fmt: skip
            p.start()
            in_r.close()
            out_w.close()
            self._procs.append(p)
            self._peers.append(_LocalPeer(rank, p, in_w, out_r))
        self._finalizer = weakref.finalize(self, _shutdown, self._peers, None, self._control, 10.0)
        try:
            for i in range(local - 1):
                self._recv(i, start_timeout, expect="started")
            if nodes is not None:
                assert self._control is not None  # made above for multi-node groups
                remote = self._control.accept_all(set(range(local, world_size)), self.check)
                self._peers.extend(remote[r] for r in sorted(remote))
                for i in range(local - 1, world_size - 1):
                    self._recv(i, start_timeout, expect="started")
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=0,
                world_size=world_size,
                timeout=timedelta(seconds=self.timeout_s),
            )
            for i in range(world_size - 1):
                self._recv(i, self.timeout_s)
        except BaseException:
            self.shutdown()
            raise
        if nodes is not None:
            remote_peers = [p for p in self._peers if not isinstance(p, _LocalPeer)]
            self._watchdog = Watchdog(remote_peers, self._procs, self._lost)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(
                self, _shutdown, self._peers, self._watchdog, self._control, 10.0
            )
            logger.info(
                "tensor-parallel group: %d ranks on %d nodes over %s",
                world_size,
                nodes.nnodes,
                backend,
            )
        else:
            logger.info("tensor-parallel group: %d ranks over %s", world_size, backend)

    # ---- calls ---------------------------------------------------------------------------------
    def run(self, fn, *args, reply: bool = True, on_rank0: bool = True) -> list:
        """fn(state, *args) on every rank. Returns [rank 0's result, worker results...]
        (worker results only with `reply`; rank 0's is None when `on_rank0` is False)."""
        self.check()
        try:
            for i, c in enumerate(self._peers):
                try:
                    c.send((fn, args, reply))
                except (BrokenPipeError, ConnectionError, OSError) as e:
                    self._fail(i, f"its connection is closed ({e})")
            r0 = fn(self.state, *args) if on_rank0 else None
        except WorkerError:
            raise
        except Exception as e:
            self._diagnose(e)
            raise
        results = [r0]
        if reply:
            results += [self._recv(i, self.timeout_s) for i in range(len(self._peers))]
        return results

    def check(self) -> None:
        """Raise WorkerError if a worker has died or reported a failure (the engine thread:
        it reads the workers' pending replies)."""
        if self._broken:
            raise WorkerError(self._broken)
        for i, p in enumerate(self._peers):
            if p.poll():
                self._recv(i, self.timeout_s)  # raises on an error report
            why = p.exit_reason()
            if why is not None:
                self._fail(i, why)

    def health(self) -> None:
        """Raise WorkerError if the group is broken or a local worker has exited. Reads no
        connection, so any thread may call it (the server's /health)."""
        if self._broken:
            raise WorkerError(self._broken)
        for p in self._peers:
            why = p.exit_reason()
            if why is not None:
                raise WorkerError(f"{p.describe()} failed: {why}")

    def _lost(self, message: str) -> None:
        """The watchdog saw a rank go: break the group, tell the owner (once)."""
        if self._broken is None:
            self._broken = message
        logger.error("%s", message)
        if self.on_failure is not None:
            self.on_failure(message)

    def _diagnose(self, cause: BaseException) -> None:
        """Rank 0 failed (e.g. a collective broke): blame a dead worker if there is one."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                self.check()
            except WorkerError as e:
                raise e from cause
            time.sleep(0.05)
        self._broken = f"rank 0 failed: {cause!r}"

    def _recv(self, i: int, timeout_s: float, expect: str = "ok"):
        peer = self._peers[i]
        deadline = time.monotonic() + timeout_s
        while True:
            while not peer.poll(POLL_S):
                why = peer.exit_reason()
                if why is not None and not peer.poll():
                    self._fail(i, why)
                if time.monotonic() > deadline:
                    self._fail(i, f"no answer in {timeout_s:g}s")
            try:
                kind, value = peer.recv()
            except (EOFError, OSError):
                self._fail(i, f"its connection closed ({peer.exit_reason() or 'no exit code'})")
            if kind != "ping":
                break
        if kind == "err":
            self._fail(i, f"it raised:\n{value}")
        if kind != expect:
            self._fail(i, f"protocol error: got {kind!r}, expected {expect!r}")
        return value

    def _fail(self, i: int, why: str):
        self._broken = f"{self._peers[i].describe()} failed: {why}"
        raise WorkerError(self._broken)

    # ---- lifetime ------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (join, then terminate), destroy the process group. Idempotent."""
        self.state.data.clear()
        if self._finalizer.alive:
            self._finalizer.detach()
            _shutdown(self._peers, self._watchdog, self._control, timeout_s)

    @property
    def broken(self) -> str | None:
        """Why the group cannot be used any more, or None."""
        return self._broken

    @property
    def alive(self) -> bool:
        return self._broken is None and all(p.exit_reason() is None for p in self._peers)
