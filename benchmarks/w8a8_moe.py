# ruff: noqa: E741, E501, B023
"""Prompts on FP8 tensor cores: one K2 MoE layer's routed experts with FP8 activations
(kernels/w8a8_moe.py) against the bf16-activation path the engine runs today and a
transformers-style bf16 torch._grouped_mm peer, with the bf16 and fp8 matmul rates of the run.

Run (repo root, one GPU): PYTHONPATH=src python3 benchmarks/w8a8_moe.py [--tokens 2048,8192]
    [--formats fp8,int4] [--sweep] [--out FILE]
One K2 MoE layer: E=384, D=7168, I=2048, top-8, uniform random routing; FLOPs = 2*3*D*I*T*k.
- limits: torch bf16 matmul and torch._scaled_mm (e4m3 x e4m3 -> bf16, per-tensor scales) at
  8192^3, measured first;
- check: the kernel against the float32 oracle of the same quantized math (w8a8_moe_ref) at
  T=64, then at each T the error of every path against the float32 product with unquantized
  activations (rel = ||out - ref|| / ||ref||, max abs / max |ref|) and fp8's error over bf16's;
- time: ms, TFLOP/s, % of the bf16 and of the fp8 matmul rate for the bf16 path (what
  FusedMoEBackend runs with --moe-prefill-precision bf16: fp8_moe / int4_moe_gemm /
  dequant + grouped_mm), the fp8 path and the peer (FP8-block only: its bf16 weights are the
  dequantized fp8 ones, 34 GB);
- split (FP8-block, each T): the engine's two Gluon FP8 GEMMs and the FP8-activation ones timed
  apart, and FP8 for the down GEMM alone (only the intermediate in e4m3, which fits the
  fidelity budget on the tiny model where both inputs in e4m3 do not; benchmarks/RESULTS.md):
  the whole layer's time and its error against the float32 product beside the engine's;
- --sweep: a few launch configs of the fp8 path at the largest T.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import fp8_moe  # noqa: E402  (the layer inputs)
import model_speed as ms  # noqa: E402  (timers)

E, D, I, K = 384, 7168, 2048, 8
DEV = "cuda" if torch.cuda.is_available() else "cpu"
T0 = time.time()
LINES: list[str] = []
FAILS: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    LINES.append(s)
    print(f"[{time.time() - T0:6.1f}s] {s}", flush=True)


def timed(fn, iters=10, warmup=2) -> float:
    if DEV == "cpu":  # --smoke: the code paths, not a figure
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return ms.timed(fn, iters, warmup)  # median of CUDA-event timed calls


def limits() -> dict[str, float]:
    if DEV == "cpu":
        return {"bf16": float("nan"), "fp8": float("nan")}
    n = 8192
    x = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    mm = 2 * n**3 / timed(lambda: x @ y) / 1e9
    x8 = x.to(torch.float8_e4m3fn)
    y8 = y.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major right operand
    one = torch.ones((), device=DEV)
    f8 = (
        2 * n**3 / timed(lambda: torch._scaled_mm(x8, y8, one, one, out_dtype=torch.bfloat16)) / 1e9
    )
    log(f"limits: bf16 matmul {mm:.0f} TFLOP/s, fp8 matmul (torch._scaled_mm) {f8:.0f} TFLOP/s")
    return {"bf16": mm, "fp8": f8}


def make_experts(fmt):
    """Random experts: fp8 N(0,1) rounded to e4m3 with 128x128 scales in [0.005, 0.015); int4
    random nibbles with group-32 scales in [0.002, 0.006)."""
    from k2serve.kernels.fused_moe import ExpertWeights

    if fmt == "int4":
        pk = lambda n, k: torch.randint(
            -(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32, device=DEV
        )
        sc = lambda n, k: (torch.rand(E, n, k // 32, device=DEV) * 0.004 + 0.002).bfloat16()
        return ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)

    def fp8(n, k):
        out = torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device=DEV)
        for e0 in range(0, E, 16):
            out[e0 : e0 + 16] = torch.randn(min(16, E - e0), n, k, device=DEV, dtype=torch.bfloat16)
        return out

    sc = lambda n, k: torch.rand(E, n // 128, k // 128, device=DEV) * 0.01 + 0.005
    return ExpertWeights("fp8", fp8(2 * I, D), fp8(D, I), sc(2 * I, D), sc(D, I))


def inputs(T, seed):
    """fp8_moe.py's layer inputs and routing, at this module's sizes (--smoke shrinks them)."""
    fp8_moe.D, fp8_moe.E = D, E
    return fp8_moe.inputs(T, seed, DEV)


def errs(out, ref) -> tuple[float, float]:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item(), (
        (out - ref).abs().max() / ref.abs().max()
    ).item()


def bf16_weights(ew):
    """[E, 2I, D] and [E, D, I] bf16 of the dequantized experts (the peer's weights)."""
    from k2serve.kernels.fused_moe import expert_dense

    w13 = torch.empty(E, 2 * I, D, device=DEV, dtype=torch.bfloat16)
    w2 = torch.empty(E, D, I, device=DEV, dtype=torch.bfloat16)
    for e in range(E):
        a, b = expert_dense(ew, e)
        w13[e], w2[e] = a, b
    return w13, w2


def peer(x, w13, w2, tw, ids):
    """transformers-style grouped experts: tokens sorted by expert, torch._grouped_mm per
    projection (bf16), weighted scatter-add; no host sync."""
    T = x.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    tok = order // K
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)  # [M, 2I]
    a = F.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)  # [M, D]
    out = torch.zeros(T, D, device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y.float() * tw.reshape(-1)[order, None])
    return out.to(x.dtype)


def check_oracle(ew):
    from k2serve.kernels import w8a8_moe as wm

    x, tw, ids = inputs(64, 7)
    e, m = errs(wm.w8a8_moe(x, ew, tw, ids), wm.w8a8_moe_ref(x, ew, tw, ids))
    ok = e < 1e-2
    log(
        f"check {ew.quant}: kernel vs float32 oracle of the same quantized math, T=64: rel {e:.2e}, max {m:.2e} {'ok' if ok else 'FAIL'}"
    )
    if not ok:
        FAILS.append(f"{ew.quant} oracle")


def split_times(ew, T):
    """The two GEMMs apart at T tokens (FP8-block experts), the engine's path (the Gluon FP8
    GEMMs, bf16 activations) against FP8 activations, and FP8 for the down GEMM alone (the
    intermediate in e4m3 per token and 128 columns, quantized from its bf16 value, the
    experts' input in bf16: the variant that fits the fidelity budget on the tiny model where
    both inputs in e4m3 do not; benchmarks/RESULTS.md): its time and its error on this layer
    against the float32 product, beside the engine path's."""
    import prefill_split as ps  # (benchmarks/: the engine's Gluon GEMMs one at a time)

    from k2serve.kernels import fp8_gemm_gluon as fg
    from k2serve.kernels import w8a8_moe as wm
    from k2serve.kernels.fused_moe import fused_moe_ref
    from k2serve.kernels.moe_align import moe_align_block_size

    x, tw, ids = inputs(T, T)
    M = T * K
    twf = tw.reshape(-1).float().contiguous()
    cfg = ps.table_cfg("fp8", M)
    gate_up, down = ps.gemms("fp8", ew, x, tw, ids, cfg)
    inter = gate_up()
    t13 = timed(gate_up, iters=5)
    t2 = timed(lambda: down(inter), iters=5)
    wc = wm.PREFILL_CONFIG
    al8 = moe_align_block_size(ids, E, wc["BLOCK_M"])
    h8 = torch.empty(M, I, device=DEV, dtype=torch.float8_e4m3fn)
    hs = torch.empty(M, I // 128, device=DEV, dtype=torch.float32)

    def gate_up8():
        x8, xs = wm.quant_fp8_groups(x)
        wm._gemm(x8, xs, ew.w13, ew.w13_scale, h8, hs, twf, *al8, I, D, M, K, True, False,
                 False, wc["BLOCK_M"], wc["w13"], up_off=I, up_s_off=I // 128)  # fmt: skip

    def down8(h):
        q, s = wm.quant_fp8_groups(h)
        out = torch.empty(M, D, device=DEV, dtype=torch.bfloat16)
        wm._gemm(q, s, ew.w2, ew.w2_scale, out, None, twf, *al8, D, I, M, 1, False, True, False,
                 wc["BLOCK_M"], wc["w2"])  # fmt: skip
        return out

    def engine():
        return fg.fp8_moe_gluon(x, ew, tw, ids, cfg)

    def fp8_down():
        return down8(gate_up()).view(T, K, D).sum(1)

    g8, d8 = timed(gate_up8, iters=5), timed(lambda: down8(inter), iters=5)
    te, tf = timed(engine, iters=5), timed(fp8_down, iters=5)
    ref = fused_moe_ref(x.float(), ew, tw, ids)
    (ee, em), (fe, fm) = errs(engine(), ref), errs(fp8_down(), ref)
    name = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}{' WS' if cfg.get('WS') else ''}"
    log(f"split T={T}: the engine's Gluon FP8 GEMMs ({name}) gate+up {t13:.3f} ms, down {t2:.3f} "
        f"ms; FP8 activations gate+up (with x's quantization) {g8:.3f} ms, down (with h's) "
        f"{d8:.3f} ms")  # fmt: skip
    log(f"fp8-down T={T}: whole layer {te:.3f} -> {tf:.3f} ms ({te / tf:.2f}x); error against "
        f"float32 rel {ee:.2e} -> {fe:.2e} ({fe / ee:.1f}x), max {em:.2e} -> {fm:.2e}")  # fmt: skip


def bench_format(fmt, tokens, lim, sweep, paths=True):
    from dataclasses import replace

    from k2serve.kernels import w8a8_moe as wm
    from k2serve.kernels.fused_moe import fused_moe_ref
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = make_experts(fmt)
    check_oracle(ew)
    pol = KernelPolicy.for_device(DEV, moe_prefill_precision="bf16")
    if DEV == "cpu":  # --smoke: the Triton kernels under the interpreter
        pol = replace(pol, triton=True)
    bf16_path = FusedMoEBackend(ew, **pol.moe_kwargs())
    fp8_pol = replace(pol, moe_prefill_precision="fp8", moe_prefill_min_tokens=0)
    fp8_path = FusedMoEBackend(ew, **fp8_pol.moe_kwargs())
    if fp8_path.w8a8_min_tokens != 0 or bf16_path.w8a8_min_tokens is not None:
        FAILS.append(f"{fmt}: the policy did not select the paths")
        log(f"FAIL {fmt}: w8a8_min_tokens {fp8_path.w8a8_min_tokens} / {bf16_path.w8a8_min_tokens}")
    pw = bf16_weights(ew) if fmt == "fp8" and paths else None
    hdr = "| format | T | path | ms | TFLOP/s | % bf16 matmul | % fp8 matmul | rel err | max err |"
    rows = [hdr, "|---|---|---|---|---|---|---|---|---|"]
    for T in tokens if paths else ():
        x, tw, ids = inputs(T, T)
        fl = 2 * 3 * D * I * T * K
        ref = fused_moe_ref(x.float(), ew, tw, ids)  # unquantized activations, float32
        paths = {"bf16 path (engine today)": lambda: bf16_path(x, ids, tw),
                 "fp8 path (w8a8_moe)": lambda: fp8_path(x, ids, tw)}  # fmt: skip
        if pw is not None:
            paths["peer bf16 torch._grouped_mm"] = lambda: peer(x, pw[0], pw[1], tw, ids)
        e_by = {}
        for name, fn in paths.items():
            try:
                e, m = errs(fn(), ref)
                t = timed(fn, iters=5 if T >= 8192 else 10)
            except Exception as ex:  # noqa: BLE001 - report and go on
                log(f"{fmt} T={T} {name}: {type(ex).__name__}: {str(ex)[:300]}")
                FAILS.append(f"{fmt} T={T} {name}")
                continue
            e_by[name] = e
            tf = fl / t / 1e9
            rows.append(
                f"| {fmt} | {T} | {name} | {t:.3f} | {tf:.0f} | {100 * tf / lim['bf16']:.0f}% | {100 * tf / lim['fp8']:.0f}% | {e:.2e} | {m:.2e} |"
            )
            log(rows[-1])
        if len(e_by) >= 2:
            b, f = e_by.get("bf16 path (engine today)"), e_by.get("fp8 path (w8a8_moe)")
            if b and f:
                log(f"{fmt} T={T}: fp8 activations' error / the bf16 path's = {f / b:.1f}x")
        del ref
    if paths and fmt == "fp8":
        for T in tokens:
            try:
                split_times(ew, T)
            except Exception as ex:  # noqa: BLE001 - the table above stays
                log(f"split T={T}: {type(ex).__name__}: {str(ex)[:300]}")
    if sweep and fmt == "fp8":
        T = tokens[-1]
        x, tw, ids = inputs(T, T)
        for bm, w13w, w13s, w2w, w2s, gm in (
            (64, 8, 3, 4, 4, 8),
            (64, 4, 3, 4, 4, 8),
            (128, 8, 3, 8, 3, 8),
            (64, 8, 4, 8, 4, 1),
            (32, 4, 4, 4, 4, 8),
        ):
            cfg = {"BLOCK_M": bm, "w13": {"BLOCK_N": 128, "GROUP_M": gm, "num_warps": w13w, "num_stages": w13s},
                   "w2": {"BLOCK_N": 128, "GROUP_M": gm, "num_warps": w2w, "num_stages": w2s}}  # fmt: skip
            try:
                t = timed(lambda: wm.w8a8_moe(x, ew, tw, ids, cfg), iters=5)
                log(f"sweep T={T} {cfg}: {t:.3f} ms, {2 * 3 * D * I * T * K / t / 1e9:.0f} TFLOP/s")
            except Exception as ex:  # noqa: BLE001
                log(f"sweep {cfg}: {type(ex).__name__}: {str(ex)[:200]}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--formats", default="fp8,int4")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-paths", action="store_true", help="with --sweep: only the sweep")
    ap.add_argument("--out", default=None, help="also write the output lines to this file")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU (TRITON_INTERPRET=1): 8 experts of 256 x 256, the code paths only")  # fmt: skip
    args = ap.parse_args(argv)
    if args.smoke:
        global E, D, I
        E, D, I = 8, 256, 256
    elif DEV == "cpu":
        print("no GPU: run with --smoke (and TRITON_INTERPRET=1) for a CPU check of the code")
        return 1
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    log(f"device {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    lim = limits()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for fmt in args.formats.split(","):
        try:
            rows += bench_format(fmt, tokens, lim, args.sweep, not args.no_paths)[
                0 if not rows else 2 :
            ]
        except Exception as ex:  # noqa: BLE001 - the next format still runs
            log(f"{fmt}: {type(ex).__name__}: {str(ex)[:300]}")
            FAILS.append(fmt)
        gc.collect()  # the format's experts (and the peer's bf16 copy) go
        if DEV == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(rows), flush=True)
    log(f"done; failures: {FAILS or 'none'}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(LINES + rows) + "\n")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
