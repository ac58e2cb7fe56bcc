"""Expert-parallel MoE machinery (issue 29), two parts.

gpu: on ONE GPU, one K2 MoE layer (k2-slice: E=384, D=7168, I=2048, top-8, INT4 or FP8) run as
     the single-rank MoE block and as the expert-parallel block over a 1-rank NCCL group
     (route -> replica selection -> counts all-to-all -> rows/slot-ids all-to-all -> the same
     fused expert backend -> reverse all-to-all -> weighted combine), same batch, same
     backend: the difference is the overhead of the dispatch/combine machinery.
cpu: W gloo ranks (processes) running a small MoE layer (64 experts, top-6) whose router is
     biased so a few experts are hot; (token, expert) pairs computed per rank over N steps
     before and after one EPLB rebalance (num_redundant_experts slots): max/mean rank load.

Run (repo root):
  PYTHONPATH=src python3 benchmarks/ep_dispatch.py --parts gpu [--fmt int4] [--tokens 1,64,1024]
  PYTHONPATH=src python3 benchmarks/ep_dispatch.py --parts cpu [--ranks 4] [--redundant 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, iters: int = 20, warmup: int = 3) -> float:  # ms per call
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / iters


@torch.inference_mode()
def part_gpu(args) -> list[dict]:
    from k2serve.config import ModelConfig
    from k2serve.distributed.expert_parallel import EPContext, EPMoE
    from k2serve.model.backends import setup_backends
    from k2serve.model.deepseek_v3 import MoE
    from k2serve.moe.eplb import ExpertMap
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    cfg = ModelConfig.from_hf(preset_config("k2-slice", args.fmt, layers=2))  # dense + MoE
    model = load_model(None, load_format="dummy", config=cfg, device="cuda", progress=False,
                       setup_backends=False)  # fmt: skip
    setup_backends(model, "triton", "triton", "triton")
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    ctx = EPContext(0, 1, ExpertMap.contiguous(1, cfg.n_routed_experts, 1))
    ctx.load = torch.zeros(1, cfg.n_routed_experts, dtype=torch.int64, device="cuda")
    ep = EPMoE(moe, ctx, 0)
    ep.expert_backend = moe.expert_backend  # the same fused backend: one rank holds all
    rows = []
    for T in args.tokens:
        x = torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        ref, out = moe(x), ep(x)
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        single, epms = _timed(lambda x=x: moe(x)), _timed(lambda x=x: ep(x))
        row = dict(part="gpu", fmt=args.fmt, tokens=T, single_ms=round(single, 3),
                   ep_ms=round(epms, 3), overhead_ms=round(epms - single, 3),
                   ratio=round(epms / single, 3), rel_err=err)  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    dist.destroy_process_group()
    return rows


def _cpu_rank(state, W: int, redundant: int, steps: int, tokens: int) -> tuple:
    from k2serve.config import ModelConfig
    from k2serve.distributed.eplb_runtime import EplbRunner
    from k2serve.distributed.expert_parallel import EPContext, ep_layers, shard_model_ep
    from k2serve.moe.eplb import EplbConfig, ExpertMap
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    torch.set_num_threads(1)
    raw = preset_config("tiny", "bf16")
    raw.update(n_routed_experts=64, num_experts_per_tok=6, num_hidden_layers=2,
               first_k_dense_replace=1, n_group=1, topk_group=1)  # fmt: skip
    cfg = ModelConfig.from_hf(raw)
    model = load_model(None, load_format="dummy", config=cfg, dtype=torch.float32, seed=0,
                       progress=False, setup_backends=False)  # fmt: skip
    E = cfg.n_routed_experts
    ctx = EPContext(state.rank, W, ExpertMap.identity(1, E, W, redundant))
    shard_model_ep(model, ctx)
    moe = ep_layers(model)[0]
    # skew: a bias that makes low expert ids hot (the same on every rank)
    moe.gate.e_score_correction_bias.copy_(torch.linspace(3.0, 0.0, E) ** 2 / 3)
    runner = EplbRunner(model, EplbConfig(window_size=steps, step_interval=steps,
                                          num_redundant_experts=redundant))  # fmt: skip
    g = torch.Generator().manual_seed(state.rank)

    def run(record: bool) -> int:
        ctx.num_received = 0
        for _ in range(steps):
            moe(torch.randn(tokens, cfg.hidden_size, generator=g))
            if record:
                runner.after_step()  # the last step of the window rebalances
        return ctx.num_received

    before = run(True)
    after = run(False)
    return before, after, runner.last_imbalance


def part_cpu(args) -> list[dict]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from k2serve.distributed.workers import WorkerGroup

    g = WorkerGroup(args.ranks, "cpu")
    try:
        res = g.run(_cpu_rank, args.ranks, args.redundant, args.steps, args.cpu_tokens)
    finally:
        g.shutdown()
    before = torch.tensor([r[0] for r in res], dtype=torch.float64)
    after = torch.tensor([r[1] for r in res], dtype=torch.float64)
    row = dict(part="cpu", ranks=args.ranks, experts=64, top_k=6, redundant=args.redundant,
               steps=args.steps, tokens_per_rank_step=args.cpu_tokens,
               pairs_per_rank_before=before.tolist(), pairs_per_rank_after=after.tolist(),
               max_over_mean_before=round(float(before.max() / before.mean()), 3),
               max_over_mean_after=round(float(after.max() / after.mean()), 3),
               predicted_by_eplb=res[0][2])  # fmt: skip
    print(json.dumps(row), flush=True)
    return [row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="cpu", help="gpu,cpu")
    p.add_argument("--fmt", default="int4", choices=["int4", "fp8", "bf16"])
    p.add_argument("--tokens", default="1,16,64,256,1024")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--redundant", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cpu-tokens", type=int, default=64)
    args = p.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    for part in args.parts.split(","):
        {"gpu": part_gpu, "cpu": part_cpu}[part](args)


if __name__ == "__main__":
    main()
