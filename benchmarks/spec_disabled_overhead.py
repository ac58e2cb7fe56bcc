"""What a drafter costs per step while disable_by_batch_size has turned speculation off: B
requests decoding in an engine without a drafter and in one with an n-gram drafter that is off
(B > disable_by_batch_size), same weights and prompts, runs alternating. Per decode step:
the whole step, the runner's part (prepare + forward + sample, `runner.execute`) and the rest
(scheduler, drafter, detokenisation, outputs: host only); medians of each run, then the median
and min over runs. A shared, noisy CPU moves the forward a lot; the host part is the one that
a disabled drafter could add to.

    PYTHONPATH=src python3 benchmarks/spec_disabled_overhead.py --device cpu --preset tiny
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics
import sys
import time

from spec_decode_common import CTX, _sync, make_engine, model_dir, time_execute  # noqa: E402


def timed_run(eng, prompts, n_out: int, tag: str) -> tuple[float, float, list[list[int]]]:
    """(median ms a decode step, median ms of its runner.execute, outputs)."""
    from k2serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    while any(r.num_output_tokens == 0 for r in eng._requests.values()):
        eng.step()  # prefill, not timed
    spent = time_execute(eng)
    steps: list[float] = []
    outs: dict[str, list[int]] = {}
    gc.collect()
    try:
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            _sync()
            steps.append(time.perf_counter() - t)
    finally:
        del eng.runner.execute  # the bound method again
    eng.check_integrity()
    return statistics.median(steps) * 1e3, statistics.median(spent) * 1e3, list(outs.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--disable-by-batch-size", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args(argv)
    CTX.update(device=args.device, peaked=True, embed_scale=None)
    path = model_dir(args.preset, args.layers)
    try:
        off = make_engine(path, args.batch)
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4,
                "disable_by_batch_size": args.disable_by_batch_size}  # fmt: skip
        on = make_engine(path, args.batch, spec)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 2000) for _ in range(args.ctx)] for _ in range(args.batch)]
    res: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    outs = {}
    for eng, name in ((off, "off"), (on, "on")):  # warm-up
        outs[name] = timed_run(eng, prompts, 8, f"warm-{name}")[2]
    for r in range(args.reps):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            step, run, o = timed_run(off if name == "off" else on, prompts, args.tokens, f"{r}")
            res[name].append((step, run))
            outs[name] = o
    drafts = on.drafter.stats.num_drafts
    print(f"# {args.device}, {args.preset} {args.layers} layers, B={args.batch}, "
          f"disable_by_batch_size={args.disable_by_batch_size}, {args.tokens} tokens, "
          f"{args.reps} runs each alternating; drafts made: {drafts}")  # fmt: skip
    print("| engine | step ms (median of runs, min) | runner.execute ms | host rest ms |")
    print("|---|---|---|---|")
    rest = {}
    for name in ("off", "on"):
        steps = [s for s, _ in res[name]]
        runs = [x for _, x in res[name]]
        rest[name] = [s - x for s, x in res[name]]
        label = "no drafter" if name == "off" else "n-gram drafter, off"
        print(f"| {label} | {statistics.median(steps):.2f} ({min(steps):.2f}) | "
              f"{statistics.median(runs):.2f} ({min(runs):.2f}) | "
              f"{statistics.median(rest[name]):.3f} ({min(rest[name]):.3f}) |")  # fmt: skip
    extra = statistics.median(rest["on"]) - statistics.median(rest["off"])
    same = outs["on"] == outs["off"]
    print(f"(host time a step added by the disabled drafter: {extra * 1e3:+.0f} us; "
          f"outputs equal: {same})")  # fmt: skip
    return 0 if same and drafts == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
