"""The EAGLE-3 draft step with and without its CUDA graphs, in one engine per head layout.

k2-slice INT4 target (real K2 sizes, dummy weights, peaked as in spec_decode_gpu.py), vocabulary
163840, draft heads at full K2.5 sizes (draft vocabulary 32000), K = 3: the draft step is one
head forward over the step's kept rows and 2 one-row steps (engine.spec_decode.eagle). Each
batch size is timed twice on the same engine and requests: the captured draft graphs (the
default) and the eager head (`prop.graphs = None`, what K2SERVE_EAGLE_GRAPHS=0 gives), against
the whole engine step. Medians of --iters steps (synchronised around each).

    PYTHONPATH=src python3 benchmarks/eagle_graphs_gpu.py --layers 3 --batches 1,16
    PYTHONPATH=src python3 benchmarks/eagle_graphs_gpu.py --device cpu --preset tiny \\
        --layers 2 --ctx 32 --iters 3 --batches 1,2    # a CPU smoke run (eager only)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
import traceback

import torch
from spec_decode_common import (  # noqa: E402 - benchmarks/ is sys.path[0]
    CTX,
    _free,
    _sync_time,
    k25_vocab,
    make_engine,
    model_dir,
    time_propose,
)


def _time_draft(eng, prop, iters: int) -> tuple[float, float]:
    """(median draft step ms, median engine step ms) over `iters` steps."""
    times = time_propose(prop)
    try:
        steps = [_sync_time(eng.step) for _ in range(iters)]
    finally:
        del prop.propose  # the wrapper is an instance attribute over the method
    return statistics.median(times[2:] or times), statistics.median(steps[2:] or steps)


def run_head(path: str, cfg: dict, layout: str, batches: list[int], ctx: int, iters: int):
    from k2serve.config import ModelConfig
    from k2serve.engine.sampling_params import SamplingParams
    from k2serve.weights.eagle3 import write_eagle3_checkpoint

    d = os.path.join(path, f"draft-{layout}")
    eng = None
    try:
        write_eagle3_checkpoint(d, ModelConfig.from_hf(cfg), layout, draft_vocab_size=32000)
        spec = {"method": "eagle3", "model": d, "num_speculative_tokens": 3}
        eng = make_engine(path, max(batches), spec)
        prop = eng.drafter.eagle
        graphs = prop.graphs
        where = f"graphs for {list(graphs.buckets)}" if graphs is not None else "no graphs"
        print(f"# {layout} head: {where}", flush=True)
        for B in batches:
            rng = random.Random(B)
            params = SamplingParams(temperature=0, max_tokens=2 * iters + 8, ignore_eos=True)
            for i in range(B):
                p = [rng.randrange(10, 2000) for _ in range(ctx)]
                eng.add_request(f"{layout}-{B}-{i}", p, params)
            while any(r.num_output_tokens == 0 for r in eng._requests.values()):
                eng.step()
            res = {}
            for mode in ("graphs", "eager"):
                if mode == "graphs" and graphs is None:
                    continue
                prop.graphs = graphs if mode == "graphs" else None
                res[mode] = _time_draft(eng, prop, iters)
            prop.graphs = graphs
            while eng.has_unfinished_requests():
                eng.step()
            e = res["eager"]
            for mode, (dm, sm) in res.items():
                gain = f"{e[0] / dm:.2f}x" if mode == "graphs" else "-"
                print(f"| {layout} | {B} | {mode} | {dm:.2f} | {sm:.2f} | {dm / sm:.2f} | "
                      f"{gain} |", flush=True)  # fmt: skip
    except Exception:  # noqa: BLE001 - report, go on to the next head
        traceback.print_exc()
        print(f"FAIL: draft {layout}", flush=True)
    finally:
        del eng
        shutil.rmtree(d, ignore_errors=True)
        _free()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--heads", default="mla,llama")
    ap.add_argument("--preset", default="k2-slice")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --preset tiny for a smoke run)", file=sys.stderr)
        return 2
    CTX["device"], CTX["peaked"] = args.device, True
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"## EAGLE-3 draft step (K=3) with / without its CUDA graphs: {dev}, {args.preset} "
          f"INT4 {args.layers} layers, vocabulary 163840, draft vocabulary 32000, context "
          f"{args.ctx}, {time.strftime('%Y-%m-%d')}")  # fmt: skip
    print("| head | B | draft | draft step ms | engine step ms | draft / step | graph gain |")
    print("|---|---|---|---|---|---|---|", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    path = model_dir(args.preset, args.layers)
    try:
        cfg = k25_vocab(path)
        for layout in args.heads.split(","):
            run_head(path, cfg, layout, batches, args.ctx, args.iters)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
