"""Before/after of the CPU experts' decode step in one process, on the same weights and routing.

One K2 MoE layer (384 INT4 experts top-8, hidden 7168, inter 2048, group 32; dummy weights),
every routed expert on the CPU, bf16 activations. Two kernel builds, each with its own thread
pool: "after" (the shipped kernel: elastic step, bf16 written by the kernel) and "before"
(`-DK2_SYNC_BARRIERS=1`: every thread waits at a barrier after the prologue and after gate/up,
and the float32 result converted by torch, as the backend did). Calls alternate between the
two on the same inputs, with a gap between calls (an engine's layers are ms apart, so the
pools' workers sleep between calls in both; "after + prewake": the engine's prewake, issued
before that gap as a hybrid step does once its routing is known). Two cases: inputs ready (a
hybrid step: the kernel follows copies from the GPU) and a torch op on [T, hidden] right
before each call (a CPU-only model: torch's OpenMP threads then spin beside the kernel's for
a while). The read
bandwidth is measured in the same run (kernel threads and torch.sum, before and after the
timings; the limit is the largest). The verify table: T = 1..8 consecutive tokens against
their bytes floor (distinct experts x expert size at that bandwidth).

    PYTHONPATH=src python benchmarks/cpu_experts_ab.py                # 384 experts, ~10 GB
    PYTHONPATH=src python benchmarks/cpu_experts_ab.py --experts 64 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import cpu_moe as cm  # noqa: E402

from k2serve.kernels import cpu as ck  # noqa: E402
from k2serve.moe.cpu_experts import CpuExpertBackend  # noqa: E402

BEFORE_DEFINES = ("K2_SYNC_BARRIERS=1",)


def make_backend(experts, defines, threads):
    """A backend on its own build of the kernel (the build flags are read at load)."""
    base = ck.CXX_FLAGS
    ck.CXX_FLAGS = base + tuple(f"-D{d}" for d in defines)
    ck._load.cache_clear()
    try:
        E = len(experts)
        return CpuExpertBackend(experts, range(E), E, kernel="native", threads=threads, amx=False)
    finally:
        ck.CXX_FLAGS = base
        ck._load.cache_clear()


def timed_calls(variants, steps, gap_s, torch_op):
    """{name: [seconds]} and {name: [kernel-view profile]} over `steps`, variants alternating
    (each variant in turn first)."""
    ts = {n: [] for n, _ in variants}
    prof = {n: [] for n, _ in variants}
    for i, (x, ids, w) in enumerate(steps):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for name, fn in order:
            if getattr(fn, "prewake", None):
                fn.prewake()  # as the engine does once the step's routing is known
            time.sleep(gap_s)
            xi = x.mul(1.0) if torch_op else x  # [T, hidden] on torch's threads
            t0 = time.perf_counter()
            fn(xi, ids, w)
            dt = time.perf_counter() - t0
            if i:  # the first step warms up
                ts[name].append(dt)
                p = ck.last_profile(fn.lib)
                wk = (ctypes.c_int * 2)()
                fn.lib.k2_last_workers(wk)  # workers that ran the step / came late
                p["joined"], p["late"] = wk[0], wk[1]
                prof[name].append(p)
    return ts, prof


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--batches", default="1,4,5,6,16")
    ap.add_argument("--verify", default="1,2,3,4,5,6,7,8", help="T of the verify table ('' = none)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="pause before each call")
    ap.add_argument("--bw-gib", type=float, default=2.0)
    args = ap.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    E, k = args.experts, args.topk
    g = torch.Generator().manual_seed(0)
    print(f"# cpu_experts_ab: {E} INT4 experts top-{k}, hidden 7168, inter 2048, {threads} "
          f"threads, {os.cpu_count()} CPUs, torch {torch.__version__}, gap {args.gap_ms} ms, "
          f"load {os.getloadavg()[0]:.2f}")  # fmt: skip
    t0 = time.perf_counter()
    cache: dict = {}
    experts = [cm.Expert("int4", 7168, 2048, g, cache, e) for e in range(E)]
    cache.clear()
    per_expert = cm.expert_bytes(experts[0])
    print(f"# weights {E} x {per_expert / 1e6:.1f} MB ({time.perf_counter() - t0:.1f} s)")
    after = make_backend(experts, (), threads)
    before = make_backend(experts, BEFORE_DEFINES, threads)

    def call_after(x, ids, w):
        return after(x, ids, w)

    def call_before(x, ids, w):  # the previous output path: float32, torch converts
        out = torch.empty(x.shape[0], 7168)
        return before._run_native(x, ids, w, out).to(torch.bfloat16)

    def call_prewoken(x, ids, w):
        return after(x, ids, w)

    call_after.lib, call_before.lib = after._lib, before._lib  # type: ignore[attr-defined]
    call_prewoken.lib, call_prewoken.prewake = after._lib, after.prewake  # type: ignore[attr-defined]
    variants = [("before", call_before), ("after", call_after), ("prewoken", call_prewoken)]
    # correctness first: the two builds give the same bits (same sums in the same order)
    for T in (1, 5, 16):
        ids, w = cm.routing(T, E, k, g)
        x = torch.randn(T, 7168, generator=g).bfloat16()
        a, b = call_after(x, ids, w), call_before(x, ids, w)
        same = torch.equal(a, b)
        print(f"# check T={T}: after == before bit for bit: {same}")
        if not same:
            return 1
    bw = cm.read_bandwidth(after, args.bw_gib)
    limit = max(bw)
    print(f"# read bandwidth ({args.bw_gib} GiB): kernel threads {bw[0]:.1f} GB/s, torch.sum "
          f"{bw[1]:.1f} GB/s; limit used = {limit:.1f} GB/s (again at the end)")  # fmt: skip
    # rows are printed as they are measured (a time limit keeps what was done)
    print(f"\n## one MoE layer, median ms per call (of read bandwidth); kernel view: median "
          f"prologue / total ms (after: / workers that ran the step, of {threads - 1} / of "
          f"those, late: gate/up all handed out)")  # fmt: skip
    print("| before the call | T | experts | before ms | after ms | after vs before | "
          "before kernel | after kernel | after + prewake ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [int(t) for t in args.batches.split(",") if t]
    for torch_op in (False, True):
        for T in cases:
            steps = []
            for _ in range(args.iters + 1):
                ids, w = cm.routing(T, E, k, g)
                steps.append((torch.randn(T, 7168, generator=g).bfloat16(), ids, w))
            hit = sum(s[1].unique().numel() for s in steps[1:]) / args.iters
            ts, prof = timed_calls(variants, steps, args.gap_ms / 1e3, torch_op)
            mb = statistics.median(ts["before"])
            ma = statistics.median(ts["after"])
            mp = statistics.median(ts["prewoken"])
            gb = hit * per_expert / 1e9

            def kv(name, prof=prof):
                p = prof[name]
                pro = statistics.median(q["prologue"] for q in p) * 1e3
                tot = statistics.median(q["total"] for q in p) * 1e3
                if name == "before":  # every worker runs a barrier step
                    return f"{pro:.3f} / {tot:.2f}"
                jn = statistics.median(q["joined"] for q in p)
                lt = statistics.median(q["late"] for q in p)
                return f"{pro:.3f} / {tot:.2f} / {jn:g} / {lt:g}"

            case = "torch op" if torch_op else "inputs ready"
            print(f"| {case} | {T} | {hit:.1f} | {mb * 1e3:.2f} ({gb / mb / limit:.0%}) | "
                  f"{ma * 1e3:.2f} ({gb / ma / limit:.0%}) | {mb / ma:.2f}x | {kv('before')} | "
                  f"{kv('after')} | {mp * 1e3:.2f} ({gb / mp / limit:.0%}) |")  # fmt: skip
    verify = [int(t) for t in args.verify.split(",") if t]
    if verify:
        print("\n## verify step of T consecutive tokens (q = 0), inputs ready: ms / bytes floor")
        print("| T | experts | floor ms | before ms | before / floor | after ms | after / floor |")
        print("|---|---|---|---|---|---|---|")  # after: without prewake
    for T in verify:
        steps = []
        for _ in range(args.iters + 1):
            ids, w = cm.consecutive_routing(T, E, k, 0.0, g)
            steps.append((torch.randn(T, 7168, generator=g).bfloat16(), ids, w))
        hit = sum(s[1].unique().numel() for s in steps[1:]) / args.iters
        ts, _ = timed_calls(variants[:2], steps, args.gap_ms / 1e3, False)
        floor = hit * per_expert / (limit * 1e9)
        mb, ma = statistics.median(ts["before"]), statistics.median(ts["after"])
        print(f"| {T} | {hit:.1f} | {floor * 1e3:.2f} | {mb * 1e3:.2f} | {mb / floor:.2f} | "
              f"{ma * 1e3:.2f} | {ma / floor:.2f} |")  # fmt: skip
    bw2 = cm.read_bandwidth(after, args.bw_gib)
    print(f"\n# read bandwidth again: kernel threads {bw2[0]:.1f} GB/s, torch.sum {bw2[1]:.1f} "
          f"GB/s (the % above use {limit:.1f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
