"""The absorbed kv_b at CPU decode (kernels.cpu.cpu_head_gemv) against the read bandwidth:
the kernel's per-head path (16 rows per reduction) against its previous per-row path, A/B.

K2's shapes: W_UK^T [64 heads, 512, 128] and W_UV [64, 128, 512] bf16 (8.4 MB each), 1 and 2
token rows. Both builds (the default, and -DK2_HEADS_LEGACY=1: the per-row path) are loaded in
one process; every rep probes the read bandwidth (the pool's threads over 1 GiB), then times each
build (order alternating) over `--copies` distinct weights (80 x 8.4 MB: more than a 480 MB L3,
so they come from memory). Checks both builds against float32 einsum first. Prints the median of
the reps (GB/s, share of that rep's bandwidth) and cpu_head_gemv as the model calls it. Run:
    PYTHONPATH=src python3 benchmarks/cpu_head_gemv.py [--copies 80] [--reps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from pathlib import Path

import torch

from k2serve.kernels import cpu as ck

NH = 64
SHAPES = {"W_UK^T [64,512,128]": (512, 128), "W_UV [64,128,512]": (128, 512)}


def build(define: str) -> ctypes.CDLL:
    flags = ck.CXX_FLAGS
    try:
        ck.CXX_FLAGS = flags + (f"-D{define}",)
        return ck._declare(ctypes.CDLL(str(ck._build(Path.home() / ".cache/k2serve/cpu_kernel"))))
    finally:
        ck.CXX_FLAGS = flags


def load_builds(defines: list[str]) -> dict[str, tuple]:
    """{name: (lib, pool)}: the default build, the per-row (legacy) one and one per define
    (variants to compare), each with its own pool."""
    lib = ck.load_kernel()
    if lib is None:
        raise SystemExit("the native CPU kernel does not build here")
    libs = {"16-row": lib, "per-row": build("K2_HEADS_LEGACY=1")}
    libs.update({d: build(d) for d in defines})
    nodes = [list(n) for n in ck.numa_topology()]
    threads = torch.get_num_threads()
    return {name: (lb, ck.KernelPool(lb, nodes, threads)) for name, lb in libs.items()}


def gemv(build, w, x, out) -> None:
    lib, pool = build
    B, N, K = w.shape
    rc = lib.k2_linear_batched(pool._ptr, ck.FMT_BF16, w.data_ptr(), B, N, K, x.data_ptr(),
                               ck.X_BF16, x.shape[0], out.data_ptr())  # fmt: skip
    assert rc == 0, rc


def check(builds) -> float:
    """Largest error of any build against float32 einsum, relative to the largest output."""
    worst = 0.0
    for n, k in SHAPES.values():
        for rows in (1, 2):
            w, x = torch.randn(NH, n, k).bfloat16(), torch.randn(rows, NH, k).bfloat16()
            ref = torch.einsum("thk,hnk->thn", x.float(), w.float())
            for b in builds.values():
                out = torch.empty(rows, NH, n)
                gemv(b, w, x, out)
                worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
            y = ck.cpu_head_gemv(x, w)
            worst = max(worst, ((y.float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def timed(fn, ws) -> float:
    t0 = time.perf_counter()
    for w in ws:
        fn(w)
    return (time.perf_counter() - t0) / len(ws)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=80, help="distinct weights per timing")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE: a kernel variant to time beside the two")  # fmt: skip
    args = ap.parse_args(argv)
    builds = load_builds(args.define)
    err = check(builds)
    print(f"# check: max error vs float32 einsum {err:.1e} of the largest output (both builds)")
    assert err < 1e-2, err
    lib, pool = builds["16-row"]
    buf = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    print(f"# cpu_head_gemv: {torch.get_num_threads()} threads, {args.copies} copies, "
          f"{args.reps} reps, load {os.getloadavg()[0]:.2f}; median of reps")  # fmt: skip
    print(f"{'weight':<20} {'rows':>4} {'BW GB/s':>8} {'build':>18} {'us':>7} {'GB/s':>6} "
          f"{'of BW':>6}")  # fmt: skip
    sums: dict[str, list[float]] = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(NH, n, k).bfloat16() for _ in range(args.copies)]
        nbytes = ws[0].numel() * 2
        for rows in (1, 2):
            x, out = torch.randn(rows, NH, k).bfloat16(), torch.empty(rows, NH, n)
            res: dict[str, list[tuple[float, float]]] = {b: [] for b in builds}
            res["model call"] = []
            bws = []
            for rep in range(args.reps + 1):
                t0 = time.perf_counter()
                lib.k2_stream_read(pool._ptr, buf.data_ptr(), buf.numel() * 4)
                bw = buf.numel() * 4 / (time.perf_counter() - t0) / 1e9
                order = list(builds) if rep % 2 else list(builds)[::-1]
                for b in [*order, "model call"]:
                    time.sleep(0.02)  # the other pool's threads stop spinning
                    if b == "model call":
                        t = timed(lambda w: ck.cpu_head_gemv(x, w), ws)  # noqa: B023
                    else:
                        t = timed(lambda w: gemv(builds[b], w, x, out), ws)  # noqa: B023
                    if rep:  # rep 0: warm-up
                        res[b].append((t, nbytes / t / 1e9 / bw))
                if rep:
                    bws.append(bw)
            for b, v in res.items():
                t = statistics.median(a for a, _ in v)
                share = statistics.median(s for _, s in v)
                if rows == 1:
                    sums.setdefault(b, []).append(t)
                print(f"{name:<20} {rows:>4} {statistics.median(bws):>8.1f} {b:>18} "
                      f"{t * 1e6:>7.1f} {nbytes / t / 1e9:>6.1f} {share:>6.0%}")  # fmt: skip
        del ws
    for b, ts in sums.items():
        print(f"# absorbed kv_b, 1 token, W_UK + W_UV ({b}): {sum(ts) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
