"""The host CPU a plan runs its CPU experts (or everything) on: cores, sockets, NUMA nodes, RAM
and memory bandwidth, given on the command line, read from this machine (`--cpu this`), or
measured (`--cpu-bandwidth measure`).

No torch import. `measure_bandwidth` is the only function that takes time (about a second).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HostCpu:
    model: str | None = None  # "AMD EPYC 9654 96-Core Processor"
    cores: int | None = None  # physical cores, all sockets
    sockets: int | None = None
    numa_nodes: int | None = None
    memory_bytes: int | None = None  # MemTotal
    bandwidth: float | None = None  # bytes/s
    bandwidth_source: str = "assumed"  # given | measured | assumed

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [self.model or "CPU model not given"]
        if self.sockets:
            parts.append(f"{self.sockets} socket{'s' if self.sockets > 1 else ''}")
        if self.cores:
            parts.append(f"{self.cores} cores")
        if self.numa_nodes:
            parts.append(f"{self.numa_nodes} NUMA node{'s' if self.numa_nodes > 1 else ''}")
        return ", ".join(parts)


def detect_host(proc: str = "/proc", sys_node: str = "/sys/devices/system/node") -> HostCpu:
    """This machine's CPU facts from /proc/cpuinfo, /proc/meminfo and /sys (None where absent)."""
    model, cores, sockets = None, None, None
    try:
        with open(os.path.join(proc, "cpuinfo")) as f:
            text = f.read()
        names = re.findall(r"^model name\s*:\s*(.+)$", text, flags=re.MULTILINE)
        model = names[0].strip() if names else None
        pairs = set(
            re.findall(
                r"^physical id\s*:\s*(\d+)$.*?^core id\s*:\s*(\d+)$",
                text,
                flags=re.MULTILINE | re.DOTALL,
            )
        )
        socket_ids = set(re.findall(r"^physical id\s*:\s*(\d+)$", text, flags=re.MULTILINE))
        sockets = len(socket_ids) or None
        cores = len(pairs) or (len(names) or None)
    except OSError:
        pass
    memory = None
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            m = re.search(r"^MemTotal:\s*(\d+) kB", f.read(), flags=re.MULTILINE)
        memory = int(m.group(1)) * 1024 if m else None
    except OSError:
        pass
    try:
        nodes = len([d for d in os.listdir(sys_node) if re.fullmatch(r"node\d+", d)]) or None
    except OSError:
        nodes = None
    return HostCpu(model, cores, sockets, nodes, memory)


def measure_bandwidth(size_bytes: int = 512 * 2**20, repeats: int = 3) -> float:
    """Copy bandwidth of this machine's RAM, bytes/s (read + write), with one thread per CPU
    (numpy releases the GIL while copying). A lower bound of what the CPU experts can read."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    n = max(1, len(os.sched_getaffinity(0)))
    chunk = size_bytes // n // 8
    src = [np.ones(chunk, dtype=np.float64) for _ in range(n)]
    dst = [np.empty_like(a) for a in src]
    best = float("inf")
    with ThreadPoolExecutor(n) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda i: np.copyto(dst[i], src[i]), range(n)))
            best = min(best, time.perf_counter() - t0)
    return 2 * chunk * 8 * n / best
