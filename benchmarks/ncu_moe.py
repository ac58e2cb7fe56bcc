# ruff: noqa: E501, E741
"""The MoE kernels of one K2 layer (384 x 7168 x 2048 INT4 g32 experts, top-8, uniform routing)
run once each after a warm-up, for Nsight Compute to read their hardware counters (issue 28:
where the grouped decode GEMV at T=128 and the prompt GEMM at 8K lose against the copy
bandwidth and the matmul rate). No timing here: ncu replays each kernel and reports DRAM / L2 /
L1 throughput, issue activity and warp stall reasons.

Run (one GPU, repo root), through `benchmarks/ncu_moe.sh` (ncu's kernel filter and sections):
  PYTHONPATH=src python3 benchmarks/ncu_moe.py --case grouped128|pair32|gemm8k|copy
Cases: grouped128 = the grouped GEMV at T=128 (the B=128 decode target's kernel), pair32 = the
per-pair GEMV at T=32 (91% of copy bw in wave 9: the contrast), gemm8k = the INT4 prompt GEMM
at T=8192 (the prefill target's kernel), copy = a 1 GiB device copy (the bandwidth reference
under the same counters).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_libs import E, K, int4_experts  # noqa: E402
from routing_modes import routing_ids  # noqa: E402

D = 7168
PATHS = {"grouped128": ("grouped", 128), "pair32": ("decode", 32), "gemm8k": ("gemm", 8192)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=(*PATHS, "copy"), required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.case == "copy":
        a = torch.randn(1 << 28, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):  # a read + write kernel (copy_ would be a memcpy, not a kernel)
            torch.neg(a, out=b)
        torch.cuda.synchronize()
        print("copy done")
        return
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.moe.fused_moe import FusedMoEBackend

    path, T = PATHS[args.case]
    ew = int4_experts("cuda")
    be = FusedMoEBackend(ew, **KernelPolicy.for_device("cuda").moe_kwargs())
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    tw = torch.rand(T, K, device="cuda")
    ids = routing_ids("uniform", T, E, K, 0, 0, "cuda")
    hits = ids.unique().numel()
    for _ in range(2):  # warm-up: compiles; ncu skips these launches (--launch-skip)
        be.run_path(path, x, ids, tw)
    torch.cuda.synchronize()
    be.run_path(path, x, ids, tw)  # the profiled launches
    torch.cuda.synchronize()
    per = sum(t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale))
    print(f"{args.case}: path {path}, T={T}, {hits} experts hit, {hits * per / 1e9:.2f} GB of "
          f"their weights + scales, plan {be.plan(T, K)[0]}")  # fmt: skip


if __name__ == "__main__":
    main()
