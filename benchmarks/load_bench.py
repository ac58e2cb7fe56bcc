"""Load time and peak host memory of the streaming loader on a k2-slice INT4 checkpoint (CPU).

Run from the repo root:
    .venv/bin/python benchmarks/load_bench.py [--layers 4] [--experts 384] [--shard-gb 2] [--dir D]

It writes the checkpoint with `make_checkpoint` (in a temp dir unless --dir is given, removed
afterwards), then loads it twice, each time in a FRESH child process so that peak RSS (VmHWM of
that child) counts only the load; the second load finds more of the shards in the page cache.
Prints the checkpoint size, the largest shard, the model's own bytes in memory, load time, GB/s,
and peak RSS minus the model bytes (what the loader costs on top).
--experts overrides n_routed_experts (every other dimension stays at the real K2 size) for
machines whose RAM cannot hold 384 experts per layer (a 4-layer slice with all 384 is ~35 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

# NOTE: ru_maxrss survives fork + exec on Linux (a child reports its parent's peak when that
# is higher), so the children read VmHWM from /proc/self/status, which exec resets.
_PEAK = r"""
def peak_rss():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""

_CHILD = (
    _PEAK
    + r"""
import json, sys, time, torch
from k2serve.weights.loader import load_model
t0 = time.perf_counter()
m = load_model(sys.argv[1], dtype=torch.bfloat16, device="cpu", progress=False)
dt = time.perf_counter() - t0
nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
rss = peak_rss()
print(json.dumps({"load_s": dt, "model_bytes": nbytes, "peak_rss": rss}))
"""
)

_BASE_CHILD = (
    _PEAK
    + r"""
import json, torch
import k2serve.weights.loader
print(json.dumps({"peak_rss": peak_rss()}))
"""
)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None, help="override n_routed_experts")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="write the checkpoint here and keep it")
    args = ap.parse_args()

    from k2serve.weights.make_checkpoint import make_checkpoint
    from k2serve.weights.presets import preset_config

    cfg = preset_config("k2-slice", "int4", layers=args.layers)
    if args.experts:
        cfg["n_routed_experts"] = args.experts
    out = args.dir or tempfile.mkdtemp(prefix="k2slice-int4-")
    try:
        t0 = time.perf_counter()
        make_checkpoint(
            out,
            cfg,
            seed=0,
            max_shard_bytes=int(args.shard_gb * 1e9),
            tokenizer=False,
            progress=False,
        )
        make_s = time.perf_counter() - t0
        shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        sizes = [os.path.getsize(os.path.join(out, f)) for f in shards]
        py = sys.executable
        env = dict(os.environ)
        base = json.loads(subprocess.check_output([py, "-c", _BASE_CHILD], env=env))
        runs = [
            json.loads(subprocess.check_output([py, "-c", _CHILD, out], env=env)) for _ in range(2)
        ]
        res = runs[0]
        overhead = res["peak_rss"] - res["model_bytes"]
        print(
            f"config: k2-slice int4, {args.layers} layers, "
            f"{cfg['n_routed_experts']} experts/MoE layer, shards <= {args.shard_gb} GB"
        )
        print(f"make-checkpoint: {make_s:.1f} s")
        print(f"checkpoint: {_gb(sum(sizes))} in {len(shards)} shards, largest {_gb(max(sizes))}")
        for i, r in enumerate(runs):
            print(
                f"load #{i + 1}: {r['load_s']:.2f} s ({sum(sizes) / r['load_s'] / 1e9:.2f} GB/s), "
                f"peak RSS {_gb(r['peak_rss'])}"
            )
        print(f"model bytes in memory: {_gb(res['model_bytes'])}")
        print(
            f"peak RSS of the loading process: {_gb(res['peak_rss'])} "
            f"(python + torch + k2serve alone: {_gb(base['peak_rss'])})"
        )
        print(
            f"peak RSS - model bytes: {_gb(overhead)} "
            f"(= {overhead / max(sizes):.2f} x the largest shard)"
        )
        print(
            f"self ru_maxrss (writer process): "
            f"{_gb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}"
        )
    finally:
        if not args.dir:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
