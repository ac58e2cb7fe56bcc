"""Speculative decoding on one GPU: the cost of a verify step, and decode speed at a controlled
acceptance length. k2-slice INT4 (real K2 sizes, dummy weights), the engine's own path.

Run (one H100/H200, from the repo root):
    PYTHONPATH=src python3 benchmarks/spec_decode_gpu.py                  # 8 layers, both parts
    PYTHONPATH=src python3 benchmarks/spec_decode_gpu.py --layers 3 --parts verify

Parts:
- verify: B requests at context --ctx each; one engine step where every request carries K drafts
  (1 + K = 2..6 new tokens each, one flat batch, logits at every position, sampling of every
  row) against the 1-token decode step of the same batch (CUDA graph replay, as served), at
  B = 1, 8, 32. Printed: ms per step, and the ratio to the 1-token step. The verify step runs
  eagerly (the decode CUDA graphs take one token per sequence), so the ratio includes the
  graph's advantage too; the eager 1-token step is printed for reference.
- e2e: decode tok/s at B = 1 and 16 with drafts whose acceptance is controlled: the drafter
  proposes the target's own greedy continuation (recorded in a first run without speculation),
  each draft token kept with probability p and otherwise replaced by a wrong one, so the
  acceptance length is 1 + p + ... + p^K; p is set for about 2.0 / 2.7 / 3.3 at K = 4. Against
  speculation off in the same run; the outputs are checked equal to it (greedy, exact).
Timings: median of --iters steps after warm-up (torch.cuda.synchronize around each).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

DEMO = os.path.join(os.path.dirname(__file__), "..", "src", "k2serve", "demo", "kimi-k2-demo")


def model_dir(preset: str, layers: int) -> str:
    from k2serve.weights.presets import preset_config

    out = tempfile.mkdtemp(prefix="k2-spec-")
    cfg = preset_config(preset, "int4", layers=layers)
    with open(os.path.join(DEMO, "config.json")) as f:
        demo = json.load(f)
    for k in ("vocab_size", "bos_token_id", "eos_token_id"):
        cfg[k] = demo[k]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(DEMO, name), out)
    return out


DEVICE = {"name": "cuda"}  # set once by main (--device); read by make_engine / _sync


def _sync() -> None:
    if DEVICE["name"] == "cuda":
        torch.cuda.synchronize()


def make_engine(path: str, max_seqs: int, spec=None, enforce_eager=False):
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=path, load_format="dummy", dtype="bfloat16", device=DEVICE["name"],
        max_model_len=4096, max_num_seqs=max_seqs, max_num_batched_tokens=8192,
        num_kv_pages=4096, page_size=16,
        enforce_eager=enforce_eager, speculative_config=spec,
    ))  # fmt: skip


def _sync_time(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t) * 1e3


def verify_step(eng, k: int, eager: bool) -> None:
    """One step of every running request carrying k drafts (0: the plain decode step); no
    update, so the same positions are computed again each time."""
    sch, runner = eng.scheduler, eng.runner
    for r in sch.running:
        r.spec_token_ids = [r.all_token_ids[-1]] * k
    out = sch.schedule()
    graph = runner.graph_runner
    if eager:
        runner.graph_runner = None
    try:
        runner.execute(out, eng.kv)
    finally:
        runner.graph_runner = graph
    for r in sch.running:
        r.spec_token_ids = []


def verify_costs(path: str, batches: list[int], ctx: int, iters: int) -> None:
    from k2serve.engine.sampling_params import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 5}
    print(f"## verify step cost, context {ctx}")
    print("| B | 1-token step (graph) | 1-token eager | " +
          " | ".join(f"1+K={k + 1}" for k in range(1, 6)) + " |")  # fmt: skip
    print("|---" * 8 + "|")
    for B in batches:
        eng = make_engine(path, max(B, 1), spec)
        rng = random.Random(B)
        params = SamplingParams(temperature=0, max_tokens=4096 - ctx - 64, ignore_eos=True,
                                speculative_decoding=False)  # fmt: skip
        for i in range(B):
            eng.add_request(str(i), [rng.randrange(10, 2000) for _ in range(ctx)], params)
        while any(r.num_output_tokens == 0 for r in eng._requests.values()):
            eng.step()  # prefill
        row = []
        for k, eager in [(0, False), (0, True)] + [(k, False) for k in range(1, 6)]:
            for _ in range(3):
                verify_step(eng, k, eager)
            step = functools.partial(verify_step, eng, k, eager)
            row.append(statistics.median(_sync_time(step) for _ in range(iters)))
        base = row[0]
        cells = [f"{row[0]:.2f} ms", f"{row[1]:.2f} ms"]
        cells += [f"{t:.2f} ms ({t / base:.2f}x)" for t in row[2:]]
        print(f"| {B} | " + " | ".join(cells) + " |")
        eng.abort_request([str(i) for i in range(B)])
        while eng.has_unfinished_requests():
            eng.step()
        eng.check_integrity()
        del eng


def controlled(eng, ref: dict[str, list[int]], p: float, seed: int = 0) -> None:
    """Drafts from the recorded greedy continuation, each kept with probability p."""
    rng = random.Random(seed)
    vocab = eng.vocab_size

    def propose(req, k):
        out = ref[req.request_id]
        i = req.num_output_tokens
        good = out[i : i + k]
        return [t if rng.random() < p else (t + 1) % vocab for t in good]

    eng.drafter.proposer.propose = propose


def run_decode(eng, prompts, n_out: int):
    from k2serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    while any(r.num_output_tokens == 0 for r in eng._requests.values()):
        eng.step()  # prefill, not timed
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for r in eng._requests.values():
        outs[r.request_id] = list(r.output_token_ids)
    _sync()
    t = time.perf_counter()
    n = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].extend(o.outputs[0].token_ids)
            n += len(o.outputs[0].token_ids)
    _sync()
    eng.check_integrity()
    return outs, n / (time.perf_counter() - t)


def e2e(path: str, batches: list[int], ctx: int, n_out: int, k: int) -> None:
    print(f"## decode tok/s with controlled acceptance, K={k}, context {ctx}, {n_out} tokens")
    print("| B | p | acceptance length | tok/s | speculation off tok/s | speedup | outputs equal |")
    print("|---|---|---|---|---|---|---|")
    for B in batches:
        rng = random.Random(B)
        prompts = [[rng.randrange(10, 2000) for _ in range(ctx)] for _ in range(B)]
        off = make_engine(path, B)
        ref, tps_off = run_decode(off, prompts, n_out)
        del off
        spec = {"method": "ngram", "num_speculative_tokens": k}
        for p in (0.5, 0.7, 0.8):
            eng = make_engine(path, B, spec)
            controlled(eng, ref, p)
            out, tps = run_decode(eng, prompts, n_out)
            # bf16: a verify step's batch shape differs from a decode step's, so on dummy
            # weights (near-uniform logits) a near-tie can flip; once a request's output leaves
            # `ref`, its drafts (taken from `ref`) are all wrong: report how many agree, and the
            # mean length of the agreeing prefix
            same = sum(out[rid] == ref[rid] for rid in ref)
            agree = [next((i for i, (a, r) in enumerate(zip(out[rid], ref[rid], strict=False))
                           if a != r), len(ref[rid])) for rid in ref]  # fmt: skip
            acc = eng.drafter.stats.mean_acceptance_length
            first = sum(agree) / len(agree)
            print(f"| {B} | {p} | {acc:.2f} | {tps:.1f} | {tps_off:.1f} | {tps / tps_off:.2f}x "
                  f"| {same}/{len(ref)} (first {first:.0f} tokens) |")  # fmt: skip
            del eng


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--parts", default="verify,e2e")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--preset", default="k2-slice", help="tiny: a CPU smoke run of the script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32", help="verify part; e2e uses 1,16")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu --preset tiny for a smoke run)", file=sys.stderr)
        return 2
    DEVICE["name"] = args.device
    path = model_dir(args.preset, args.layers)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# {dev}, {args.preset} INT4 {args.layers} layers (dummy weights), "
          f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
    try:
        parts = args.parts.split(",")
        if "verify" in parts:
            batches = [int(b) for b in args.batches.split(",")]
            verify_costs(path, batches, args.ctx, args.iters)
        if "e2e" in parts:
            e2e(path, [1, 16], args.ctx, args.out_tokens, args.k)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
