"""Served throughput end to end: `k2serve serve` on a k2-slice (dummy weights) and `k2serve bench`
against it, beside what the model benchmark says the same batches cost, in one run.

    PYTHONPATH=src python3 benchmarks/served.py [--layers 8] [--concurrency 1,16,64,256] [--quick]

1. Writes a config-only k2-slice INT4 directory (the real K2 layer sizes; the demo tokenizer, so
   the vocabulary is the demo's 2,048 tokens: the lm_head and embedding are smaller than K2's,
   every layer is real) and starts the server on it with `--load-format dummy`.
2. `k2serve bench` (completions, random 1K-token prompts, 256 output tokens, ignore_eos) at each
   concurrency C with 2C requests (C for C = 1 and --quick), then the same with a shared 4K-token
   prefix (prefix caching). Output tok/s, TTFT and ITL percentiles from the bench's JSON.
3. Stops the server, loads the same model in this process and times what those batches cost the
   model alone: a 1K-token prefill, and one decode step at batch C and context ~1K + 128 (CUDA
   graphs where the engine uses them). The model's tok/s for the workload = output tokens /
   (requests x prefill + output tokens / C x decode step); served / model = the fraction the
   server keeps (scheduling, detokenizing, streaming, and prefills stalling decodes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

DEMO = os.path.join(os.path.dirname(__file__), "..", "src", "k2serve", "demo", "kimi-k2-demo")
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja")


def write_model_dir(out: str, layers: int) -> dict:
    from k2serve.weights.presets import preset_config

    cfg = preset_config("k2-slice", "int4", layers=layers)
    with open(os.path.join(DEMO, "config.json")) as f:
        demo = json.load(f)
    for k in ("vocab_size", "bos_token_id", "eos_token_id"):
        cfg[k] = demo[k]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(DEMO, name), out)
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model_dir: str, port: int, max_seqs: int, log_path: str, extra: str = "", spy: str = ""
):
    cmd = [sys.executable, "-m", "k2serve.cli", "serve", "--model", model_dir,
           "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(max_seqs), "--max-model-len", "8192"]  # fmt: skip
    cmd += shlex.split(extra)
    if spy:  # the server under py-spy (its child: no ptrace rights needed), raw stacks by thread
        # SPY_MODE=--gil: only the thread holding the GIL is sampled (who serializes whom)
        cmd = [shutil.which("py-spy") or "py-spy", "record", "--nonblocking",
               os.environ.get("SPY_MODE", "--idle"), "--threads", "-r", "200", "-f", "raw",
               "--subprocesses", "-o", spy, "--", *cmd]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(proc, port, log_path, 600)
    return proc, log


def wait_healthy(proc, port: int, log_path: str, timeout_s: float) -> None:
    """Until the server at `port` answers /health (RuntimeError if it exits or times out)."""
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {open(log_path).read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not come up in {timeout_s:.0f} s")


def stop_server(proc, log) -> None:
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    for pid in kids.stdout.split():  # under py-spy: stop the server, py-spy then writes
        os.kill(int(pid), signal.SIGTERM)
    if not kids.stdout.split():
        proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def run_bench(port: int, conc: int, n: int, out_dir: str, prefix: bool) -> dict:
    name = f"{'prefix' if prefix else 'random'}_c{conc}.json"
    cmd = [sys.executable, "-m", "k2serve.cli", "bench", "--base-url",
           f"http://127.0.0.1:{port}", "--api", "completions", "--num-prompts", str(n),
           "--max-concurrency", str(conc), "--ignore-eos", "--temperature", "0",
           "--calibrate-input-len", "--num-warmups", "1", "--no-plot", "--disable-tqdm",
           "--save-result", "--result-dir", out_dir, "--result-filename", name]  # fmt: skip
    if prefix:
        cmd += ["--dataset-name", "prefix", "--prefix-len", "4096", "--random-input-len",
                "1024", "--output-len", "256", "--prefix-num-prefixes", "1",
                "--prefix-share-ratio", "1.0"]  # fmt: skip
    else:
        cmd += ["--dataset-name", "random", "--random-input-len", "1024",
                "--random-output-len", "256"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


@torch.inference_mode()
def model_costs(cfg: dict, batches: list[int], ctx: int = 1024 + 128) -> dict:
    """ms of a 1K-token prefill and of one decode step per batch, the engine's own path."""
    from k2serve.attention import allocate_kv_caches
    from k2serve.config import ModelConfig
    from k2serve.model.cuda_graph import DEFAULT_BUCKETS, DecodeGraphRunner
    from k2serve.testing.fidelity import decode_batch, prefix_prefill_batch  # noqa: F401
    from k2serve.weights.loader import load_model

    model = load_model(None, config=ModelConfig.from_hf(cfg), load_format="dummy",
                       dtype=torch.bfloat16, device="cuda", progress=False)  # fmt: skip
    ps = 16
    out = {}

    def timed(fn, iters=10):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / iters

    from k2serve.testing.fidelity import Batch

    pre = Batch("prefill 1K", [0], [1024], ps)
    kv = allocate_kv_caches(model.config, pre.num_pages, ps, torch.bfloat16, "cuda")
    ids, pos, md = pre.tensors("cuda", model.config.vocab_size)
    out["prefill_ms"] = timed(lambda: model.compute_logits(model(ids, pos, md, kv)[-1:]), 3)
    for bsz in batches:
        b = Batch(f"decode {bsz}", [ctx] * bsz, [1] * bsz, ps)
        kv = allocate_kv_caches(model.config, b.num_pages, ps, torch.bfloat16, "cuda")
        ids, pos, md = b.tensors("cuda", model.config.vocab_size)
        if bsz <= DEFAULT_BUCKETS[-1] and model.decode_graph_safe:
            runner = DecodeGraphRunner(model, kv, md.block_table.shape[1], buckets=(bsz,),
                                       with_logits=True)  # fmt: skip
            runner.capture()
            out[bsz] = timed(lambda r=runner, i=ids, p=pos, m=md: r.run(i, p, m))
        else:
            out[bsz] = timed(lambda i=ids, p=pos, m=md, k=kv: model.compute_logits(
                model(i, p, m, k)))  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--quick", action="store_true", help="C requests per concurrency C")
    ap.add_argument("--out", default=None, help="directory for the logs and bench JSON")
    ap.add_argument("--server-args", default="", help="more `k2serve serve` flags, one string")
    ap.add_argument("--py-spy", default="", help="record the server with py-spy into this file")
    ap.add_argument("--no-prefix", action="store_true", help="skip the shared-4K-prefix workload")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/served.py measures a GPU server: no CUDA device here")
        return 2
    concs = [int(c) for c in args.concurrency.split(",")]
    out_dir = args.out or tempfile.mkdtemp(prefix="k2served-")
    os.makedirs(out_dir, exist_ok=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, k2-slice INT4 {args.layers} layers "
          f"{args.server_args}")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        cfg = write_model_dir(d, args.layers)
        port = free_port()
        t0 = time.time()
        proc, log = start_server(
            d,
            port,
            max(concs),
            os.path.join(out_dir, "server.log"),
            args.server_args,
            args.py_spy,
        )
        print(f"server up in {time.time() - t0:.0f}s")
        served = {}
        try:
            for prefix in (False,) if args.no_prefix else (False, True):
                for c in concs:
                    n = c if (args.quick or c == 1) else 2 * c
                    served[(prefix, c)] = run_bench(port, c, n, out_dir, prefix)
                    r = served[(prefix, c)]
                    print(f"  {'prefix-4K' if prefix else 'random'} C={c}: "
                          f"{r['output_throughput']:.0f} out tok/s", flush=True)  # fmt: skip
        finally:
            stop_server(proc, log)
    costs = model_costs(cfg, concs)
    print(f"\nmodel alone: prefill 1K {costs['prefill_ms']:.1f} ms; decode step "
          + ", ".join(f"B={c} {costs[c]:.2f} ms" for c in concs))  # fmt: skip
    print(f"{'workload':10s} {'C':>4s} {'out tok/s':>10s} {'model tok/s':>11s} "
          f"{'served/model':>12s} {'TTFT p50/p99 ms':>16s} {'ITL p50/p99 ms':>15s}")  # fmt: skip
    nan = float("nan")
    for (prefix, c), r in served.items():
        n_req = r.get("completed", 0) or 1
        out_tok = r.get("total_output_tokens", n_req * 256)
        model_s = (n_req * costs["prefill_ms"] + out_tok / c * costs[c]) / 1e3
        model_tps = out_tok / model_s
        print(f"{'prefix-4K' if prefix else 'random':10s} {c:4d} {r['output_throughput']:10.0f} "
              f"{model_tps:11.0f} {r['output_throughput'] / model_tps:12.2f} "
              f"{r.get('median_ttft_ms', nan):7.0f}/{r.get('p99_ttft_ms', nan):<8.0f}"
              f"{r.get('median_itl_ms', nan):7.1f}/{r.get('p99_itl_ms', nan):<7.1f}")  # fmt: skip
    print("(model tok/s counts every prompt as a 1K prefill, also the prefix-cached ones, so")
    print(" served/model above 1 there is the prefix cache at work)")
    print(f"logs and bench JSON: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
