"""Does the peaked dummy model (weights.random_init.peak_logits) follow its successor chain?
Greedy decode of a few prompts, speculation off; prints the fraction of tokens that are the
successor of the token before, and PASS (>= --min-follow) or FAIL (exit 1).

A k2-slice that fits a laptop (real K2 layer sizes, hidden 7168, few experts):
    PYTHONPATH=src python3 benchmarks/spec_peak_check.py --device cpu --preset k2-slice \\
        --layers 3 --experts 16 --embed-scale 64      # the old fixed scale
    PYTHONPATH=src python3 benchmarks/spec_peak_check.py --device cpu --preset k2-slice \\
        --layers 3 --experts 16                       # calibrated
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time

from spec_decode_common import (  # noqa: E402 - benchmarks/ is sys.path[0]
    CTX,
    chain_fraction,
    make_engine,
    model_dir,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="k2-slice")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=None, help="routed experts a MoE layer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--embed-scale", type=float, default=None, help="fixed (default: calibrate)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--min-follow", type=float, default=0.98)
    args = ap.parse_args(argv)
    from k2serve.engine.sampling_params import SamplingParams

    CTX.update(device=args.device, peaked=True, embed_scale=args.embed_scale)
    path = model_dir(args.preset, args.layers, args.experts)
    try:
        t0 = time.perf_counter()
        eng = make_engine(path, args.batch)
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        for i in range(args.batch):
            eng.add_request(str(i), [rng.randrange(10, 2000) for _ in range(args.ctx)], params)
        outs: dict[str, list[int]] = {str(i): [] for i in range(args.batch)}
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id].extend(o.outputs[0].token_ids)
        n, total = chain_fraction(eng.succ, list(outs.values()))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    ok = n >= args.min_follow * total
    scale = "calibrated" if args.embed_scale is None else f"x{args.embed_scale:g}"
    experts = f", {args.experts} experts" if args.experts else ""
    print(f"{'PASS' if ok else 'FAIL'}: {args.preset} {args.layers} layers{experts}, embedding "
          f"{scale}: {n}/{total} greedy tokens follow the chain "
          f"({time.perf_counter() - t0:.0f}s)")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
