"""Decode step time with a JSON-schema constraint vs without, at batch 1 and 16, in one run.

Run from the repo root:
    python benchmarks/structured_overhead.py                  # dev CPU, the demo checkpoint
    python benchmarks/structured_overhead.py --model DIR      # any checkpoint dir (a k2-slice)
    python benchmarks/structured_overhead.py --slice --quick  # GPU: k2-slice INT4, dummy weights,
                                                              # 163,840-token vocab, < 2 min on H100

On a GPU box without xgrammar (and pydantic), carry the wheels: here, download them for its
Python (3.12) into .whl/ (git-ignored),
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
        pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
and there run
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site:src python3 benchmarks/structured_overhead.py --slice --quick

What is timed: `LLMEngine.step()` (schedule, model, sampler, outputs) over decode-only steps
with the batch full (closed loop: a finished request is replaced, and steps that prefill a
replacement are not counted). The constrained run gives every request the same JSON schema
(xgrammar; one matcher per sequence, bitmask filled on the host and applied on the device); the
free run is the same engine, same prompts, same sampling (temperature 1, seeded) without it.
Prints both median step times (wall), their ratio and the overhead in percent per batch size,
the ratio of the fastest steps and the ratio of the process CPU time per step (both robust to
other jobs on a shared CPU), and the CPU time of the grammar part of the sampler (matcher sync,
bitmask fill, copy and apply launch) per step. On a dedicated GPU box the wall ratio is the
figure.
Target: overhead <= 10% at batch 16 on the GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "rating": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "cast": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
                "required": ["name", "role"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "year", "cast"],
    "additionalProperties": False,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class MaskTimer:
    """Wraps the sampler's grammar step to time its host part (fill + launch of the apply)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.inner = sampler._apply_grammars
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, logits, reqs):
        t = time.thread_time()  # CPU time of this thread: not inflated by other jobs
        rows = self.inner(logits, reqs)
        self.seconds += time.thread_time() - t
        self.calls += 1
        return rows


def run(engine, batch: int, steps: int, constrained: bool, input_len: int, seed: int = 0):
    from k2serve.engine.sampling_params import SamplingParams
    from k2serve.structured import StructuredOutputsParams

    rng = random.Random(seed)
    vocab = min(engine.vocab_size, engine.tokenizer.num_base_tokens)
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    runner = engine.runner
    timer = MaskTimer(runner.sampler)
    runner.sampler._apply_grammars = timer
    times: list[float] = []
    cpu: list[float] = []
    n = 0
    try:
        while len(times) < steps:
            while len(engine.scheduler.running) + len(engine.scheduler.waiting) < batch:
                prompt = [rng.randrange(10, vocab) for _ in range(input_len)]
                params = SamplingParams(
                    temperature=1.0,
                    seed=seed + n,
                    max_tokens=engine.max_model_len - input_len,
                    ignore_eos=not constrained,
                    structured_outputs=so,
                )
                engine.add_request(f"{'c' if constrained else 'f'}{batch}-{n}", prompt, params)
                n += 1
            decode_only = not engine.scheduler.waiting and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running
            )
            _sync(engine.device)
            t, c = time.perf_counter(), time.process_time()
            engine.step()
            _sync(engine.device)
            if decode_only and len(engine.scheduler.running) >= batch - 1:
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
    finally:
        runner.sampler._apply_grammars = timer.inner
        engine.abort_request([f"{'c' if constrained else 'f'}{batch}-{i}" for i in range(n)])
        while engine.has_unfinished_requests():
            engine.step()
        engine.check_integrity()
    return times, cpu, timer.seconds, timer.calls


def build_engine(args):
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    max_len = args.input_len + args.max_output
    common = dict(
        device=device,
        max_model_len=max_len,
        max_num_seqs=max(args.batches),
        enable_prefix_caching=False,
        num_kv_pages=(max(args.batches) + 4) * (-(-max_len // 16)) + 8,
    )
    if not args.slice:
        model = args.model
        if model is None:
            from k2serve.demo import demo_path

            model = os.fspath(demo_path())
        cfg = EngineConfig(model=model, dtype=args.dtype, **common)
        return LLMEngine(cfg), f"{model}"
    from k2serve.config import ModelConfig
    from k2serve.tokenizer import KimiTokenizer, write_tokenizer_files
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    mcfg = ModelConfig.from_hf(preset_config("k2-slice", args.format, layers=args.layers))
    model = load_model(None, load_format="dummy", config=mcfg, device=device, progress=False)
    tok_dir = tempfile.mkdtemp(prefix="k2-slice-tok-")
    write_tokenizer_files(tok_dir, mcfg.vocab_size)
    tok = KimiTokenizer.from_dir(tok_dir)
    cfg = EngineConfig(dtype="auto", **common)
    return (
        LLMEngine(cfg, model=model, tokenizer=tok),
        f"k2-slice {args.format} {args.layers} layers (dummy weights)",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the demo)")
    ap.add_argument("--slice", action="store_true", help="k2-slice with dummy weights (GPU)")
    ap.add_argument("--format", default="int4", help="k2-slice format (int4, fp8, bf16)")
    ap.add_argument("--layers", type=int, default=4, help="k2-slice layers")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,16", help="batch sizes")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per run")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=480)
    ap.add_argument("--quick", action="store_true", help="fewer steps (< 2 minutes on an H100)")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    args.batches = [int(b) for b in args.batch.split(",")]
    steps = args.steps or (30 if args.quick else 100)

    t0 = time.perf_counter()
    engine, what = build_engine(args)
    backend = engine.grammar_backend()
    t = time.perf_counter()
    from k2serve.structured import StructuredOutputsParams

    backend.compile(StructuredOutputsParams(json=SCHEMA))
    compile_ms = (time.perf_counter() - t) * 1e3
    dev = engine.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU x{os.cpu_count()}"
    print(f"model: {what}; vocab {engine.vocab_size}; device {dev} ({name})")
    print(
        f"setup {time.perf_counter() - t0:.1f}s; schema compile {compile_ms:.1f} ms; {steps} steps"
    )
    run(engine, 1, 3, False, args.input_len)  # warm-up (graphs, kernels)
    run(engine, 1, 3, True, args.input_len)
    print(
        "| batch | free ms/step | json-schema ms/step | ratio | overhead | min-step ratio "
        "| CPU-time ratio | mask host ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rounds = 3  # free and constrained alternate, so drifting machine load hits both alike
    for b in args.batches:
        free_t, cons_t, free_c, cons_c, mask_s, mask_n = [], [], [], [], 0.0, 0
        for r in range(rounds):
            times, cpu, _, _ = run(engine, b, -(-steps // rounds), False, args.input_len, seed=r)
            free_t, free_c = free_t + times, free_c + cpu
            times, cpu, sec, calls = run(
                engine, b, -(-steps // rounds), True, args.input_len, seed=r
            )
            cons_t, cons_c = cons_t + times, cons_c + cpu
            mask_s, mask_n = mask_s + sec, mask_n + calls
        free = statistics.median(free_t) * 1e3
        cons = statistics.median(cons_t) * 1e3
        min_ratio = min(cons_t) / min(free_t)  # robust to load spikes on a shared machine
        cpu_ratio = statistics.median(cons_c) / statistics.median(free_c)
        mask_ms = mask_s / max(mask_n, 1) * 1e3
        print(
            f"| {b} | {free:.2f} | {cons:.2f} | {cons / free:.3f} | "
            f"{(cons / free - 1) * 100:+.1f}% | {min_ratio:.3f} | {cpu_ratio:.3f} | {mask_ms:.3f} |"
        )
    print(f"total {time.perf_counter() - t0:.1f}s")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
