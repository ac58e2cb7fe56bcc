# ruff: noqa: E501, B023, E741
"""FP8 block linears (Kimi-K2-Instruct's format) on one GPU: kernels/fp8_linear.py against the
reference path (float32 dequant per call + F.linear), per K2 projection and batch, with the
launch configs of the kernel policy's tables; then a k2-slice FP8 model's decode and prefill
with the policy's fp8_gemm off (one dequant pass + cuBLAS) and on.

Run (repo root): PYTHONPATH=src python3 benchmarks/fp8_speed.py [--parts proj,sweep,model] [--layers 4]
Bytes per projection call = fp8 weight + float32 scales + activations in and out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import model_speed as ms  # noqa: E402

# Kimi-K2-Instruct's FP8 linears (out, in)
SHAPES = {
    "q_a": (1536, 7168),
    "kv_a": (576, 7168),
    "q_b": (12288, 1536),
    "kv_b": (16384, 512),
    "o_proj": (7168, 8192),
    "shared gate/up": (2048, 7168),
    "shared down": (7168, 2048),
    "dense gate/up": (18432, 7168),
    "dense down": (7168, 18432),
}


def reference(x, w, s):
    from k2serve.quant.fp8 import dequantize_fp8_block

    return F.linear(x, dequantize_fp8_block(w, s, (128, 128), x.dtype))


def gtime(fn) -> float:
    """ms per call, 8 calls captured in one CUDA graph (launch overhead out of the figure)."""
    return ms.graph_ms([fn] * 8, reps=10)


def part_proj(sweep):
    from k2serve.kernels import fp8_linear as fl
    from k2serve.quant.fp8 import quantize_fp8_block

    tables = ms.engine_policy().tables
    best = {}
    for name, (N, K) in SHAPES.items():
        w, s = quantize_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
        for M in (1, 8, 32, 64, 256, 2048):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            nb = N * K + s.numel() * 4 + M * (K + N) * 2
            fl_ = 2 * M * N * K
            ref = reference(x, w, s)
            t_ref = gtime(lambda: reference(x, w, s))
            if M <= tables.fp8_kernel_max_rows:
                new = lambda: fl.fp8_block_matmul(x, w, s, table=tables.fp8_linear)  # noqa: E731
                what = f"kernel {fl._config(M, N, K, tables.fp8_linear)}"
            else:
                new = lambda: F.linear(x, fl.dequant_fp8_block(w, s, x.dtype))  # noqa: E731
                what = "dequant pass + cuBLAS"
            ms.check(f"fp8 {name} M={M}", new(), ref, 1e-2)
            t_new = gtime(new)
            ms.row("fp8", f"{name} {N}x{K} M={M} reference", t_ref, nb, fl_)
            ms.row("fp8", f"{name} {N}x{K} M={M} {what}", t_new, nb, fl_, f"{t_ref / t_new:.1f}x")
            if sweep and M in (1, 8, 64):
                for bn in (32, 64):
                    for split in (1, 2, 4, 8, 16):
                        for st in (3, 4):
                            cfg = dict(
                                BLOCK_M=16 if M <= 16 else 64,
                                BLOCK_N=bn,
                                SPLIT_K=split,
                                num_warps=4,
                                num_stages=st,
                            )
                            try:
                                out = fl.fp8_block_matmul(x, w, s, cfg)
                                t = gtime(lambda: fl.fp8_block_matmul(x, w, s, cfg))
                            except Exception as e:  # noqa: BLE001 - a config that does not fit
                                ms.log(f"  {name} M={M} {cfg}: {type(e).__name__}")
                                continue
                            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                            if err < 1e-2 and t < best.get((name, M), (1e9,))[0]:
                                best[(name, M)] = (t, cfg, nb)
        for M in (1, 8, 64):
            if (name, M) in best:
                t, cfg, nb = best[(name, M)]
                ms.row("best", f"{name} {N}x{K} M={M}", t, nb, 0, str(cfg))


def part_moe():
    """FP8 routed experts at decode sizes: the generic fused_moe kernel's small-M configs,
    graph-timed over 4 routings (uniform), one K2 MoE layer (E=384, D=7168, I=2048)."""
    from k2serve.kernels import fused_moe as fm

    E, D, I, K = 384, 7168, 2048, 8
    ew = ms._rand_experts("fp8", E, D, I, "cuda")
    per = sum(t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale))
    cands = [
        (bn, bk, st, nw)
        for bn in (32, 64, 128)
        for bk in (128, 256)
        for st in (3, 4, 6)
        for nw in (4, 8)
        if not (bn == 128 and bk == 256 and st == 6)
    ]
    for T in (1, 8, 32):
        routes = [ms._route(T, E, K, "cuda") for _ in range(4)]
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        hit = sum(int(ti.unique().numel()) for _, ti in routes) / 4
        nb = hit * per + 2 * T * D * 2
        refs = [fm.fused_moe(x, ew, tw, ti) for tw, ti in routes]
        t0 = ms.graph_ms([lambda tw=tw, ti=ti: fm.fused_moe(x, ew, tw, ti) for tw, ti in routes])
        ms.row("moe", f"fp8 experts T={T} default {fm.kernel_config(T * K, E, 'fp8')}", t0, nb)
        best = (t0, None)
        for bn, bk, st, nw in cands:
            cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st)
            try:
                outs = [fm.fused_moe(x, ew, tw, ti, cfg) for tw, ti in routes]
                t = ms.graph_ms(
                    [lambda tw=tw, ti=ti: fm.fused_moe(x, ew, tw, ti, cfg) for tw, ti in routes]
                )
            except Exception as e:  # noqa: BLE001 - a config that does not fit
                ms.log(f"  T={T} {cfg}: {type(e).__name__}")
                continue
            err = max(
                ((o.float() - r.float()).norm() / r.float().norm()).item()
                for o, r in zip(outs, refs, strict=True)
            )
            if err < 1e-2 and t < best[0]:
                best = (t, cfg)
        ms.row("moe", f"fp8 experts T={T} best {best[1]}", best[0], nb, 0, f"{t0 / best[0]:.2f}x")


def part_model(layers):
    model = ms.load_slice(layers, "fp8")
    ms.setup(model, ms.engine_policy(fp8_gemm=False), expand=True)  # dequant pass + cuBLAS
    ms.bench_model(model, "fp8-dequant", batches=(1, 8), prefills=(1024,), expanded=True)
    ms.setup(model, expand=True)
    ms.bench_model(
        model,
        "fp8-kernel",
        batches=(1, 8, 32),
        prefills=(1024, 8192),
        expanded=True,
        profile_batches=(1,),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="proj,model")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    ms.log(
        f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
        f"{__import__('triton').__version__} date {time.strftime('%Y-%m-%d')}"
    )
    torch.manual_seed(0)
    ms.part_ceil()
    for name, fn in (
        ("proj", lambda: part_proj("sweep" in args.parts)),
        ("moe", part_moe),
        ("model", lambda: part_model(args.layers)),
    ):
        if name in args.parts:
            ms.run_part(name, fn)
    ms.print_table()


if __name__ == "__main__":
    main()
