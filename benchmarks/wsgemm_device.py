# ruff: noqa: E741, E501
"""The warp-specialized INT4 prompt GEMM (kernels/int4_gemm_gluon_ws.py, issue 28) on one H100:
the GPU tests first, then K2 layer checks, then one K2 MoE layer timed with the table before
WS against the table with it (h100.json int4_prefill_gluon = GLUON_TABLE) and the WS configs.
Full output in $OUT/wsgemm_device.txt (+ $OUT/wsgemm_pytest.txt).

Run (repo root, one H100, < 200 s): bash benchmarks/wsgemm_device.sh
Parts, each in its own process (a kernel fault or a hang cannot take the later ones with it;
every config fail-soft: the error is printed and the next one runs):
  tests   pytest -m gpu tests/kernels/test_int4_gemm_gluon_ws.py (first, to the end; its
          summary line is printed): WS against the shipped kernel with the same tile, bit for
          bit (padding rows, an expert without pairs, partial N blocks, SILU, the
          routing-weight store), and near the fp32 reference.
  layers  prefill_device.part_layers: int4_moe_gemm on a K2 layer at T=2048 and 8192, the
          table and each WS config against "before" (bit-identical expected: the same sums
          in the same order) and, at 2048, fused_moe_ref.
  time    one K2 MoE layer (E=384, D=7168, I=2048, top-8; both launches, int4_moe_gemm) at
          T=8192 uniform and "third" (every token's experts from a fixed third), 16384, 4096,
          2048: "before" (the table's entries without WS: the shipped configs), "table" (with
          WS from 32768 pairs) and each WS config (token tiles near the experts' pair
          counts); the bf16 matmul rate of the same run (moe_libs.ceilings).
Config names are gluon_int4_device.cfg_of's: x = WS=1 (one consumer partition of num_warps,
its warpgroups meet once a sub-step), xx = WS=2 (a consumer partition per warpgroup), p1: a
1-warp producer (4 by default), e2: RELEASE=2, f: the proxy fence.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import prefill_device as pd  # noqa: E402 - route, child, part_layers, log, result

# the table's WS configs (more names, e.g. 128x256s4w8hlgxx, 64x256s6w8hlx: --variants)
VARIANTS = ["128x256s4w8hlgx", "128x256s4w8hlgxxe2"]
TS = "8192,16384,4096,2048"  # (+ 8192 third after the first)
BUDGET_S = 190


def tables() -> dict:
    """ "table": the kernel's table (GLUON_TABLE, h100.json's: WS from 32768 pairs); "before":
    its entries without WS, the last band open (the shipped configs before WS)."""
    from k2serve.kernels.int4_gemm_gluon import GLUON_TABLE

    before = [dict(e) for e in GLUON_TABLE if not e.get("WS")]
    before[-1]["max_pairs"] = None
    return {"table": [dict(e) for e in GLUON_TABLE], "before": before}


def part_time(T, routing, variants):
    import gluon_int4_device as gd
    import model_speed as ms
    import moe_libs as ml
    import torch

    from k2serve.kernels import int4_gemm as ig

    torch.manual_seed(0)
    ew = ms._rand_experts("int4", pd.E, pd.D, pd.I, "cuda")
    tw, ti = pd.route(T, routing)
    x = torch.randn(T, pd.D, device="cuda", dtype=torch.bfloat16)
    hit = int(ti.unique().numel())
    flops = ml.moe_flops(T)
    it = 5 if T >= 8192 else 10
    named = tables()
    base = ig.int4_moe_gemm(x, ew, tw, ti, named["before"], backend="gluon")
    per = T * pd.K / pd.E  # pairs an expert (uniform)
    names = ["before", *(["table"] if os.environ.get("WS_TABLE_OK") == "1" else []), *variants]
    for name in names:
        cfg = named[name] if name in named else gd.cfg_of(name)
        if isinstance(cfg, dict) and not per / 4 <= cfg["BLOCK_M"] <= 4 * max(16, per):
            continue  # token tiles far past or below an expert's pairs
        fn = lambda cfg=cfg: ig.int4_moe_gemm(x, ew, tw, ti, cfg, backend="gluon")  # noqa: E731
        try:
            out = fn()
            diff, same = gd.rel(out, base), bool(torch.equal(out, base))
            t = ms.timed(fn, iters=it, warmup=2)
        except Exception as e:  # noqa: BLE001
            pd.log(f"  T={T} {routing} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
            continue
        pd.log(f"  T={T} {routing} ({hit} experts) {name:18s} {t:8.3f} ms {flops / t / 1e9:6.1f} "
               f"TFLOP/s vs before {diff:.1e}{' (bit-identical)' if same else ''}")  # fmt: skip
        pd.result(kind="time", T=T, routing=routing, name=name, ms=t, tflops=flops / t / 1e9,
                  diff=diff)  # fmt: skip


def part_ceil():
    import moe_libs as ml

    ml.ceilings()
    pd.result(kind="ceil", mm=ml.CEIL["mm"], bw=ml.CEIL["bw"])


def run_tests(out_dir, timeout, sink, test="tests/kernels/test_int4_gemm_gluon_ws.py",
              name="wsgemm"):  # fmt: skip
    """The GPU tests of `test`, to the end (killed past `timeout` s), output in
    <name>_pytest.txt; their failures and summary line printed; (whether they passed, the
    summary line)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", test,
           "-rfs"]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    with open(os.path.join(out_dir, f"{name}_pytest.txt"), "w") as f:
        f.write(text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    counts = re.compile(r"\d+ (passed|failed|skipped|deselected|errors?)\b.* in [\d.]+s")
    summary = next((ln.strip("= ") for ln in reversed(lines) if counts.search(ln)),
                   f"no summary (rc={rc})")  # fmt: skip
    for line in [*(ln for ln in lines if ln.startswith(("FAILED", "ERROR"))),
                 f"== GPU tests: {summary} (rc={rc})"]:  # fmt: skip
        pd.log(line)
        sink.write(line + "\n")
    return rc == 0, summary


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
        part_ceil()
        return 0
    if args.part == "layers":
        named = tables()
        pd.part_layers(variants, [2048, 8192], base=named["before"], named=named)
        return 0
    t0 = time.time()
    out_dir = os.environ.get("OUT", "/tmp/k2out")
    os.makedirs(out_dir, exist_ok=True)

    def child(a, timeout, sink):  # a part of this script in its own process
        return pd.child(a, timeout, sink, script=os.path.abspath(__file__))

    with open(os.path.join(out_dir, "wsgemm_device.txt"), "w") as sink:
        tests_ok, summary = (None, "skipped") if args.skip_tests else run_tests(out_dir, 100, sink)
        res = child(["--part", "layers", "--variants", ",".join(["table", *variants])], 80, sink)
        res += child(["--part", "ceil"], 20, sink)
        ceil = next(
            (r for r in res if r["kind"] == "ceil"), {"mm": float("nan"), "bw": float("nan")}
        )
        checks = [r for r in res if r["kind"] == "check"]
        bad = sorted({r["cfg"] for r in checks if not r["ok"]})
        # only configs whose K2 layer checks passed are timed (a hang or a fault in one would
        # take each time part with it); the table: when its own checks passed
        passed = {r["cfg"] for r in checks} - set(bad)
        for v in ["table", *variants]:
            if v not in passed:
                pd.log(f"== {v}: not timed (its K2 layer checks failed or did not finish)")
        os.environ["WS_TABLE_OK"] = "1" if "table" in passed else "0"
        timed_variants = ",".join(v for v in variants if v in passed)
        runs = [(int(t), "uniform") for t in args.ts.split(",")]
        runs.insert(1, (8192, "third"))
        for T, routing in runs:
            left = args.budget - (time.time() - t0)
            if left < 10:
                pd.log(f"== T={T} {routing}: skipped, {left:.0f} s of the budget left")
                continue
            res += child(["--part", "time", "--T", str(T), "--routing", routing, "--variants",
                          timed_variants], min(left, 45), sink)  # fmt: skip
        lines = [
            "",
            f"GPU tests: {summary}{'' if tests_ok or tests_ok is None else ' (FAILED)'}",
            f"bf16 matmul {ceil['mm']:.0f} TFLOP/s; K2 layer checks {sum(r['ok'] for r in checks)}/{len(checks)} passed"
            + (f" (FAILED: {', '.join(bad)})" if bad else ""),
            "before: the shipped configs (the table without WS); table: h100.json's, WS from 32768 pairs",
            "| T | routing | config | ms | TFLOP/s | % bf16 matmul | vs before | rel diff vs before |",
            "|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        times = [r for r in res if r["kind"] == "time"]
        for r in sorted(times, key=lambda r: (r["routing"], r["T"])):
            ref = next((s for s in times if (s["T"], s["routing"], s["name"]) == (r["T"], r["routing"], "before")), None)  # fmt: skip
            vs = f"{ref['ms'] / r['ms']:.3f}x" if ref else "n/a"
            flag = " (FAILED a check)" if r["name"] in bad else ""
            lines.append(f"| {r['T']} | {r['routing']} | {r['name']}{flag} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                         f"{100 * r['tflops'] / ceil['mm']:.0f} | {vs} | {r['diff']:.1e} |")  # fmt: skip
        lines.append(f"total {time.time() - t0:.0f} s")
        for line in lines:
            pd.log(line)
            sink.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
