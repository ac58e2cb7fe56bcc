"""How long torch's OpenMP threads keep a CPU busy after one small parallel op.

A torch op on [T, 7168] (K2's hidden size) runs on torch's OpenMP threads from T * 7168 >=
32768 elements (T >= 5); libgomp's workers then spin (OMP_WAIT_POLICY unset: up to
GOMP_SPINCOUNT iterations) on the cores a native kernel's own threads want. This runs the
float32 -> bf16 conversion the CPU expert backend used to do after each call, sleeps 20 ms,
and prints the CPU time every other thread of the process used meanwhile (Linux schedstat).
Then the same after one CPU-kernel GEMV with an lm_head-wide output (163,840): its float32 ->
bf16 rounding by the kernel on its calling thread (what linear() does) vs one .to().

    python benchmarks/omp_spin_probe.py
"""

from __future__ import annotations

import os
import time

import torch
from cpu_quiet import cpu_ns  # benchmarks/cpu_quiet.py


def others_ms(fn, main_tid: str, reps: int = 5) -> list[float]:
    """CPU ms the process's other threads used over `fn()` and 20 ms asleep after it, each of
    `reps` tries after 0.3 s asleep (the team asleep); sorted."""
    spent = []
    for _ in range(reps):
        time.sleep(0.3)
        a = cpu_ns()
        fn()
        time.sleep(0.02)
        b = cpu_ns()
        spent.append(sum(b[t] - a.get(t, 0) for t in b if t != main_tid) / 1e6)
    return sorted(spent)


def main() -> int:
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT')}")  # fmt: skip
    main_tid = str(os.getpid())
    for _ in range(3):  # start the OpenMP team
        torch.randn(64, 7168).to(torch.bfloat16)
    for T in (4, 5, 16):
        x = torch.randn(T, 7168)
        spent = others_ms(lambda x=x: x.to(torch.bfloat16), main_tid)
        print(f"T={T:3d}: [T, 7168] float32 -> bf16, then 20 ms asleep: the other threads "
              f"used {spent[2]:.2f} ms of CPU (median of 5; min {spent[0]:.2f}, "
              f"max {spent[-1]:.2f})")  # fmt: skip
    from k2serve.kernels import cpu as ck

    if ck.load_kernel() is None:
        return 0
    w = torch.randn(163840, 256).bfloat16()  # the lm_head's output width, short rows
    x = torch.randn(1, 256).bfloat16()
    cases = (("the kernel (linear)", lambda: ck.cpu_linear(x, w)),
             ("one .to()", lambda: ck._gemv(x, w, 1, 1).to(torch.bfloat16)))  # fmt: skip
    for name, fn in cases:
        fn()
        spent = others_ms(fn, main_tid)
        print(f"GEMV [1, 163840] bf16 out, rounded in {name}: the other threads (kernel pool "
              f"+ torch's team) used {spent[2]:.2f} ms of CPU (median of 5; min "
              f"{spent[0]:.2f}, max {spent[-1]:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
