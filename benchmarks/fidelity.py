"""GPU fidelity: every fused path against the torch reference with the routing pinned.

    PYTHONPATH=src python3 benchmarks/fidelity.py                 # k2-slice sizes, all formats
    PYTHONPATH=src python3 benchmarks/fidelity.py --tiny          # the tiny test model (seconds)

For each weight format (bf16, fp8 block, INT4 group 32) a model with the real Kimi-K2 layer sizes
(hidden 7168, MLA, moe_intermediate 2048, top-8; `--experts` routed experts per layer to fit one
GPU beside its float32 copy) runs: decode at batch 1 / 8 / 128, prefill with a cached prefix;
variants: fused eager, fused + decode CUDA graphs, fp8 KV cache, experts split GPU/CPU. Each is
compared after every layer and at the logits with the float32 gold pass whose routing is
replayed everywhere; the tolerance is the torch reference's own distance from gold in the same
run (k2serve/testing/fidelity.py says why). Unpinned runs print how often routing flips.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch


def build(fmt: str, layers: int, experts: int, tiny: bool, device: str):
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    cfg = preset_config("tiny" if tiny else "k2-slice", fmt, layers=layers)
    if not tiny:
        cfg["n_routed_experts"] = experts
        cfg["n_group"] = cfg["topk_group"] = 1
    return load_model(None, config=ModelConfig.from_hf(cfg), load_format="dummy",
                      dtype=torch.bfloat16, device=device, progress=False)  # fmt: skip


def router_checks(device) -> list[str]:
    from k2serve.kernels.router import fused_grouped_topk, grouped_topk_torch
    from k2serve.testing.fidelity import check_router_topk

    fails = []
    for name, fn in (("torch", grouped_topk_torch), ("fused (Triton)", fused_grouped_topk)):
        if name != "torch" and device != "cuda":
            continue
        for E, k, ng, tg in ((384, 8, 1, 1), (256, 8, 8, 4)):
            for ties in (False, True):
                ok, why = check_router_topk(fn, 257, E, k, ng, tg, device, ties=ties)
                tag = f"router {name} E={E} k={k} groups {ng}/{tg}{' ties' if ties else ''}"
                print(f"  {tag:52s} vs float64: {why}")
                if not ok:
                    fails.append(tag)
    return fails


def parallel_checks(args, device: str, batches) -> list[str]:
    from k2serve.distributed.workers import WorkerGroup
    from k2serve.testing.fidelity import check_parallel
    from k2serve.weights.presets import preset_config

    fails = []
    group = WorkerGroup(args.tp, device)
    try:
        for fmt in args.formats.split(","):
            cfg = preset_config("tiny" if args.tiny else "k2-slice", fmt, layers=args.layers)
            if not args.tiny:
                cfg.update(n_routed_experts=args.experts, n_group=1, topk_group=1)
            for ep in (False, True):
                print(f"{fmt}: TP={args.tp}{' + EP' if ep else ''} vs TP=1, routing pinned")
                res = check_parallel(group, cfg, torch.bfloat16, batches, device=device,
                                     expert_parallel=ep)  # fmt: skip
                fails += [f"{fmt}: {r.name}" for r in res if not r.ok]
    finally:
        group.shutdown()
    return fails


def extra_variants(args, fmt: str, device: str) -> list:
    """--mla-fp8-tiles / --fp8-prompts: fused variants with an explicit kernel policy."""
    from dataclasses import replace

    from k2serve.kernels.policy import FrozenMap, KernelPolicy
    from k2serve.testing.fidelity import policy_variant

    base = KernelPolicy.for_device(device)
    out = []
    for tile in filter(None, args.mla_fp8_tiles.split(",")):
        keys, stages = (int(v) for v in tile.split("x"))
        t = base.tables
        fp8_tile = dict(t.mla_decode.get("fp8", {}), block_n=keys, num_stages=stages)
        tables = replace(t, mla_decode=FrozenMap(dict(t.mla_decode, fp8=FrozenMap(fp8_tile))))
        out.append(policy_variant(f"fused, fp8 KV cache, MLA tile {tile}",
                                  replace(base, tables=tables), torch.float8_e4m3fn))  # fmt: skip
    if args.fp8_prompts and fmt in ("fp8", "int4"):
        pol = replace(base, moe_prefill_precision="fp8", moe_prefill_min_tokens=0)
        out.append(policy_variant("fused, fp8 prompts (FP8 activations)", pol))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="bf16,fp8,int4")
    ap.add_argument("--layers", type=int, default=3, help="1 dense + (layers-1) MoE layers")
    ap.add_argument("--experts", type=int, default=32, help="routed experts per MoE layer")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (fast smoke run)")
    ap.add_argument("--tp", type=int, default=1,
                    help="also TP=N and TP=N + EP against TP=1, layer by layer (N GPUs; over "
                         "gloo on the CPU with --cpu)")  # fmt: skip
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even with CUDA")
    ap.add_argument(
        "--variants",
        default=None,
        help="comma-separated substrings: only the variants whose name has one",
    )
    ap.add_argument(
        "--mla-fp8-tiles",
        default="",
        help="also the fp8 KV cache variant with these MLA decode tiles, e.g. "
        "64x3,32x5 (keys x stages)",
    )
    ap.add_argument(
        "--fp8-prompts",
        action="store_true",
        help="also the variant with --moe-prefill-precision fp8 from 0 tokens "
        "(FP8 activations in every step; FP8-block and INT4 experts)",
    )
    ap.add_argument("--seeds", default="0", help="batch seeds (token ids and cached KV values)")
    args = ap.parse_args(argv)
    from k2serve.testing.fidelity import (
        check_model,
        decode_batch,
        gpu_variants,
        prefix_prefill_batch,
        reference_setup,
    )

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
    fails = router_checks(device)
    batches = []
    for seed in (int(x) for x in args.seeds.split(",")):
        bs = [decode_batch(int(b), args.context) for b in args.batches.split(",")]
        bs.append(prefix_prefill_batch())
        for b in bs:
            b.seed = seed
            b.name += f" seed {seed}" if seed else ""
        batches += bs
    for fmt in args.formats.split(","):
        t = time.time()
        model = build(fmt, args.layers, args.experts, args.tiny, device)
        print(f"{fmt}: {args.layers} layers, {model.config.n_routed_experts} experts/layer, "
              f"loaded in {time.time() - t:.0f}s")  # fmt: skip
        variants = gpu_variants(model) if device == "cuda" else []
        variants += extra_variants(args, fmt, device)
        if args.variants:
            keep = args.variants.split(",")
            variants = [v for v in variants if any(k in v.name for k in keep)]
        res = check_model(model, variants, batches, reference=reference_setup)
        fails += [f"{fmt}: {r.name}" for r in res if not r.ok]
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.tp > 1:
        fails += parallel_checks(args, device, batches)
    print(f"fidelity checks failed: {fails or 'none'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
