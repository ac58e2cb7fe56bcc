"""Why a layer's MLA decode costs more inside `cpu_e2e.py --full-k2` than the kernel alone.

The same decode (1 query after --contexts tokens, K2 shapes, shuffled pages of 64) timed five
ways, each the median of quiet calls (cpu_quiet.OmpTeam: torch's OpenMP team idle, checked):
- `kernel 1 hot`: the native kernel (mla.mla_decode) on one cache, again and again (what
  cpu_attn.py's "decode ms" column measures: that cache stays in the cores' L2 / the L3);
- `kernel 16`: over 16 distinct caches in turn (what cpu_e2e's MLA part reads);
- `forward 1` / `forward 16`: the same through TorchMLABackend.forward (the engine's call:
  metadata to lists, the output buffer, the path choice, then the kernel);
- `kernel cold` / `forward cold`: one cache per call right after the kernel pool's own read of
  --flush-mb MB of other memory (as in the engine, where a layer's ~500 MB of weights pass
  between two layers' MLA, on the same pool): its rows come from DRAM, its threads are awake.

    python benchmarks/cpu_mla_e2e.py --contexts 1024,8192
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from cpu_attn import KL, NH, RO, SCALE, backend, mla_case, mla_flops  # noqa: E402
from cpu_quiet import BwProbe, OmpTeam  # noqa: E402

from k2serve.kernels import cpu as ck  # noqa: E402
from k2serve.kernels.cpu import mla as cpu_mla  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--flush-mb", type=int, default=640)
    ap.add_argument("--bw-gib", type=float, default=1.0)
    args = ap.parse_args(argv)
    team, probe = OmpTeam(), BwProbe(args.bw_gib)
    bw = probe.probe()
    flush = torch.ones(args.flush_mb * 2**20 // 4)
    lib, pool = ck._default_pool(os.getpid())  # the pool mla_decode runs on

    def evict():  # read flush-mb MB on the kernel's pool (the pool the MLA call runs on)
        lib.k2_stream_read(pool._ptr, flush.data_ptr(), flush.numel() * 4)

    print(f"# cpu_mla_e2e: {torch.get_num_threads()} threads; read bandwidth {bw:.1f} GB/s; "
          f"paths {[cpu_mla.PATH_NAMES[p] for p in cpu_mla.mla_paths()]}; median of "
          f"{args.reps} quiet calls; ms per layer")  # fmt: skip
    print(f"{'context':>8} {'case':<14} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>6}")
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        one_context(ctx, args, team, evict)
    return 0


def one_context(ctx: int, args, team: OmpTeam, evict) -> None:
    """The five cases at one context (rows printed)."""
    ql, qp, kv, md = mla_case(ctx, 1, shuffle=True)
    kvs = [kv] + [kv.clone() for _ in range(args.copies - 1)]
    out = torch.empty(1, NH, KL, dtype=torch.bfloat16)
    pages, S = md.block_table[0], ctx + 1
    be = backend("auto")
    # the e2e's check: the same bits both ways
    a = be.forward(ql, qp, kv, md, SCALE)
    cpu_mla.mla_decode(ql, qp, kv, pages, S, SCALE, out)
    assert torch.equal(a, out), "forward and the kernel differ"

    def kern(k):
        cpu_mla.mla_decode(ql, qp, k, pages, S, SCALE, out)

    def fwd(k):
        be.forward(ql, qp, k, md, SCALE)

    def cold(fwd_too: bool) -> tuple[float, float]:
        """Median seconds of the kernel (and of forward) on a cache just evicted by the
        kernel pool's own stream read (its threads stay awake, torch's team idle)."""
        tk, tf = [], []
        for i in range(args.reps + 1):
            for fn, ts in ((kern, tk), (fwd, tf)) if fwd_too else ((kern, tk),):
                evict()
                t0 = time.perf_counter()
                fn(kvs[i % len(kvs)])
                ts.append(time.perf_counter() - t0)
        med = lambda ts: sorted(ts[1:])[len(ts[1:]) // 2]  # noqa: E731
        return med(tk), (med(tf) if fwd_too else float("nan"))

    n = len(kvs)
    cases = {
        "kernel 1 hot": (lambda: kern(kv), 1),
        f"kernel {n}": (lambda: [kern(k) for k in kvs], n),
        "forward 1": (lambda: fwd(kv), 1),
        f"forward {n}": (lambda: [fwd(k) for k in kvs], n),
    }
    for name, (fn, per) in cases.items():
        sec = team.timed(fn, args.reps)[0] / per
        row(ctx, name, sec)
    team.quiesce()
    tk, tf = cold(True)
    row(ctx, "kernel cold", tk)
    row(ctx, "forward cold", tf)


def row(ctx: int, name: str, sec: float) -> None:
    nb = (ctx + 1) * (KL + RO) * 2
    print(f"{ctx:>8} {name:<14} {sec * 1e3:>8.3f} {mla_flops(ctx, 1) / sec / 1e12:>8.2f} "
          f"{nb / sec / 1e9:>6.1f}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
