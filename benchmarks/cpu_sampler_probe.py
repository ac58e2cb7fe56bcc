"""What a CPU decode step's logits -> token ops cost the next step's kernel calls.

At CPU decode the engine ended a step with `compute_logits` (the lm_head GEMV in bf16, then
`.to(float32)` of the [1, 163,840] logits) and the sampler's greedy `argmax` over them: two
torch ops above torch's OpenMP grain (32,768 elements), so torch's OpenMP team ran them and
then spun (libgomp, OMP_WAIT_POLICY unset) on the cores the next step's first kernel calls
(the attention projections' GEMVs on the CPU kernel's pool) need. Per iteration, quiet timing:
  1. the step's end: lm_head GEMV (bf16 out), .to(float32), argmax, .tolist() (the host
     sync), then at once
  2. the next step's first GEMVs: `--gemvs` distinct bf16 [2112, 7168] weights (layer 0's fused
     q_a + kv_a projection, 30 MB each, missing the caches), timed;
step 1 three ways: torch's .to and argmax (before), the kernel's widening and argmax on the
calling thread (kernels/cpu/logits.py: the engine now), the lm_head GEMV alone (the floor).
Prints per way the median time of step 2, of step 1, and the CPU time torch's team used over
both (cpu_quiet.OmpTeam).

    python benchmarks/cpu_sampler_probe.py [--iters 30] [--gemvs 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_quiet import OmpTeam, cpu_ns

from k2serve.kernels import cpu as ck
from k2serve.kernels.cpu.logits import cpu_argmax, cpu_float32

D, VOCAB, QKV = 7168, 163840, 2112


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--gemvs", type=int, default=4)
    args = ap.parse_args(argv)
    if ck.load_kernel() is None:
        print("no CPU kernel")
        return 1
    team = OmpTeam()
    lm = (torch.randn(VOCAB // 40, D) * D**-0.5).bfloat16().repeat(40, 1)  # 2.35 GB
    ws = [(torch.randn(QKV // 8, D) * D**-0.5).bfloat16().repeat(8, 1) for _ in range(args.gemvs)]
    x = torch.randn(1, D).bfloat16()

    def end_engine():
        logits = ck.cpu_linear(x, lm).to(torch.float32)  # compute_logits
        return logits.argmax(dim=-1).tolist()  # the sampler's greedy path

    def end_kernel():  # as the engine runs it now (kernels/cpu/logits.py)
        logits = cpu_float32(ck.cpu_linear(x, lm))
        return cpu_argmax(logits).tolist()

    def end_quiet():
        return ck.cpu_linear(x, lm)  # the GEMV alone: no torch op above the grain

    def next_step():
        for w in ws:
            ck.cpu_linear(x, w)

    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, team of "
          f"{len(team.tids)}; {args.gemvs} GEMVs [{QKV}, {D}] bf16 after the step's end, "
          f"median of {args.iters}")  # fmt: skip
    ends = {"torch .to + argmax": end_engine, "kernel widen + argmax": end_kernel,
            "GEMV alone": end_quiet}  # fmt: skip
    assert end_engine() == end_kernel()
    res: dict[str, list] = {k: [] for k in ends}
    for it in range(args.iters + 1):
        for name, end in ends.items():
            team.quiesce()
            a = cpu_ns()
            t0 = time.perf_counter()
            end()
            t1 = time.perf_counter()
            next_step()
            t2 = time.perf_counter()
            if it:  # the first: warm-up
                res[name].append((t1 - t0, t2 - t1, team.used_ms(a, cpu_ns())))
    for name, rows in res.items():
        e, n, s = (statistics.median(r[i] for r in rows) for i in range(3))
        gbs = args.gemvs * QKV * D * 2 / n / 1e9
        print(f"{name:<21}: step end {e * 1e3:7.3f} ms, next GEMVs {n * 1e3:7.3f} ms "
              f"({gbs:5.1f} GB/s), torch team CPU {s:6.2f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
