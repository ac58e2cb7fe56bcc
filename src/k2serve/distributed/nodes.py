"""Several nodes in one tensor-parallel group: node 0 drives, the other nodes are headless.

Layout (vLLM's / SGLang's multi-node TP): `--tensor-parallel-size W --nnodes N` puts W / N ranks
on every node; global rank = node_rank * (W / N) + local rank, device `cuda:<local rank>`.
- Node 0 runs the engine (rank 0) and its local ranks (spawned, over pipes, as on one node), and
  listens on `--master-port + 1` (the control port) for the other nodes' ranks. torch.distributed
  itself rendezvouses at `--master-addr:--master-port` (NCCL on CUDA, gloo on CPU).
- A headless node (`serve --headless --node-rank R`) spawns its local ranks; each connects to
  node 0's control port twice (a call connection and a heartbeat connection), is told the
  backend, joins the process group and then runs the calls node 0 sends, like a local worker.

Failure handling (nothing may hang):
- Node 0 waits at most `--dist-join-timeout` seconds for every rank to connect, then fails with
  a message naming the missing ranks and nodes. A headless rank retries node 0 as long.
- Heartbeats every K2SERVE_HEARTBEAT_INTERVAL_S (1 s) both ways on the heartbeat connection. A
  rank whose process dies closes its sockets (seen at once); a node that vanishes is declared
  lost after K2SERVE_HEARTBEAT_TIMEOUT_S (30 s) of silence. Node 0's watchdog then marks the
  group broken (its /health answers 503) and calls the group's `on_failure` (the server exits
  with the message); a headless rank that loses node 0 exits with code 1, and its node with it.
- Connections are authenticated (HMAC challenge, multiprocessing.connection) with
  K2SERVE_DIST_SECRET, which must be the same on every node. NOTE: calls are pickled: anyone
  holding the secret who can reach the control port can run code on the nodes, as with
  torch.distributed's own unauthenticated store; keep these ports on a private network.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Connection,
    answer_challenge,
    deliver_challenge,
)

from k2serve import envs
from k2serve.distributed.errors import WorkerError

logger = logging.getLogger(__name__)

_DEFAULT_SECRET = b"k2serve-default-secret"


def heartbeat_interval_s() -> float:
    return envs.heartbeat_interval_s()


def heartbeat_timeout_s() -> float:
    return envs.heartbeat_timeout_s()


def authkey() -> bytes:
    """K2SERVE_DIST_SECRET (the same on every node), or a fixed default with a warning."""
    secret = envs.dist_secret()
    if secret:
        return secret.encode()
    logger.warning(
        "K2SERVE_DIST_SECRET is not set: the nodes authenticate with a default secret, so any "
        "host that reaches the control port can join; set the same secret on every node"
    )
    return _DEFAULT_SECRET


@dataclass(frozen=True)
class NodeSpec:
    """Where this process sits in a multi-node group (from EngineConfig's node fields)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    world_size: int  # = tensor_parallel_size, over all nodes
    join_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_nodes(self.nnodes, self.node_rank, self.world_size, self.master_port)

    @classmethod
    def from_engine_config(cls, cfg) -> NodeSpec:
        return cls(
            nnodes=cfg.nnodes,
            node_rank=cfg.node_rank,
            master_addr=cfg.master_addr,
            master_port=cfg.master_port,
            world_size=cfg.tensor_parallel_size,
            join_timeout_s=float(cfg.dist_join_timeout),
        )

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_ranks(self) -> range:
        """The global ranks on this node."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)

    @property
    def init_method(self) -> str:
        host = self.master_addr
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"tcp://{host}:{self.master_port}"

    @property
    def control_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port + 1

    def describe_missing(self, ranks) -> str:
        by_node: dict[int, list[int]] = {}
        for r in sorted(ranks):
            by_node.setdefault(self.node_of(r), []).append(r)
        return "; ".join(
            f"node {n} (ranks {rs[0]}..{rs[-1]})" if len(rs) > 1 else f"node {n} (rank {rs[0]})"
            for n, rs in by_node.items()
        )


def check_nodes(nnodes: int, node_rank: int, world_size: int, master_port: int) -> None:
    """ValueError naming the flag for a node layout that cannot work."""
    for name, v in (("nnodes", nnodes), ("tensor_parallel_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank!r} must be in [0, nnodes={nnodes})")
    if world_size % nnodes:
        raise ValueError(
            f"tensor_parallel_size={world_size} is not a multiple of nnodes={nnodes}: every "
            "node runs tensor_parallel_size / nnodes ranks (the GPUs of all nodes)"
        )
    if not isinstance(master_port, int) or not 1 <= master_port <= 65534:
        raise ValueError(
            f"master_port={master_port!r} must be in 1..65534 (node 0 also listens on "
            "master_port + 1)"
        )


# ---- connections -------------------------------------------------------------------------------
def _recv_within(conn: Connection, timeout_s: float, what: str):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {what} in {timeout_s:g}s")
    return conn.recv()


def connect(spec: NodeSpec, kind: str, rank: int, deadline: float, key: bytes) -> tuple:
    """A headless rank: connect to node 0's control port (retrying until `deadline`) and say
    hello. -> (connection, welcome dict). Raises ConnectionError with the reason."""
    addr = spec.control_address
    last = ""
    while True:
        try:
            sock = socket.create_connection(addr, timeout=5.0)
        except OSError as e:
            last = str(e)
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"could not reach node 0's control port {addr[0]}:{addr[1]} in "
                    f"{spec.join_timeout_s:g}s ({last}); is node 0 running with the same "
                    "--master-addr/--master-port?"
                ) from None
            time.sleep(0.5)
            continue
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
        except AuthenticationError:
            conn.close()
            raise ConnectionError(
                "node 0 refused this node's K2SERVE_DIST_SECRET: set the same value on every node"
            ) from None
        conn.send(("hello", kind, rank, socket.gethostname(), os.getpid(), spec.world_size))
        reply = _recv_within(conn, max(5.0, deadline - time.monotonic()), "answer from node 0")
        if reply[0] == "reject":
            conn.close()
            raise ConnectionError(f"node 0 rejected rank {rank}: {reply[1]}")
        return conn, reply[1]


@dataclass
class RemotePeer:
    """Node 0's view of one rank on another node."""

    rank: int
    node: int
    host: str
    pid: int
    conn: Connection  # calls and replies
    hb: Connection | None = None  # heartbeats (the watchdog thread alone reads and writes it)
    last_seen: float = 0.0
    lost: str | None = None

    def describe(self) -> str:
        return f"worker rank {self.rank} on node {self.node} ({self.host}, pid {self.pid})"

    # the same calls as workers._LocalPeer
    def send(self, msg) -> None:
        self.conn.send(msg)

    def poll(self, timeout_s: float = 0.0) -> bool:
        return self.conn.poll(timeout_s)

    def recv(self):
        return self.conn.recv()

    def exit_reason(self) -> str | None:
        return self.lost

    def join(self, timeout_s: float) -> None:
        """Wait for the rank to close its call connection (it does after the stop message)."""
        try:
            while self.conn.poll(max(0.0, timeout_s)):
                self.conn.recv()
        except (EOFError, OSError):
            pass

    def close(self) -> None:
        for c in (self.conn, self.hb):
            if c is not None:
                c.close()


class ControlServer:
    """Node 0: accept the headless ranks' connections (authenticated) until all have joined."""

    def __init__(self, spec: NodeSpec, backend: str, timeout_s: float) -> None:
        self.spec = spec
        self.welcome = dict(backend=backend, timeout_s=timeout_s, world_size=spec.world_size)
        self.key = authkey()
        self._sock = socket.socket(socket.AF_INET6 if ":" in spec.master_addr else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = spec.control_address[1]
        try:
            self._sock.bind(("", port))
        except OSError as e:
            self._sock.close()
            raise OSError(
                f"node 0 cannot listen on the control port {port} (--master-port + 1): {e}"
            ) from None
        self._sock.listen(64)
        self._handshakes: queue.SimpleQueue = queue.SimpleQueue()

    def _handshake(self, sock: socket.socket) -> None:
        """A thread per incoming connection, so a stranger that stalls blocks nobody."""
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            msg = _recv_within(conn, 30.0, "hello")
            self._handshakes.put((conn, msg))
        except (AuthenticationError, OSError, EOFError, TimeoutError) as e:
            logger.warning("a connection to the control port failed its handshake: %r", e)
            conn.close()

    def accept_all(self, expected: set[int], check_local=None) -> dict[int, RemotePeer]:
        """Every rank in `expected` with both connections, within the join timeout; else
        WorkerError naming the missing ranks. `check_local()` may raise to abort the wait."""
        spec = self.spec
        deadline = time.monotonic() + spec.join_timeout_s
        peers: dict[int, RemotePeer] = {}
        hbs: dict[int, Connection] = {}
        host, port = spec.control_address
        logger.info(
            "waiting up to %gs for %s to join at %s:%d",
            spec.join_timeout_s,
            spec.describe_missing(expected),
            host,
            port,
        )
        while not (expected <= peers.keys() and expected <= hbs.keys()):
            if check_local is not None:
                check_local()
            if time.monotonic() > deadline:
                missing = expected - (peers.keys() & hbs.keys())
                self._close_all(peers, hbs)
                raise WorkerError(
                    f"{spec.describe_missing(missing)} did not join within --dist-join-timeout "
                    f"{spec.join_timeout_s:g}s: start `k2serve serve --headless --nnodes "
                    f"{spec.nnodes} --node-rank R --master-addr {host} --master-port "
                    f"{spec.master_port} --tensor-parallel-size {spec.world_size}` on each "
                    f"node, and check that it reaches {host}:{port} and {host}:{spec.master_port}"
                )
            ready, _, _ = select.select([self._sock], [], [], 0.2)
            if ready:
                sock, _ = self._sock.accept()
                threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()
            while True:
                try:
                    conn, msg = self._handshakes.get_nowait()
                except queue.Empty:
                    break
                why = self._check_hello(msg, expected, peers, hbs)
                if why:
                    try:
                        conn.send(("reject", why))
                    finally:
                        conn.close()
                    if why.startswith("not a hello"):  # garbage: ignore it, keep waiting
                        logger.warning("ignored a control connection: %s", why)
                        continue
                    # an authenticated node with another layout: a misconfiguration, say so now
                    self._close_all(peers, hbs)
                    raise WorkerError(f"a node cannot join: {why}")
                _, kind, rank, rhost, pid, _ = msg
                if kind == "data":
                    peers[rank] = RemotePeer(rank, spec.node_of(rank), rhost, pid, conn)
                else:
                    hbs[rank] = conn
                conn.send(("welcome", self.welcome))
        now = time.monotonic()
        for r, p in peers.items():
            p.hb, p.last_seen = hbs[r], now
        logger.info("all %d ranks of %d nodes joined", spec.world_size, spec.nnodes)
        return peers

    def _close_all(self, peers: dict, hbs: dict) -> None:
        for p in peers.values():
            p.close()
        for c in hbs.values():
            c.close()
        self.close()

    def _check_hello(self, msg, expected, peers, hbs) -> str | None:
        if not (isinstance(msg, tuple) and len(msg) == 6 and msg[0] == "hello"):
            return f"not a hello: {msg!r:.80}"
        _, kind, rank, host, _, world = msg
        if world != self.spec.world_size:
            return (
                f"{host} runs with tensor_parallel_size={world} but node 0 with "
                f"{self.spec.world_size}: give every node the same --tensor-parallel-size "
                "and --nnodes"
            )
        if kind not in ("data", "hb") or rank not in expected:
            return f"{host} claims rank {rank!r}, not one of the other nodes' ranks"
        if rank in (peers if kind == "data" else hbs):
            return f"{host} claims rank {rank}, which already joined: two nodes share a --node-rank"
        return None

    def close(self) -> None:
        """Stop listening; connections still in their handshake are closed (their ranks see
        EOF and exit instead of waiting for an answer)."""
        self._sock.close()
        while True:
            try:
                conn, _ = self._handshakes.get_nowait()
            except queue.Empty:
                return
            conn.close()


# ---- heartbeats --------------------------------------------------------------------------------
def _beat(conn: Connection) -> tuple[str | None, bool]:
    """Send one ping and read every pending one. -> (why the peer is gone or None, whether a
    ping came in)."""
    got = False
    try:
        conn.send(("ping", None))
        while conn.poll(0):
            conn.recv()
            got = True
    except (EOFError, OSError) as e:
        return f"its connection closed ({type(e).__name__})", got
    return None, got


class Watchdog:
    """Node 0: heartbeats with every remote rank, and liveness of the local worker processes.
    The first loss calls `on_lost(message)` once."""

    def __init__(self, peers: list[RemotePeer], local_procs: list, on_lost) -> None:
        self.peers, self.local_procs, self.on_lost = peers, local_procs, on_lost
        self.interval, self.timeout = heartbeat_interval_s(), heartbeat_timeout_s()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k2serve-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for p in self.peers:
                hb = p.hb  # set when the peer joined, before the watchdog starts
                why, got = _beat(hb) if hb is not None else ("it has no heartbeat link", False)
                if got:
                    p.last_seen = now
                if why is None and now - p.last_seen > self.timeout:
                    why = f"no heartbeat for {now - p.last_seen:.0f}s"
                if why is not None and not self._stop.is_set():
                    p.lost = why
                    self.on_lost(f"{p.describe()} is gone: {why}")
                    return
            for i, proc in enumerate(self.local_procs):
                if proc.exitcode is not None and not self._stop.is_set():
                    self.on_lost(
                        f"tensor-parallel worker rank {i + 1} (pid {proc.pid}) on node 0 "
                        f"exited with code {proc.exitcode}"
                    )
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
