# ruff: noqa: E741, E501
"""Prefill MoE GEMM variants (issue 28, wave 8) on one H100: each variant checked against the
reference first, then one K2 MoE layer timed at T = 1024 .. 16384 for the current table and
each variant; a table at the end. Full output in $OUT/prefill_gemm.txt.

Run (repo root, one H100, < 300 s): bash benchmarks/prefill_device.sh
  [--variants 128x256s4w8ht,...] [--ts 1024,...] [--routing uniform,third]
Variants are gluon_int4_device.cfg_of names (t: TAIL, an expert's last <= BLOCK_M / 2 pairs
in a BLOCK_M / 2 tile; l: L1, the words and scales through L1; w: KW, a K step's words and
scales loaded once, whole sectors). Parts, each in its own process (a kernel fault cannot take the later
ones with it), each variant fail-soft (the error is printed, the next one runs):
  check  (two processes: small shapes, then K2 layers) small grouped GEMMs against a float32 torch reference and the Triton kernel (padding
         rows, a partial N block, an expert without pairs, experts with 100 and 150 pairs:
         full tiles plus tails), then int4_moe_gemm on a K2 layer: T=64, 2048 against
         fused_moe_ref, T=8192, 16384 against the current table's output (bit-identical
         expected where the accumulation order is the same).
  time   one K2 MoE layer (E=384, D=7168, I=2048, top-8, group 32): the table (the engine's
         configs today) and each variant, CUDA-event median; routing "uniform" or "third"
         (every token's experts drawn from a fixed third of them, like the k2-slice's dummy
         router).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
E, D, I, K = 384, 7168, 2048, 8
# 128x256s4w8h: the 8K band's config today (the table's below 16384 pairs is another); t: TAIL;
# l: L1 (words and scales through L1, carveout for it; needs STAGES=3 to leave L1 room); w: KW
# (a K step's words and scales loaded once, whole sectors); ww: KW=2 (scales by K-step pair);
# g: SILU (gate_up stores silu(gate) * up: checked on K2 layers only, not the small GEMMs)
# (the wave-7 sweep's times follow the L2 sectors a MAC: with KW smaller token tiles and
# 512-row tiles may win the 1K-4K bands)
VARIANTS = ["128x256s4w8h", "128x256s4w8ht", "128x256s3w8hl", "128x256s3w8hw", "128x256s3w8htw",
            "128x256s3w8htww", "128x256s3w8hi2tww", "64x256s4w8hw", "64x256s4w8hww",
            "64x256s4w8htww", "32x256s4w8hww", "32x512s3w16hww", "128x256s3w8htwwg",
            "64x256s4w8hwwg"]  # fmt: skip
TS = (1024, 2048, 4096, 8192, 16384)
DEFAULT_TS = ",".join(map(str, TS))
BUDGET_S = 288


def log(*a):
    print(*a, flush=True)


def result(**kv):
    log("RESULT " + json.dumps(kv))


def route(T, routing, dev="cuda"):
    import model_speed as ms
    import torch

    if routing == "uniform":
        return ms._route(T, E, K, dev)
    g = torch.Generator(device="cpu").manual_seed(7)
    third = torch.randperm(E, generator=g)[: E // 3].to(dev)
    ids = third[torch.rand(T, E // 3, device=dev).argsort(-1)[:, :K]].int()
    return torch.rand(T, K, device=dev), ids


def part_check(variants):
    import gluon_int4_device as gd
    import torch
    import triton

    from k2serve.kernels import int4_gemm_gluon as gg

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"gluon usable {gg.gluon_usable('cuda')}")  # fmt: skip
    gd.ceilings()
    for args in (
        ("gate_up E5 N512 K512 T37 top2 (padding rows, perm_out)", 5, 512, 512, 37, 2, True),
        ("down E5 N320 K768 T37 top2 (partial N block, mul_w)", 5, 320, 768, 37, 2, False),
        ("gate_up E5 N512 K512 T200 top2 (100 pairs an expert)", 5, 512, 512, 200, 2, True),
        ("down E5 N768 K1024 T300 top2 (150 pairs an expert)", 5, 768, 1024, 300, 2, False),
        ("down E3 N256 K256 T1 top2 (2 sub-steps < ring)", 3, 256, 256, 1, 2, False),
    ):
        try:  # SILU's gate_up output is not the GEMM's: its checks are the K2 layers'
            gd.gemm_case(*args, [v for v in variants if not gd.cfg_of(v).get("SILU")])
        except Exception as e:  # noqa: BLE001
            log(f"  {args[0]}: ERROR {type(e).__name__}: {str(e)[:600]}")


def part_layers(variants, layer_ts, base=None, named=None):
    """K2 layer checks of each variant against `base` (a config or table by pair count; None:
    the kernel's table) and, at T <= 2048, fused_moe_ref; `named`: configs by name for names
    gluon_int4_device.cfg_of does not parse."""
    import gluon_int4_device as gd
    import torch

    from k2serve.kernels import int4_gemm as ig
    from k2serve.kernels.fused_moe import fused_moe_ref

    for T in layer_ts:  # (T=1: the small shapes' T1 case; here a recompile)
        try:
            torch.manual_seed(T)
            import model_speed as ms

            ew = ms._rand_experts("int4", E, D, I, "cuda")
            tw, ti = ms._route(T, E, K, "cuda")
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            table = ig.int4_moe_gemm(x, ew, tw, ti, base, backend="gluon")
            if T <= 2048:
                ref = fused_moe_ref(x, ew, tw, ti)
                tri = ig.int4_moe_gemm(x, ew, tw, ti, backend="triton")
                et, mt = gd.rel(tri, ref), gd.maxrel(tri, ref)
                log(
                    f"  K2 T={T}: triton rel {et:.2e} max {mt:.2e}; table rel {gd.rel(table, ref):.2e}"
                )
            else:
                # against the table: the same sums (bit-identical) or reordered ones (W2=32)
                ref, et, mt = table, 2.5e-3, 2.5e-3
            for name in variants:
                try:
                    cfg = named[name] if name in (named or {}) else gd.cfg_of(name)
                    out = ig.int4_moe_gemm(x, ew, tw, ti, cfg, backend="gluon")
                    torch.cuda.synchronize()
                    eg, mg = gd.rel(out, ref), gd.maxrel(out, ref)
                    same = bool(torch.equal(out, table))
                    ok = (
                        bool(torch.isfinite(out.float()).all())
                        and eg <= 2 * et + 1e-6
                        and mg <= 2 * mt + 1e-6
                    )
                    log(f"  K2 T={T}: {name} rel {eg:.2e} max {mg:.2e} "
                        f"{'bit-identical to' if same else 'differs from'} "
                        f"{'the table' if base is None else 'the base'} "
                        f"{'ok' if ok else 'FAIL'}")  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    ok = False
                    log(f"  K2 T={T}: {name} ERROR {type(e).__name__}: {str(e)[:600]}")
                result(kind="check", case=f"K2 T={T}", cfg=name, ok=ok)
            del ew
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            log(f"  K2 T={T}: ERROR {type(e).__name__}: {str(e)[:600]}")


def part_time(T, routing, variants):
    import gluon_int4_device as gd
    import model_speed as ms
    import torch

    from k2serve.kernels import int4_gemm as ig

    torch.manual_seed(0)
    ew = ms._rand_experts("int4", E, D, I, "cuda")
    tw, ti = route(T, routing)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    hit = int(ti.unique().numel())
    flops = 2 * 3 * D * I * T * K
    it = 5 if T >= 8192 else 10
    base = ig.int4_moe_gemm(x, ew, tw, ti, backend="gluon")
    told = os.environ.get("PREFILL_ALL") == "1"  # --all: every variant at every T
    per = T * K / E  # pairs an expert
    for name in ["table", *variants]:
        cfg = None if name == "table" else gd.cfg_of(name)
        if cfg and not (per / 4 <= cfg["BLOCK_M"] <= 4 * max(16, per)) and not told:
            continue  # token tiles far past or below an expert's pairs
        fn = lambda cfg=cfg: ig.int4_moe_gemm(x, ew, tw, ti, cfg, backend="gluon")  # noqa: E731
        try:
            diff = gd.rel(fn(), base)
            t = ms.timed(fn, iters=it, warmup=2)
        except Exception as e:  # noqa: BLE001
            log(f"  T={T} {routing} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
            continue
        log(f"  T={T} {routing} ({hit} experts) {name:18s} {t:8.3f} ms {flops / t / 1e9:6.1f} "
            f"TFLOP/s vs table {diff:.1e}")  # fmt: skip
        result(
            kind="time", T=T, routing=routing, name=name, ms=t, tflops=flops / t / 1e9, diff=diff
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="")
    ap.add_argument("--T", type=int, default=0)
    ap.add_argument("--routing", default="uniform,third")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--ts", default=DEFAULT_TS)
    ap.add_argument("--layer-ts", default="64,2048,8192,16384", help="K2 layer checks' T")
    ap.add_argument("--third-ts", default="8192,16384", help="T timed under one-third routing")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts")
    ap.add_argument("--name", default="prefill_gemm", help="output: $OUT/<name>.txt")
    ap.add_argument("--all", action="store_true", help="every variant at every T")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.all:
        os.environ["PREFILL_ALL"] = "1"  # the time parts' processes inherit it
    if args.part == "check":
        part_check(variants)
        return 0
    if args.part == "layers":
        part_layers(variants, [int(t) for t in args.layer_ts.split(",")])
        return 0
    if args.part == "time":
        part_time(args.T, args.routing, variants)
        return 0
    t0 = time.time()
    out_dir = os.environ.get("OUT", "/tmp/k2out")
    os.makedirs(out_dir, exist_ok=True)
    base = ["--variants", args.variants, "--layer-ts", args.layer_ts]
    with open(os.path.join(out_dir, f"{args.name}.txt"), "w") as sink:
        res = child(["--part", "check", *base], 90, sink)
        res += child(["--part", "layers", *base], 100, sink)
        ceil = next(
            (r for r in res if r["kind"] == "ceil"), {"bw": float("nan"), "mm": float("nan")}
        )
        checks = [r for r in res if r["kind"] == "check"]
        bad = sorted({r["cfg"] for r in checks if not r["ok"]})
        ts = [int(t) for t in args.ts.split(",")]
        # one-third routing (the k2-slice's) at the long prompts only unless told otherwise
        third = {int(t) for t in args.third_ts.split(",") if t}
        runs = [(T, r) for r in args.routing.split(",") for T in ts
                if r == "uniform" or T in third]  # fmt: skip
        runs.sort(key=lambda tr: (tr[0] != 8192, tr[1] != "uniform"))  # the 8K figures first
        for T, routing in runs:
            left = args.budget - (time.time() - t0)
            if left < 12:
                log(f"== T={T} {routing}: skipped, {left:.0f} s of the budget left")
                continue
            res += child(
                ["--part", "time", "--T", str(T), "--routing", routing, *base], min(left, 60), sink
            )
        lines = [
            "",
            f"bf16 matmul {ceil['mm']:.0f} TFLOP/s, copy {ceil['bw']:.0f} GB/s; checks "
            f"{sum(r['ok'] for r in checks)}/{len(checks)} passed"
            + (f" (FAILED: {', '.join(bad)})" if bad else ""),
            "| T | routing | config | ms | TFLOP/s | % bf16 matmul | vs table | rel diff vs table |",
            "|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        times = [r for r in res if r["kind"] == "time"]
        for r in sorted(times, key=lambda r: (r["routing"], r["T"])):
            tab = next(
                (
                    s
                    for s in times
                    if s["T"] == r["T"] and s["routing"] == r["routing"] and s["name"] == "table"
                ),
                None,
            )
            vs = f"{tab['ms'] / r['ms']:.3f}x" if tab else "n/a"
            flag = " (FAILED a check)" if r["name"] in bad else ""
            lines.append(f"| {r['T']} | {r['routing']} | {r['name']}{flag} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                         f"{100 * r['tflops'] / ceil['mm']:.0f} | {vs} | {r['diff']:.1e} |")  # fmt: skip
        lines.append(f"total {time.time() - t0:.0f} s")
        for line in lines:
            log(line)
            sink.write(line + "\n")
    return 0


def child(args, timeout, sink, script=None):
    """This script's part (or `script`'s) in a new process; its output to stdout and the sink;
    RESULT lines back."""
    cmd = [sys.executable, script or os.path.abspath(__file__), *args]
    out = []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, timeout))
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    for line in text.splitlines():
        if line.startswith("RESULT "):
            out.append(json.loads(line[7:]))
        else:
            log(line)
            sink.write(line + "\n")
    msg = f"== part {' '.join(args)}: rc={rc}"
    log(msg)
    sink.write(msg + "\n")
    return out


if __name__ == "__main__":
    sys.exit(main())
