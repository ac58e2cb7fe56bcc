# ruff: noqa: E741, E501
"""The Gluon INT4 grouped GEMM (kernels/int4_gemm_gluon.py) on one H100: correctness first, then
one K2 MoE layer's time against the shipped Triton kernel and dequant + torch._grouped_mm.

Run (repo root, one H100, < 240 s): bash benchmarks/gluon_int4_device.sh
  (= PYTHONPATH=src python3 benchmarks/gluon_int4_device.py; output also in $OUT/gluon_int4.txt)
Parts, each in its own process (a kernel fault cannot take the later parts with it) and each
config fail-soft (the exception is printed, the next config runs):
  check  the copy bandwidth and bf16 matmul rate; then the Gluon launch against the Triton one
         (`_gemm`) and an fp32 torch reference on small shapes (partial N block, padding rows,
         an expert without pairs, K shorter than the ring), then int4_moe_gemm on a K2 layer
         at T=64 and 2048 against fused_moe_ref. Pass: error <= 2x the Triton kernel's.
  time T one K2 MoE layer (E=384, D=7168, I=2048, top-8, group 32, uniform routing; both GEMMs
         of int4_moe_gemm, CUDA-event median): the shipped kernel, dequant + grouped_mm, the
         Gluon table and a config sweep; TFLOP/s (2 * 3 * D * I * T * 8) and % of the bf16
         matmul, and % of copy bandwidth of the INT4 bytes read (experts hit + activations).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
E, D, I, K = 384, 7168, 2048, 8
TS = (128, 2048, 8192, 16384)
# Gluon sweep (names: cfg_of); registers / shared memory / SASS waits of each:
# benchmarks/gluon_compile.py
SWEEP = ["8x64s6w4", "16x64s6w4h", "16x128s6w4h", "32x128s6w4h", "64x128s4w4h", "64x128s4w4hf",
         "64x128s3w8k32h", "64x128s4w8k32h", "64x256s5w8h", "64x256s3w8k32h", "32x256s4w8k32h",
         "128x128s4w8h", "128x256s4w8h", "128x256s3w8h"]  # fmt: skip
CHECK = ["8x64s6w4", "16x64s6w4h", "64x128s4w4hi2", "128x128s4w8", "64x128s3w8k32h",
         "64x256s3w8k32h", "128x256s4w8h", "32x256s4w8k32h"]  # fmt: skip
BUDGET_S = 235


def log(*a):
    print(*a, flush=True)


def result(**kv):  # one machine-readable line for the driver
    log("RESULT " + json.dumps(kv))


def cfg_of(name: str) -> dict:
    """BLOCK_M x BLOCK_N s STAGES w num_warps [k W2] [h: bf16x2 dequant] [i INFLIGHT]
    [f: proxy fence] [t: TAIL] [l: L1] [w: KW, ww: KW=2] [g: SILU] [c: CARVE] [r: MAXNREG, 2 CTAs]
    [x: WS, the warp-specialized kernel, xx: WS=2, a partition per warpgroup; p N: its producer
    warps; e N: RELEASE=N, where a stage is released (int4_gemm_gluon_ws.py)]: "64x128s4w4", "128x256s3w8hl",
    "32x512s3w16hwwc", "128x256s4w8hlgx"."""
    m = re.fullmatch(
        r"(\d+)x(\d+)s(\d+)w(\d+)(?:k(\d+))?(h?)(?:i(\d))?(f?)(t?)(l?)(w{0,2})(g?)(c?)(r?)(x{0,2})(?:p(\d))?(?:e(\d))?",
        name,
    )
    bm, bn, st, nw = (int(v) for v in m.groups()[:4])
    return dict(
        BLOCK_M=bm,
        BLOCK_N=bn,
        W2=int(m.group(5) or 16),
        STAGES=st,
        num_warps=nw,
        BF16X2=m.group(6) == "h",
        INFLIGHT=int(m.group(7) or 1),
        FENCE=m.group(8) == "f",
        TAIL=m.group(9) == "t",
        L1=m.group(10) == "l",
        KW=len(m.group(11)),
        SILU=m.group(12) == "g",
        CARVE=m.group(13) == "c",
        MAXNREG=65536 // (64 * nw) if m.group(14) == "r" else 0,
        WS=len(m.group(15)),
        PW=int(m.group(16) or 4),
        RELEASE=int(m.group(17) or 1),
    )


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def maxrel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------ check
def ceilings():
    import model_speed as ms

    ms.part_ceil()
    result(kind="ceil", bw=ms.CEIL["bw"], mm=ms.CEIL["mm"])


def gemm_case(name, E_, N, Kd, T, topk, gate_up, cfgs):
    """One launch of each kernel on the same aligned rows: c [M, N] against a float32 torch
    reference (natural column order; PERM_OUT compared in gemm order)."""
    import torch

    from k2serve.kernels import int4_gemm as ig
    from k2serve.kernels.fused_moe import dequant_int4_ref
    from k2serve.kernels.int4_gemm_gluon import gemm_gluon, gluon_align

    torch.manual_seed(N + T)
    dev = os.environ.get("GLUON_CHECK_DEVICE", "cuda")  # cpu: the harness under TRITON_INTERPRET
    w = torch.randint(-(2**31), 2**31 - 1, (E_, N, Kd // 8), dtype=torch.int32, device=dev)
    s = (torch.rand(E_, N, Kd // 32, device=dev) * 0.004 + 0.002).bfloat16()
    ids = (
        torch.stack([torch.randperm(E_ - 1)[:topk] for _ in range(T)]).int().to(dev)
    )  # E_-1: no pairs
    M = T * topk
    a_div = topk if gate_up else 1
    x = torch.randn(M // a_div, Kd, device=dev, dtype=torch.bfloat16)
    tw = torch.rand(M, device=dev)
    ref = torch.zeros(M, N, device=dev)
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():
        p = (flat == e).nonzero().squeeze(1)
        ref[p] = x[p // a_div].float() @ dequant_int4_ref(w[e], s[e]).t()
    if not gate_up:
        ref = ref * tw[:, None]

    def launch(fn, cfg):  # activations (and PERM_OUT's output columns) in gemm order for W2
        c = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
        sid, eid, npost, units = gluon_align(ids, E_, cfg)
        xg = ig.to_gemm_order(x, cfg["W2"])
        kw = dict(units=units) if units is not None else {}
        fn(xg, w, s, c, tw, sid, eid, npost, N, Kd, M, a_div, not gate_up, gate_up, cfg, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        return ig.to_gemm_order(ref, cfg["W2"]) if gate_up else ref, c

    tcfg = dict(BLOCK_M=16, BLOCK_N=64, W2=16, num_warps=2, num_stages=3)
    rt, ct = launch(ig._gemm, tcfg)
    et, mt = rel(ct, rt), maxrel(ct, rt)
    log(f"  {name}: triton rel {et:.2e} max {mt:.2e}")
    ok_all = True
    for cname in cfgs:
        if Kd % (16 * cfg_of(cname)["W2"]):
            continue  # K steps of 16 * W2 columns
        try:
            rg, cg = launch(gemm_gluon, cfg_of(cname))
            eg, mg = rel(cg, rg), maxrel(cg, rg)
            ok = (
                bool(torch.isfinite(cg.float()).all())
                and eg <= 2 * et + 1e-6
                and mg <= 2 * mt + 1e-6
            )
            vs = f"{rel(cg, ct):.2e}" if cfg_of(cname)["W2"] == 16 or not gate_up else "n/a"
            log(
                f"  {name}: gluon {cname} rel {eg:.2e} max {mg:.2e} vs triton {vs} {'ok' if ok else 'FAIL'}"
            )
        except Exception as e:  # noqa: BLE001 - report and go on
            ok = False
            log(f"  {name}: gluon {cname} ERROR {type(e).__name__}: {str(e)[:600]}")
        ok_all &= ok
        result(kind="check", case=name, cfg=cname, ok=ok)
    return ok_all


def layer_case(T, cfgs):
    import model_speed as ms
    import torch

    from k2serve.kernels import int4_gemm as ig
    from k2serve.kernels.fused_moe import fused_moe_ref

    torch.manual_seed(T)
    ew = ms._rand_experts("int4", E, D, I, "cuda")
    tw, ti = ms._route(T, E, K, "cuda")
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ref = fused_moe_ref(x, ew, tw, ti)
    tri = ig.int4_moe_gemm(x, ew, tw, ti, backend="triton")
    et, mt = rel(tri, ref), maxrel(tri, ref)
    log(f"  K2 layer T={T}: triton (shipped table) rel {et:.2e} max {mt:.2e}")
    for cname in [None, *cfgs]:
        label = cname or "table"
        try:
            out = ig.int4_moe_gemm(x, ew, tw, ti, cfg_of(cname) if cname else None, backend="gluon")
            torch.cuda.synchronize()
            eg, mg = rel(out, ref), maxrel(out, ref)
            ok = (
                bool(torch.isfinite(out.float()).all())
                and eg <= 2 * et + 1e-6
                and mg <= 2 * mt + 1e-6
            )
            log(
                f"  K2 layer T={T}: gluon {label} rel {eg:.2e} max {mg:.2e} {'ok' if ok else 'FAIL'}"
            )
        except Exception as e:  # noqa: BLE001
            ok = False
            log(f"  K2 layer T={T}: gluon {label} ERROR {type(e).__name__}: {str(e)[:600]}")
        result(kind="check", case=f"K2 T={T}", cfg=label, ok=ok)
    del ew
    torch.cuda.empty_cache()


def part_check():
    import torch
    import triton

    from k2serve.kernels import int4_gemm_gluon as gg

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"gluon available {gg.gluon_available()} usable {gg.gluon_usable('cuda')}")  # fmt: skip
    ceilings()
    if not gg.gluon_usable("cuda"):
        log("  Gluon kernel cannot run here: no checks")
        return
    for args in (
        ("gate_up E5 N512 K512 T37 top2 (padding rows, perm_out)", 5, 512, 512, 37, 2, True),
        ("down E5 N320 K768 T37 top2 (partial N block, mul_w)", 5, 320, 768, 37, 2, False),
        ("down E4 N384 K1024 T50 top2 (k32 planes)", 4, 384, 1024, 50, 2, False),
        ("down E3 N256 K256 T1 top2 (2 sub-steps < ring)", 3, 256, 256, 1, 2, False),
    ):
        try:
            gemm_case(*args, CHECK)
        except Exception as e:  # noqa: BLE001
            log(f"  {args[0]}: ERROR {type(e).__name__}: {str(e)[:600]}")
    for T in (64, 2048):
        try:
            layer_case(T, ["16x128s6w4h", "64x128s3w8k32h", "128x256s4w8h", "32x256s4w8k32h"])
        except Exception as e:  # noqa: BLE001
            log(f"  K2 layer T={T}: ERROR {type(e).__name__}: {str(e)[:600]}")


# ------------------------------------------------------------------------------------ time
def part_time(T: int, with_gluon: bool):
    import model_speed as ms
    import torch

    from k2serve.kernels import int4_gemm as ig

    torch.manual_seed(0)
    ew = ms._rand_experts("int4", E, D, I, "cuda")
    per_expert = sum(
        t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale)
    )
    tw, ti = ms._route(T, E, K, "cuda")
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    hit = int(ti.unique().numel())
    nbytes, flops = hit * per_expert + 2 * T * D * 2, 2 * 3 * D * I * T * K
    it = 5 if T >= 8192 else 10
    base = ig.int4_moe_gemm(x, ew, tw, ti, backend="triton")
    cases = [("triton (shipped)", lambda: ig.int4_moe_gemm(x, ew, tw, ti, backend="triton"), None),
             ("dequant+grouped_mm", lambda: ig.int4_moe_grouped_mm(x, ew, tw, ti), None)]  # fmt: skip
    if with_gluon:
        cases.append(("gluon table", None, None))
        for c in os.environ.get("GLUON_SWEEP", ",".join(SWEEP)).split(","):
            bm, per = cfg_of(c)["BLOCK_M"], T * K // E  # an expert's rows
            told = "GLUON_SWEEP" in os.environ  # configs named on the command line: all of them
            if told or (8 * bm >= per and bm <= 2 * max(16, per)):  # no tiles far past / below
                cases.append((f"gluon {c}", None, cfg_of(c)))
    for name, fn, cfg in cases:
        if fn is None:
            fn = (lambda cfg=cfg: ig.int4_moe_gemm(x, ew, tw, ti, cfg, backend="gluon"))  # fmt: skip
        try:
            diff = rel(fn(), base)
            t = ms.timed(fn, iters=it, warmup=2)
        except Exception as e:  # noqa: BLE001
            log(f"  T={T} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
            continue
        log(f"  T={T} ({hit} experts) {name:22s} {t:8.3f} ms {flops / t / 1e9:6.1f} TFLOP/s "
            f"{nbytes / t / 1e6:6.0f} GB/s  vs shipped {diff:.1e}")  # fmt: skip
        result(
            kind="time",
            T=T,
            name=name,
            ms=t,
            tflops=flops / t / 1e9,
            gbs=nbytes / t / 1e6,
            diff=diff,
        )


# ------------------------------------------------------------------------------------ driver
def child(args: list[str], timeout: float, sink) -> list[dict]:
    """Run this script's part in a new process; its output goes to stdout and the sink, its
    RESULT lines come back."""
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    out: list[dict] = []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, timeout))
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    for line in text.splitlines():
        if line.startswith("RESULT "):
            out.append(json.loads(line[7:]))
        else:
            print(line, flush=True)
            sink.write(line + "\n")
    msg = f"== part {' '.join(args)}: rc={rc}"
    log(msg)
    sink.write(msg + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="", help="check | time (internal: one process per part)")
    ap.add_argument("--T", type=int, default=0)
    ap.add_argument("--no-gluon", action="store_true")
    ap.add_argument("--ts", default=",".join(map(str, TS)))
    ap.add_argument("--sweep", default="", help="configs to time instead of SWEEP (a,b,...)")
    args = ap.parse_args(argv)
    if args.sweep:
        os.environ["GLUON_SWEEP"] = args.sweep  # the time parts' processes inherit it
    sys.path.insert(0, HERE)
    if args.part == "check":
        part_check()
        return 0
    if args.part == "time":
        part_time(args.T, not args.no_gluon)
        return 0
    t0 = time.time()
    out_dir = os.environ.get("OUT", "/tmp/k2out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gluon_int4.txt"), "w") as sink:
        res = child(["--part", "check"], 130, sink)
        ceil = next(
            (r for r in res if r["kind"] == "ceil"), {"bw": float("nan"), "mm": float("nan")}
        )
        checks = [r for r in res if r["kind"] == "check"]
        gluon_ok = bool(checks) and all(r["ok"] for r in checks)
        failed = ", ".join(f"{r['case']} {r['cfg']}" for r in checks if not r["ok"])[:600]
        # a config that failed a check is still timed (its rows say so); none ran: no Gluon
        for T in (int(t) for t in args.ts.split(",")):
            left = BUDGET_S - (time.time() - t0)
            if left < 10:
                log(f"== T={T}: skipped, {left:.0f} s of the budget left")
                continue
            res += child(["--part", "time", "--T", str(T), *([] if checks else ["--no-gluon"])],
                         min(left, 75), sink)  # fmt: skip
        lines = [
            "",
            f"ceilings: copy {ceil['bw']:.0f} GB/s, bf16 matmul {ceil['mm']:.0f} TFLOP/s; "
            f"gluon checks: {sum(r['ok'] for r in checks)}/{len(checks)} passed"
            + ("" if gluon_ok else " (none ran)" if not checks else " (FAILED: " + failed + ")"),
            "| T | kernel | ms | TFLOP/s | % bf16 matmul | % copy bw (INT4 bytes) | rel diff vs shipped |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in res if r["kind"] == "time"):
            lines.append(f"| {r['T']} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                         f"{100 * r['tflops'] / ceil['mm']:.0f} | {100 * r['gbs'] / ceil['bw']:.0f} | "
                         f"{r['diff']:.1e} |")  # fmt: skip
        best = {}
        for r in (r for r in res if r["kind"] == "time" and r["name"].startswith("gluon")):
            if r["diff"] < 1e-2 and r["ms"] < best.get(r["T"], {"ms": 1e9})["ms"]:
                best[r["T"]] = r
        for T, r in sorted(best.items()):
            ship = next(
                (
                    s
                    for s in res
                    if s["kind"] == "time" and s["T"] == T and s["name"].startswith("triton")
                ),
                None,
            )
            sp = f", {ship['ms'] / r['ms']:.2f}x the shipped kernel" if ship else ""
            lines.append(f"best gluon T={T}: {r['name']} {r['ms']:.3f} ms{sp}")
        lines.append(f"total {time.time() - t0:.0f} s")
        for line in lines:
            log(line)
            sink.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
