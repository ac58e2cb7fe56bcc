"""The host KV tier (issue 27) on a multi-turn agent trace whose working set is several times the
device KV pool: TTFT p50/p99 (first turns and returning turns apart), output tok/s and step time
p99 with the tier off and on, and the host<->device copy bandwidth measured in the same run.

Run from the repo root (dummy weights of a preset, no checkpoint needed):
    # CPU, small (the tier forced on with the K2SERVE_KV_HOST_TIER_ON_CPU test knob)
    PYTHONPATH=src .venv/bin/python benchmarks/kv_tier.py --device cpu
    # one GPU, the k2-slice (the issue's trace: 32 sessions x 32K context, turns of 500 tokens)
    PYTHONPATH=src .venv/bin/python benchmarks/kv_tier.py --device cuda --preset k2-slice \
        --fmt int4 --layers 8 --sessions 32 --context 32768 --turn 500 --output 64 --turns 3 \
        --concurrency 4 --pool-x 6 --batched-tokens 8192

The trace: S sessions, each a shared prefix (`--shared`, common to all: a system prompt and
tools) plus its own context (`--context` tokens); each turn appends the reply and `--turn` new
user tokens, and the session comes back for its next turn as soon as its reply is done
(closed loop, `--concurrency` sessions in flight). The device pool holds `working set / --pool-x`
tokens (at least one whole session); the host tier `--tier-x` times the working set. The same
trace (same tokens, deterministic per session and turn) runs with the tier off, then on, on the
same model. Greedy, ignore_eos; the outputs are compared (equal on the CPU; on a GPU a batch
composition that differs may flip a near-tie token of random weights, so it is reported).
The copy bandwidth: `KVCopier` moving 256 pages each way on the engine's own cache (pinned on
CUDA, timed with events), and the tier's own copies during the trace (bytes / copy seconds).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

import torch


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def user_tokens(seed: int, turn: int, session: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + turn * 10_007 + session)
    return [rng.randrange(10, vocab) for _ in range(n)]


def load(args):
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    cfg = ModelConfig.from_hf(preset_config(args.preset, args.fmt, layers=args.layers))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return load_model(None, load_format="dummy", config=cfg, device=args.device, dtype=dtype,
                      progress=False, setup_backends=False)  # fmt: skip


def make_engine(model, args, pool_pages: int, max_len: int, tier_gib: float | None):
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine

    cfg = EngineConfig(
        device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
        num_kv_pages=pool_pages, page_size=args.page_size, max_model_len=max_len,
        max_num_seqs=args.concurrency, max_num_batched_tokens=args.batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
        kv_offloading_size=tier_gib,
    )  # fmt: skip
    return LLMEngine(cfg, model=model)


def run_trace(engine, args, vocab: int) -> dict:
    from k2serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    shared = user_tokens(args.seed, -1, -1, args.shared, vocab)
    hist = [
        shared + user_tokens(args.seed, 0, i, args.context, vocab) for i in range(args.sessions)
    ]
    pending = [(0, i) for i in range(args.sessions)]
    in_flight: dict[str, tuple[int, int]] = {}
    toks: dict[str, list[int]] = {}
    ttft = {"first": [], "return": []}
    steps: list[float] = []
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    computed = 0  # prompt tokens computed (not restored from either tier): the work saved
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or in_flight:
        while pending and len(in_flight) < args.concurrency:
            turn, i = pending.pop(0)
            rid = f"{turn}-{i}"
            engine.add_request(rid, hist[i], params, arrival_time=time.monotonic())
            in_flight[rid] = (turn, i)
            toks[rid] = []
        ts = time.perf_counter()
        outs = engine.step()
        sync()
        steps.append(time.perf_counter() - ts)
        for o in outs:
            toks[o.request_id] += o.outputs[0].token_ids
            if not o.finished:
                continue
            turn, i = in_flight.pop(o.request_id)
            computed += len(o.prompt_token_ids) - o.num_cached_tokens
            m = o.metrics
            ttft["first" if turn == 0 else "return"].append(m.first_token_time - m.arrival_time)
            hist[i] = hist[i] + toks[o.request_id]
            hist[i] += user_tokens(args.seed, turn + 1, i, args.turn, vocab)
            if turn + 1 < args.turns:
                pending.append((turn + 1, i))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    copier = engine.runner.kv_copier
    if copier is not None:
        copier.synchronize()  # account the last copies
    s = engine.get_stats()
    out_tokens = sum(len(t) for t in toks.values())
    return dict(
        wall_s=wall,
        process_cpu_s=cpu,  # less disturbed than wall time by other load on a shared machine
        prompt_tokens_computed=computed,
        output_tok_s=out_tokens / wall,
        ttft_first_p50_ms=1e3 * pct(ttft["first"], 50),
        ttft_first_p99_ms=1e3 * pct(ttft["first"], 99),
        ttft_return_p50_ms=1e3 * pct(ttft["return"], 50),
        ttft_return_p99_ms=1e3 * pct(ttft["return"], 99),
        step_p50_ms=1e3 * pct(steps, 50),
        step_p99_ms=1e3 * pct(steps, 99),
        prefix_hit_rate=s.prefix_cache_hit_rate,
        host_hit_tokens=s.host_cache_hits,
        num_preemptions=s.num_preemptions,
        swap_outs=s.num_swap_outs,
        copy_gb_d2h=s.kv_offload_bytes_d2h / 1e9,
        copy_gb_h2d=s.kv_offload_bytes_h2d / 1e9,
        copy_gbps_d2h=s.kv_offload_bytes_d2h / 1e9 / s.kv_offload_seconds_d2h
        if s.kv_offload_seconds_d2h else None,
        copy_gbps_h2d=s.kv_offload_bytes_h2d / 1e9 / s.kv_offload_seconds_h2d
        if s.kv_offload_seconds_h2d else None,
        copy_stalls=s.kv_copy_stalls,
        tokens={k: v for k, v in toks.items()},
    )  # fmt: skip


def copy_bandwidth(kv_caches, pages: int = 256) -> dict:
    """GB/s of one batch of `pages` pages each way through KVCopier (the tier's own path)."""
    from k2serve.cache.host_tier import D2H, H2D, KVCopier, KVTransfers

    pages = min(pages, kv_caches[0].shape[0])
    cp = KVCopier(kv_caches, pages)
    out = {}
    for kind in (D2H, H2D, D2H, H2D):  # the second pair is timed (the first warms up)
        t = KVTransfers()
        for p in range(pages):
            t.add(kind, p, p)
        before = dict(cp.bytes_moved), dict(cp.seconds)
        w = time.perf_counter()
        cp.apply(t)
        cp.synchronize()
        w = time.perf_counter() - w
        moved = cp.bytes_moved[kind] - before[0][kind]
        secs = cp.seconds[kind] - before[1][kind]
        out[f"{kind}_gbps"] = moved / 1e9 / secs
        out[f"{kind}_wall_gbps"] = moved / 1e9 / w
    out["page_bytes"] = cp.bytes_per_page
    del cp
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--fmt", default="bf16")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--sessions", type=int, default=10)
    ap.add_argument("--shared", type=int, default=64, help="prefix tokens common to all sessions")
    ap.add_argument("--context", type=int, default=384, help="each session's own context")
    ap.add_argument("--turn", type=int, default=48, help="new user tokens per turn")
    ap.add_argument("--output", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--pool-x", type=float, default=6.0, help="working set / device pool")
    ap.add_argument("--tier-x", type=float, default=1.5, help="host tier / working set")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["K2SERVE_KV_HOST_TIER_ON_CPU"] = "1"  # the CPU pool is host RAM already
    model = load(args)
    vocab = min(model.config.vocab_size - 256, 30000)
    ps = args.page_size
    session_len = args.shared + args.context + args.turns * (args.turn + args.output)
    max_len = -(-(session_len + ps) // ps) * ps
    working = args.sessions * session_len
    pool_pages = max(-(-max_len // ps) * args.concurrency, int(working / args.pool_x) // ps)
    results: dict = {}
    elt = 1 if args.kv_cache_dtype == "fp8" else 2 if args.device == "cuda" else 4
    page_bytes = model.config.kv_cache_dim * model.config.num_hidden_layers * ps * elt
    for name, tier_gib in (("off", None), ("on", args.tier_x * working / ps * page_bytes / 2**30)):
        eng = make_engine(model, args, pool_pages, max_len, tier_gib)
        results[name] = run_trace(eng, args, vocab)
        if tier_gib:
            results["bandwidth"] = copy_bandwidth(eng.runner.kv_caches)
        del eng
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    same = sum(results["off"]["tokens"][k] == v for k, v in results["on"]["tokens"].items())
    total = len(results["on"]["tokens"])
    for r in ("off", "on"):
        del results[r]["tokens"]
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results["setup"] = dict(
        device=dev, preset=args.preset, fmt=args.fmt, layers=model.config.num_hidden_layers,
        sessions=args.sessions, session_tokens=session_len, working_set_tokens=working,
        device_pool_tokens=pool_pages * ps, working_set_x_pool=working / (pool_pages * ps),
        tier_x=args.tier_x, concurrency=args.concurrency, identical_outputs=f"{same}/{total}",
    )  # fmt: skip
    on, off = results["on"], results["off"]
    print(json.dumps(results["setup"]))
    print(f"{'':22s}{'tier off':>12s}{'tier on':>12s}{'on/off':>9s}")
    timed = ("ttft_first_p50_ms", "ttft_first_p99_ms", "ttft_return_p50_ms",
             "ttft_return_p99_ms", "output_tok_s", "step_p50_ms", "step_p99_ms",
             "wall_s", "process_cpu_s", "prompt_tokens_computed")  # fmt: skip
    for key in timed:
        a, b = off[key], on[key]
        print(f"{key:22s}{a:12.1f}{b:12.1f}{(b / a if a else float('nan')):9.2f}")
    counted = ("prefix_hit_rate", "host_hit_tokens", "num_preemptions", "swap_outs",
               "copy_gb_d2h", "copy_gb_h2d", "copy_gbps_d2h", "copy_gbps_h2d",
               "copy_stalls")  # fmt: skip
    for key in counted:
        print(f"{key:22s}{off[key]!s:>12.10s}{on[key]!s:>12.10s}")
    bw = results["bandwidth"]
    print(f"copy bandwidth (KVCopier, 256 pages of {bw['page_bytes']} B): device->host "
          f"{bw['d2h_gbps']:.2f} GB/s, host->device {bw['h2d_gbps']:.2f} GB/s "
          f"(wall {bw['d2h_wall_gbps']:.2f} / {bw['h2d_wall_gbps']:.2f})")  # fmt: skip
    print(f"identical greedy outputs: {same}/{total}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
