"""The server's own time per step, on any machine: `k2serve serve` on a tiny model whose forward
costs given GPU step times (a GIL-free sleep), `k2serve bench` against it, and the ideal of
`served_sim.py` (an engine costing only those times) for the same request pattern.

    PYTHONPATH=src python3 benchmarks/served_host.py [--concurrency 16,256] [--modes async,sync]
        [--prefill-1k-ms 25.8 --decode-ms 1:1.75,16:5.23,256:22.39] [--server-args "..."]

Default step times: the H100 k2-slice INT4 6 layers' (benchmarks/RESULTS.md "Served throughput",
wave 8, after the merges). Each step's forward sleeps decode(B) (interpolated between the given
batch sizes, as served_sim.py) plus its prefill tokens at the 1K prefill's per-token cost;
everything else is the real engine and server: scheduling, batch preparation, the sampler (on
the CPU here, over zero logits: the lm_head's GPU time is part of the step times), detokenizing,
streaming. The bench: 2C requests at concurrency C (one at C=1), random 1K-token prompts, 256
output tokens, ignore_eos (served.py's pattern). Modes: async = `--async-scheduling`, sync =
`--no-async-scheduling`. Prints out tok/s, TTFT and ITL p50 / p99 and the ratio to the simulated
ideal; `--out DIR` keeps the logs and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from served import (  # noqa: E402
    DEMO,
    TOKENIZER_FILES,
    free_port,
    run_bench,
    stop_server,
    wait_healthy,
)
from served_sim import simulate  # noqa: E402

DEFAULT_DECODE = "1:1.75,16:5.23,256:22.39"


def parse_decode(s: str) -> dict[int, float]:
    return {int(b): float(ms) for b, ms in (p.split(":") for p in s.split(","))}


def write_model_dir(out: str) -> None:
    """A config-only tiny model (loaded with --load-format dummy) with the demo tokenizer."""
    import shutil

    from k2serve.weights.presets import preset_config

    cfg = preset_config("tiny", "bf16")
    with open(os.path.join(DEMO, "config.json")) as f:
        demo = json.load(f)
    for k in ("vocab_size", "bos_token_id", "eos_token_id"):
        cfg[k] = demo[k]
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), 4096)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(DEMO, name), out)


def serve_child(argv: list[str]) -> int:
    """`k2serve serve` with DeepseekV3ForCausalLM.forward replaced by a sleep of the step's
    cost (K2SERVE_HOST_PREFILL_MS, K2SERVE_HOST_DECODE_MS); runs in its own process."""
    import numpy as np
    import torch

    from k2serve.model.deepseek_v3 import DeepseekV3ForCausalLM

    pre_ms = float(os.environ["K2SERVE_HOST_PREFILL_MS"])
    dec = parse_decode(os.environ["K2SERVE_HOST_DECODE_MS"])
    xs = sorted(dec)
    ys = [dec[b] for b in xs]
    orig = DeepseekV3ForCausalLM.forward
    # K2SERVE_HOST_TRACE=FILE: each forward's (start, end, tokens, decodes), written at exit
    trace_path = os.environ.get("K2SERVE_HOST_TRACE")
    trace: list | None = [] if trace_path else None
    if trace_path:
        import atexit

        from k2serve.engine.pipeline import StepWorker
        from k2serve.engine.runner import ModelRunner

        marks: list = []  # (what, time): 0 = submitted, 1 = run() entered, 2 = run() returned
        sub, run = StepWorker.submit, ModelRunner.run

        def submit(self, *a, **kw):
            marks.append((0, time.perf_counter()))
            return sub(self, *a, **kw)

        def run_(self, *a, **kw):
            marks.append((1, time.perf_counter()))
            try:
                return run(self, *a, **kw)
            finally:
                marks.append((2, time.perf_counter()))

        StepWorker.submit, ModelRunner.run = submit, run_

        def dump():
            np.savetxt(trace_path, np.array(trace or [[0, 0, 0, 0]]))
            np.savetxt(trace_path + ".marks", np.array(marks or [[0, 0]]))

        atexit.register(dump)
    zeros: dict[str, torch.Tensor] = {}  # made once: a fresh large zeros costs ms (page faults)

    def zero_rows(name: str, rows: int, cols: int, dtype) -> torch.Tensor:
        buf = zeros.get(name)
        if buf is None or buf.shape[0] < rows:
            buf = zeros[name] = torch.zeros(max(rows, 8192), cols, dtype=dtype)
        return buf[:rows]

    def forward(self, input_ids, positions, attn_metadata=None, kv_caches=None, **kw):
        md = attn_metadata
        if md is None:  # start-up passes without a batch: the real forward
            return orig(self, input_ids, positions, attn_metadata=md, kv_caches=kv_caches, **kw)
        T = input_ids.shape[0]
        nd = md.num_decodes
        ms = float(np.interp(nd, xs, ys)) if nd else 0.0
        t0 = time.perf_counter()
        time.sleep((ms + (T - nd) / 1024 * pre_ms) / 1e3)  # releases the GIL, as a GPU wait
        if trace is not None:
            trace.append((t0, time.perf_counter(), T, nd))
        return zero_rows("hidden", T, self.config.hidden_size, torch.bfloat16)

    def compute_logits(self, hidden):  # on the GPU, part of the given step times
        return zero_rows("logits", hidden.shape[0], self.config.vocab_size, torch.float32)

    DeepseekV3ForCausalLM.forward = forward  # this process only: the cost model
    DeepseekV3ForCausalLM.compute_logits = compute_logits
    from k2serve.cli import main

    return main(argv)


def start(model_dir: str, port: int, log_path: str, args, mode: str):
    # one intra-op thread: the server's few torch CPU ops stand in for GPU launches (with more,
    # the pool's spinning threads take the cores from the engine's Python on a small machine)
    env = dict(os.environ, K2SERVE_HOST_PREFILL_MS=str(args.prefill_1k_ms),
               K2SERVE_HOST_DECODE_MS=args.decode_ms, OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), "--serve-child", "serve", "--model",
           model_dir, "--load-format", "dummy", "--dtype", "bfloat16", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "256",
           "--max-model-len", "2048", "--async-scheduling" if mode == "async"
           else "--no-async-scheduling"]  # fmt: skip
    cmd += shlex.split(args.server_args)
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    wait_healthy(proc, port, log_path, 300)
    return proc, log


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--serve-child":
        return serve_child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="16,256")
    ap.add_argument("--modes", default="async,sync", help="async, sync or both, in this order")
    ap.add_argument("--prefill-1k-ms", type=float, default=25.8)
    ap.add_argument("--decode-ms", default=DEFAULT_DECODE, help="batch:ms,... (GPU step times)")
    ap.add_argument("--budget", type=int, default=2048, help="the server's step token budget")
    ap.add_argument("--server-args", default="", help="more `k2serve serve` flags")
    ap.add_argument("--out", default=None, help="keep the server logs and bench JSON here")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="served_host_")
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(out, "model")
    os.makedirs(model_dir, exist_ok=True)
    write_model_dir(model_dir)
    if "--max-num-batched-tokens" not in args.server_args:
        args.server_args += f" --max-num-batched-tokens {args.budget}"
    dec = parse_decode(args.decode_ms)
    concs = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for mode in args.modes.split(","):
        port = free_port()
        proc, log = start(model_dir, port, os.path.join(out, f"server_{mode}.log"), args, mode)
        try:
            for C in concs:
                n = 2 * C if C > 1 else 1
                r = run_bench(port, C, n, out, prefix=False)
                os.replace(os.path.join(out, f"random_c{C}.json"),
                           os.path.join(out, f"{mode}_c{C}.json"))  # fmt: skip
                ideal, _, ideal_ttft = simulate(C, args.budget, args.prefill_1k_ms, dec)
                rows.append((mode, C, r, ideal, ideal_ttft))
        finally:
            stop_server(proc, log)
    print(f"served_host: step times prefill 1K {args.prefill_1k_ms} ms, decode {args.decode_ms};"
          f" budget {args.budget}; {out}")  # fmt: skip
    print("mode   C    out tok/s  ideal  ratio  TTFT p50/p99 ms (ideal p50)  ITL p50/p99 ms")
    for mode, C, r, ideal, ideal_ttft in rows:
        print(f"{mode:5s} {C:4d} {r['output_throughput']:10.0f} {ideal:6.0f} "
              f"{r['output_throughput'] / ideal:6.2f}  "
              f"{r['median_ttft_ms']:6.0f} / {r['p99_ttft_ms']:6.0f} ({ideal_ttft:5.0f})"
              f"        {r['median_itl_ms']:5.1f} / {r['p99_itl_ms']:5.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
