# ruff: noqa: E741, E501, B023
"""The multi-row h2 decode GEMV (kernels/int4_gemv.py, kind "h2r") against the one-row h2 GEMV
on one K2 MoE layer at 2-32 tokens (uniform and skewed routing, graph-timed), then the k2-slice
decode at B=1/8/32/128 with and without it.

Run (repo root, one H200): PYTHONPATH=src python3 bench/decode_rows.py [--parts sweep,model]
Bytes counted per call: the distinct experts hit (INT4 words + scales) + activations.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import model_speed as ms  # noqa: E402

E, D, I, K = 384, 7168, 2048, 8
# (ROWS, BLOCK_N, W, num_warps, down BLOCK_N, down W)
CANDS = [(2, 8, 64, 4, 8, 128), (4, 8, 64, 4, 8, 128), (4, 16, 64, 4, 16, 128),
         (4, 8, 32, 4, 8, 64), (2, 16, 64, 8, 16, 128), (4, 4, 64, 2, 4, 128)]


def cfg_of(c):
    return dict(kind="h2r", ROWS=c[0], BLOCK_N=c[1], W=c[2], num_warps=c[3],
                w2=dict(BLOCK_N=c[4], W=c[5], num_warps=c[3]))


def routes_for(T, skew, n=4):
    out = []
    for _ in range(n):
        if skew == 0:
            out.append(ms._route(T, E, K, "cuda"))
        else:
            p = torch.exp(skew * torch.randn(E, device="cuda"))
            out.append((torch.rand(T, K, device="cuda"), torch.multinomial(p.expand(T, E), K).int()))
    return out


def part_sweep():
    from k2serve.kernels import moe_int4 as mi

    ew = ms._rand_experts("int4", E, D, I, "cuda")
    per_expert = sum(t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale))
    total = {}
    for T in (2, 4, 8, 16, 32):
        for skew in (0.0, 3.0):
            routes = routes_for(T, skew)
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            hit = sum(int(ti.unique().numel()) for _, ti in routes) / len(routes)
            nb = hit * per_expert + 2 * T * D * 2
            r1 = dict(mi.TUNED["r1"])
            refs = [mi.int4_moe(x, ew, tw, ti, r1) for tw, ti in routes]
            tag = f"T={T} {'skew' if skew else 'unif'} ({hit:.0f} exp)"
            t1, _ = ms._time_moe(ew, x, routes, refs, r1)
            ms.row("h2", f"{tag} one-row h2", t1, nb)
            total.setdefault("h2", 0.0)
            total["h2"] += t1
            for c in CANDS:
                try:
                    t, err = ms._time_moe(ew, x, routes, refs, cfg_of(c))
                except Exception as e:  # noqa: BLE001 - report a config that does not run
                    ms.log(f"  {tag} {c}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                ms.row("h2r", f"{tag} rows {c}", t, nb, 0, f"vs h2 {t1 / t:.2f}x, err {err:.1e}")
                if err > 1e-2:
                    ms.FAILS.append(f"h2r {tag} {c} err {err:.1e}")
                total[c] = total.get(c, 0.0) + (t if err <= 1e-2 else 1e9)
    for key, t in sorted(total.items(), key=lambda kv: kv[1]):
        ms.log(f"  total over the sweep: {key}: {t:.3f} ms")
    best = min((c for c in total if c != "h2"), key=lambda c: total[c])
    del ew
    torch.cuda.empty_cache()
    return best


def part_model(best, layers):
    from k2serve.kernels import moe_int4 as mi

    model = ms.load_slice(layers)
    ms.accelerate(model, expand=True)
    mi.ROWS_MIN_PAIRS = 1 << 30
    ms.bench_model(model, "model-h2", batches=(8, 32), prefills=())
    mi.TUNED["rows"] = cfg_of(best)
    for min_pairs in (8, 16):
        mi.ROWS_MIN_PAIRS = min_pairs
        ms.bench_model(model, f"model-h2r>{min_pairs}", batches=(1, 2, 8, 32, 128), prefills=(),
                       profile_batches=(8,) if min_pairs == 8 else ())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="sweep,model")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    ms.log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
           f"{__import__('triton').__version__} date {time.strftime('%Y-%m-%d')}")
    torch.manual_seed(0)
    ms.part_ceil()
    best = CANDS[1]
    if "sweep" in args.parts:
        best = part_sweep()
        ms.log(f"  best rows config: {best}")
    if "model" in args.parts:
        try:
            part_model(best, args.layers)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            ms.FAILS.append(f"model: {e!r}"[:200])
    ms.log(f"\nceilings: copy {ms.CEIL['bw']:.0f} GB/s, bf16 matmul {ms.CEIL['mm']:.0f} TFLOP/s")
    ms.log("| part | case | ms | GB/s | % copy bw | TFLOP/s | % matmul | note |")
    ms.log("|---|---|---:|---:|---:|---:|---:|---|")
    for r in ms.ROWS:
        ms.log(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.1f} | {r[6]:.0f} | {r[7]} |")
    ms.log(f"checks failed: {ms.FAILS or 'none'}")


if __name__ == "__main__":
    main()
