# ruff: noqa: E741, E501
"""The warp-specialized FP8-block prompt GEMM (kernels/fp8_gemm_gluon_ws.py, issue 28) on one
H100: the GPU tests first, then K2 layer checks, then one K2 FP8 MoE layer timed with the
shipped table (FP8_GLUON_TABLE = h100.json fp8_prefill_gluon) against each WS config.
Full output in $OUT/wsfp8_device.txt (+ $OUT/wsfp8_pytest.txt).

Run (repo root, one H100, < 200 s): bash benchmarks/wsfp8_device.sh
Parts, each in its own process (a kernel fault or a hang cannot take the later ones with it;
every config fail-soft: the error is printed and the next one runs):
  tests   pytest -m gpu tests/kernels/test_fp8_gemm_gluon_ws.py (first, to the end; its
          summary line printed): WS against the shipped kernel with the same tile, bit for bit
          (padding rows, an expert without pairs, partial N blocks, SILU, the routing-weight
          store), and near the fp32 reference.
  layers  fp8_moe_gluon on a K2 layer (E=384, D=7168, I=2048, top-8) at T=2048 and 8192
          (uniform): each WS config against the shipped table ("table"): bit-identical
          expected (the same sums in the same order, any tile); pass: rel diff <= 4e-3 and
          finite; at 2048 also against fp8_moe (the plain-Triton path).
  time    one K2 FP8 MoE layer (both launches) at T=8192 uniform and "third" (every token's
          experts from a fixed third), 16384, 4096: "table" and each WS config whose checks
          passed; the bf16 matmul rate of the same run (moe_libs.ceilings).
Config names: fp8_gluon_device.cfg_of's (x: WS=1, xx: WS=2, e N: RELEASE, y N: producer warps,
z: fence).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import prefill_device as pd  # noqa: E402 - route, child, log, result
import wsgemm_device as wg  # noqa: E402 - run_tests

VARIANTS = ["128x128k64s6w8pfxx", "128x128k64s6w8pfxxe2", "128x128k64s6w8pfx",
            "64x256k64s6w8pfxx", "128x128k64s8w8pfxxe2"]  # fmt: skip
TS = "8192,16384,4096"  # (+ 8192 third after the first)
LAYER_TS = (2048, 8192)
BUDGET_S = 190
DEV = "cuda"  # (a CPU dry run of the parts sets "cpu" with stand-in kernels)


def _layer(T, routing, seed=0):
    import fp8_gluon_device as fd
    import torch

    torch.manual_seed(seed)
    ew = fd.fp8_experts(pd.E, pd.D, pd.I, DEV)
    tw, ti = pd.route(T, routing, DEV)
    x = torch.randn(T, pd.D, device=DEV, dtype=torch.bfloat16)
    return ew, tw, ti, x


def part_layers(variants):
    import fp8_gluon_device as fd
    import torch

    from k2serve.kernels import fp8_gemm_gluon as fg
    from k2serve.kernels import fp8_moe as fm

    FP8_GLUON_TABLE, fp8_moe_gluon, fp8_moe = fg.FP8_GLUON_TABLE, fg.fp8_moe_gluon, fm.fp8_moe
    for T in LAYER_TS:
        ew, tw, ti, x = _layer(T, "uniform", seed=T)
        base = fp8_moe_gluon(x, ew, tw, ti, FP8_GLUON_TABLE)
        old = fp8_moe(x, ew, tw, ti) if T == LAYER_TS[0] else None
        for name in variants:
            try:
                out = fp8_moe_gluon(x, ew, tw, ti, fd.cfg_of(name))
                diff, same = fd.rel(out, base), bool(torch.equal(out, base))
                ok = bool(torch.isfinite(out).all()) and diff <= 4e-3
                extra = f", vs fp8_moe {fd.rel(out, old):.1e}" if old is not None else ""
                if old is not None:
                    ok &= fd.rel(out, old) <= 4e-3
            except Exception as e:  # noqa: BLE001
                pd.log(f"  layer T={T} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
                pd.result(kind="check", cfg=name, T=T, ok=False)
                continue
            pd.log(f"  layer T={T} {name:22s} vs table {diff:.1e}{' (bit-identical)' if same else ''}"
                   f"{extra}: {'ok' if ok else 'FAILED'}")  # fmt: skip
            pd.result(kind="check", cfg=name, T=T, ok=ok, same=same)


def part_time(T, routing, variants):
    import fp8_gluon_device as fd
    import model_speed as ms
    import moe_libs as ml
    import torch

    from k2serve.kernels import fp8_gemm_gluon as fg

    FP8_GLUON_TABLE, fp8_moe_gluon = fg.FP8_GLUON_TABLE, fg.fp8_moe_gluon
    ew, tw, ti, x = _layer(T, routing)
    hit = int(ti.unique().numel())
    flops = ml.moe_flops(T)
    it = 5 if T >= 8192 else 10
    base = fp8_moe_gluon(x, ew, tw, ti, FP8_GLUON_TABLE)
    for name in ["table", *variants]:
        cfg = FP8_GLUON_TABLE if name == "table" else fd.cfg_of(name)
        fn = lambda cfg=cfg: fp8_moe_gluon(x, ew, tw, ti, cfg)  # noqa: E731
        try:
            out = fn()
            diff, same = fd.rel(out, base), bool(torch.equal(out, base))
            t = ms.timed(fn, iters=it, warmup=2)
        except Exception as e:  # noqa: BLE001
            pd.log(f"  T={T} {routing} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
            continue
        pd.log(f"  T={T} {routing} ({hit} experts) {name:22s} {t:8.3f} ms {flops / t / 1e9:6.1f} "
               f"TFLOP/s vs table {diff:.1e}{' (bit-identical)' if same else ''}")  # fmt: skip
        pd.result(kind="time", T=T, routing=routing, name=name, ms=t, tflops=flops / t / 1e9,
                  diff=diff)  # fmt: skip


def summary(res, ceil, tests_ok, summary_line, bad, elapsed) -> list[str]:
    """The table of the run: per T and routing, each config's ms, TFLOP/s, % of the bf16
    matmul rate and speed-up against the shipped table."""
    checks = [r for r in res if r["kind"] == "check"]
    lines = [
        "",
        f"GPU tests: {summary_line}{'' if tests_ok or tests_ok is None else ' (FAILED)'}",
        f"bf16 matmul {ceil['mm']:.0f} TFLOP/s; K2 layer checks {sum(r['ok'] for r in checks)}/{len(checks)} passed"
        + (f" (FAILED: {', '.join(bad)})" if bad else "")
        + f"; bit-identical to the table {sum(bool(r.get('same')) for r in checks)}/{len(checks)}",
        "table: the shipped fp8_prefill_gluon configs (h100.json); the others: WS configs",
        "| T | routing | config | ms | TFLOP/s | % bf16 matmul | vs table | rel diff vs table |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    times = [r for r in res if r["kind"] == "time"]
    for r in sorted(times, key=lambda r: (r["routing"], r["T"])):
        ref = next((s for s in times if (s["T"], s["routing"], s["name"]) == (r["T"], r["routing"], "table")), None)  # fmt: skip
        vs = f"{ref['ms'] / r['ms']:.3f}x" if ref else "n/a"
        lines.append(f"| {r['T']} | {r['routing']} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                     f"{100 * r['tflops'] / ceil['mm']:.0f} | {vs} | {r['diff']:.1e} |")  # fmt: skip
    lines.append(f"total {elapsed:.0f} s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="")
    ap.add_argument("--T", type=int, default=0)
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--ts", default=TS)
    ap.add_argument("--budget", type=float, default=BUDGET_S)
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if args.part == "time":
        part_time(args.T, args.routing, variants)
        return 0
    if args.part == "ceil":
        wg.part_ceil()
        return 0
    if args.part == "layers":
        part_layers(variants)
        return 0
    t0 = time.time()
    out_dir = os.environ.get("OUT", "/tmp/k2out")
    os.makedirs(out_dir, exist_ok=True)

    def child(a, timeout, sink):  # a part of this script in its own process
        return pd.child(a, timeout, sink, script=os.path.abspath(__file__))

    with open(os.path.join(out_dir, "wsfp8_device.txt"), "w") as sink:
        tests_ok, line = (
            (None, "skipped")
            if args.skip_tests
            else wg.run_tests(out_dir, 90, sink, "tests/kernels/test_fp8_gemm_gluon_ws.py", "wsfp8")
        )
        res = child(["--part", "layers", "--variants", ",".join(variants)], 60, sink)
        res += child(["--part", "ceil"], 20, sink)
        ceil = next(
            (r for r in res if r["kind"] == "ceil"), {"mm": float("nan"), "bw": float("nan")}
        )
        checks = [r for r in res if r["kind"] == "check"]
        bad = sorted({r["cfg"] for r in checks if not r["ok"]})
        # only configs whose K2 layer checks passed are timed (a hang or a fault in one would
        # take each time part with it)
        passed = {r["cfg"] for r in checks} - set(bad)
        for v in variants:
            if v not in passed:
                pd.log(f"== {v}: not timed (its K2 layer checks failed or did not finish)")
        timed_variants = ",".join(v for v in variants if v in passed)
        runs = [(int(t), "uniform") for t in args.ts.split(",")]
        runs.insert(1, (8192, "third"))
        for T, routing in runs:
            left = args.budget - (time.time() - t0)
            if left < 10:
                pd.log(f"== T={T} {routing}: skipped, {left:.0f} s of the budget left")
                continue
            res += child(["--part", "time", "--T", str(T), "--routing", routing, "--variants",
                          timed_variants], min(left, 40), sink)  # fmt: skip
        for ln in summary(res, ceil, tests_ok, line, bad, time.time() - t0):
            pd.log(ln)
            sink.write(ln + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
