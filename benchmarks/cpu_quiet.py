"""Timing CPU kernel parts as the engine runs them at batch 1: with torch's OpenMP team idle.

A torch op on >= 32,768 elements runs on torch's OpenMP threads, which then spin for
milliseconds (libgomp, OMP_WAIT_POLICY unset) on the cores the native kernel's own pool threads
want (benchmarks/omp_spin_probe.py). At batch 1 the engine's ops between kernel calls are below
that size, so its kernel calls run beside an idle team. A benchmark that builds big tensors
(randn, repeat, a bandwidth probe's sum) right before timing a part does not. Here:
- `OmpTeam`: finds torch's OpenMP threads (those that run a big torch op while the rest of the
  process is idle) and reads their CPU time (Linux schedstat);
- `OmpTeam.quiesce()`: sleeps until the team used < 0.1 ms of CPU in a 20 ms window;
- `OmpTeam.timed(fn, reps)`: quiesce, warm up, then `reps` timed calls: the median, and the CPU
  the team used during the timed calls (0 when the part ran as the engine runs it);
- `BwProbe`: the read-bandwidth probe repeated between parts (torch's sum and the kernel's
  stream read, best of 2 each); its max over the run is the limit (conservative: the probes
  swing by 1.5x between parts of one run on a loaded host).
"""

from __future__ import annotations

import os
import statistics
import time

import torch


def cpu_ns() -> dict[str, int]:
    """Nanoseconds on a CPU per thread of this process (Linux; {} elsewhere)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except OSError:
            continue
    return out


class OmpTeam:
    def __init__(self) -> None:
        main = str(os.getpid())
        big = torch.ones(1 << 22)
        big.sum()  # start the team
        time.sleep(0.3)  # everything idle (the team, a kernel pool's spinning threads)
        a = cpu_ns()
        for _ in range(20):
            big.sum()
        b = cpu_ns()
        self.tids = {t for t in b if t != main and b[t] - a.get(t, 0) > 0}

    def used_ms(self, a: dict[str, int], b: dict[str, int]) -> float:
        return sum(b.get(t, 0) - a.get(t, 0) for t in self.tids) / 1e6

    def quiesce(self, limit_s: float = 2.0) -> float:
        """Sleeps until the team used < 0.1 ms of CPU in 20 ms; returns the seconds waited."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < limit_s:
            a = cpu_ns()
            time.sleep(0.02)
            if self.used_ms(a, cpu_ns()) < 0.1:
                break
        return time.perf_counter() - t0

    def timed(self, fn, reps: int) -> tuple[float, float]:
        """(median seconds of `reps` calls of fn, ms of CPU torch's team used during them)."""
        fn()  # warm-up (first touch, kernel set-up)
        self.quiesce()
        ts = []
        a = cpu_ns()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), self.used_ms(a, cpu_ns())


def read_gbs(buf: torch.Tensor, reps: int) -> float:
    """GB/s of the best of `reps` reads of `buf` by torch's sum and by the CPU expert kernel's
    own threads (k2_stream_read), when the kernel builds."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    try:
        from k2serve.kernels import cpu as ck

        lib = ck.load_kernel()
        if lib is not None:
            nodes = tuple(tuple(n) for n in ck.numa_topology())
            pool = ck.shared_pool(lib, nodes, torch.get_num_threads(), os.getpid())
            for _ in range(reps):
                t0 = time.perf_counter()
                lib.k2_stream_read(pool._ptr, buf.data_ptr(), buf.numel() * 4)
                best = min(best, time.perf_counter() - t0)
    except Exception:  # noqa: BLE001 - no kernel here: torch's figure alone
        pass
    return buf.numel() * 4 / best / 1e9


class BwProbe:
    """Read bandwidth of this CPU, probed again at each call of `probe()`."""

    def __init__(self, gib: float) -> None:
        self.buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        self.runs: list[float] = []

    def probe(self, reps: int = 2) -> float:
        self.runs.append(read_gbs(self.buf, reps))
        return self.runs[-1]

    def summary(self) -> str:
        r = sorted(self.runs)
        med = statistics.median(r)
        return (f"read bandwidth over {len(r)} probes: min {r[0]:.1f}, median {med:.1f}, "
                f"max {r[-1]:.1f} GB/s (the limit: the max)")  # fmt: skip
