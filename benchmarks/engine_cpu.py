"""CPU throughput of the engine (LLMEngine.step loop, no server) at several concurrencies.

Run from the repo root:
    .venv/bin/python benchmarks/engine_cpu.py                    # tiny preset, made in a temp dir
    .venv/bin/python benchmarks/engine_cpu.py --model DIR --concurrency 1,16 --output-len 64

Closed loop: `concurrency` requests are in flight at once; a finished one is replaced until
`num_prompts` have been served. Prompts are random token ids of `input_len`, outputs exactly
`output_len` tokens (greedy, ignore_eos). Reports output tokens/s, total (prompt + output)
tokens/s, and the mean time per step and batch size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch


def run_one(engine, concurrency: int, num_prompts: int, input_len: int, output_len: int, seed=0):
    from k2serve.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = [
        [rng.randrange(10, vocab - 300) for _ in range(input_len)] for _ in range(num_prompts)
    ]
    next_i = 0
    in_flight = 0
    out_tokens = steps = 0
    t0 = time.perf_counter()
    while next_i < num_prompts or engine.has_unfinished_requests():
        while in_flight < concurrency and next_i < num_prompts:
            engine.add_request(f"b{concurrency}-{next_i}", prompts[next_i], params)
            next_i += 1
            in_flight += 1
        for out in engine.step():
            out_tokens += sum(len(o.token_ids) for o in out.outputs)
            in_flight -= out.finished
        steps += 1
    dt = time.perf_counter() - t0
    engine.check_integrity()
    assert out_tokens == num_prompts * output_len, out_tokens
    return {
        "concurrency": concurrency,
        "requests": num_prompts,
        "seconds": dt,
        "output_tok_s": out_tokens / dt,
        "total_tok_s": (out_tokens + num_prompts * input_len) / dt,
        "ms_per_step": dt / steps * 1e3,
        "steps": steps,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny preset)")
    ap.add_argument("--preset", default="tiny", help="make-checkpoint preset when no --model")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 2 x concurrency")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine

    model = args.model
    if model is None:
        from k2serve.weights.make_checkpoint import make_checkpoint
        from k2serve.weights.presets import preset_config

        model = tempfile.mkdtemp(prefix=f"k2-{args.preset}-")
        make_checkpoint(model, preset_config(args.preset, "bf16"), progress=False)
    levels = [int(c) for c in args.concurrency.split(",")]
    max_len = args.input_len + args.output_len
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=args.dtype,
            device="cpu",
            max_model_len=max_len,
            max_num_seqs=max(levels),
            max_num_batched_tokens=max(2048, max_len),
            enable_prefix_caching=False,  # random prompts: nothing to share; measure compute
            num_kv_pages=max(levels) * (-(-max_len // 16)) + 8,
        )
    )
    run_one(engine, 1, 1, 8, 4)  # warm-up
    print(
        f"model={model} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"input_len={args.input_len} output_len={args.output_len}"
    )
    print("| concurrency | requests | seconds | output tok/s | total tok/s | ms/step |")
    print("|---|---|---|---|---|---|")
    for c in levels:
        r = run_one(engine, c, args.num_prompts or 2 * c, args.input_len, args.output_len)
        print(
            f"| {c} | {r['requests']} | {r['seconds']:.2f} | {r['output_tok_s']:.1f} | "
            f"{r['total_tok_s']:.1f} | {r['ms_per_step']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
