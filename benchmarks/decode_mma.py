# ruff: noqa: E501, E741, B023
"""Device sweep of the tensor-core INT4 decode MoE against the shipped decode paths, on one K2
MoE layer (E=384, D=7168, I=2048, group 32, random INT4 weights as model_speed._rand_experts):
the f16 design (kernels/int4_moe_mma16.py, config F16=1 of int4_moe_mma: Marlin's dequant, the
group scale once per group; wave 9's bf16 design is removed), T = 32, 64, 128, 192, 256 tokens
x top-8 under uniform routing and T = 128 with every token's experts drawn from one random third
of them ("third"; --skewed adds the lognormal routing of model_speed.part_ggemv).

Order: copy bandwidth (measured here); at T=128 uniform every path against the float32
torch reference (fused_moe_ref: exact weights, fp32 sums, the bf16 intermediate); then per
case every path against the per-pair GEMV `int4_moe_decode` (the reference path; rel diff <=
4e-3 or 1.1x a shipped path's own), then CUDA-graph timed over 2 routings
(model_speed.graph_ms): per-pair GEMV, grouped GEMV, the INT4 GEMM with the policy's backend
(Gluon on the H100), and the configs of MMA_SWEEP. A failing config prints its error and the
sweep goes on. Then per-launch times of the best configs at T=128 (gate_up and down apart),
the table (ms and % of the copy bandwidth for each hit expert's weights + scales counted
once), the best config per case and the JSON lines to paste into kernels/configs/*.json.

Run (one GPU, repo root; < 240 s on an H100):  OUT=/dir bash benchmarks/decode_mma.sh
or  PYTHONPATH=src python3 benchmarks/decode_mma.py [--tokens 32,128] [--budget 200]
Without CUDA it runs the same flow on a tiny layer through Triton's interpreter (wall-clock
times, meaningless as speed): `TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/decode_mma.py --dry`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOL = 4e-3
# name -> config (gate_up launch; "w2": the down launch's overrides). Each compiles for sm_90
# with Triton 3.6 without spills (checked offline: registers, shared memory, CTAs an SM, the
# K loop's SASS instructions a weight). Wave 9's bf16 design (removed; its best tile 16x32
# mma.sync, 3 stages, runs/h100_w9_decode_mma_run2.txt) read at 47-51% of copy bw (T=128
# uniform 6.01 ms against the grouped GEMV's 5.63).
# The F16 configs. SASS instructions a weight in the K loop (gate_up / down, benchmarks/mma_sass.py,
# Triton 3.6 sm_90): 16x64 w2 3.16 / 3.44, 16x64 g4 w2 2.96 / 3.14, 16x32 g4 w1 2.89 / 3.16,
# 16x64 g8 w2 2.84 / 2.99 (255 registers), 16x16 g8 w1 3.29 / 3.59, 8x32 g8 w1 2.16 / 2.25,
# 8x32 g4 w1 2.27 / 2.41, 8x64 g4 w2 2.32 / 2.48, 16x128 swap0 3.61 / 3.81; the removed bf16
# 16x32 4.92 / 5.70. G = 2 / 4 / 8: 32 / 64 / 128 contiguous bytes a weight row a K step.
# Run 1 (H100, lead, 02:45, branch at f51c44d): T=128 uniform 16x64 w2 5.03 ms (59% of copy bw,
# 1.12x the grouped GEMV), 16x128 swap0 5.15, 8x64 g4 w2 6.15, and every tile of 64 weight rows
# a warp (8x128 w2, 8x256 w4, 8x64 w1) ~10 ms whatever its instruction count (2.2 a weight):
# the time follows the weight rows in flight an SM (CTAs x rows: ~900 -> 5 ms, ~1150 -> 6.2,
# >= 1500 -> 10), i.e. DRAM access locality, not instructions; hence the short, wide tiles here.
# Run 2 (03:22, runs/h100_w11_mma_run2.txt): 16x64 G=4 PF=2 4.69 ms at T=128 (63%), G=2 PF=4
# 4.67, G=4 4.84, G=8 4.79, G=2 4.96; PF=8 6.47 (too far ahead); 62% at T=192/256.
F16 = dict(F16=1, BLOCK_M=16, BLOCK_N=64, G=2, SWAP=1, ATOMIC=0, num_warps=2, num_stages=3)
MMA_SWEEP = {  # around run 2's best (the table's 16x64 G=4 PF=2)
    "f16 16x128 swap0 w4": dict(F16, BLOCK_N=128, SWAP=0, num_warps=4),
    "f16 16x64 w2": dict(F16),
    "f16 16x64 g4 w2 pf2": dict(F16, G=4, PF=2),
    "f16 16x64 g4 w2 pf1": dict(F16, G=4, PF=1),
    "f16 16x64 g4 w2 pf3": dict(F16, G=4, PF=3),
    "f16 16x64 w2 pf2": dict(F16, PF=2),
    "f16 16x64 w2 pf4": dict(F16, PF=4),
    "f16 8x32 g8 w1 pf1": dict(F16, BLOCK_M=8, BLOCK_N=32, G=8, num_warps=1, PF=1),
    "f16 16x64 g4 w2 pf2 atomic": dict(F16, G=4, PF=2, ATOMIC=1),
    "f16 16x64 g4 w2 pf2 s4": dict(F16, G=4, PF=2, num_stages=4),
    # wave 12 (H200, runs/h200_w12_tune*_mma.txt, runs/h200_w12_mma_warps.txt): G=2 PF=4 best to
    # T=128 (h200.json), G=4 PF=2 above; 4 stages within 1-3%. Measured and dropped here (ms at
    # T=128 uniform against G=2 PF=4's 4.04-4.15): more CTAs an SM through a register cap
    # (maxnreg 152 / 128: 4.36 / 5.14, spills), G=8 4.57, PF=6 4.88, 4-warp tiles of 64 / 128
    # rows 8.27 / 7.52, 1-warp 32-row tiles 4.02
    "f16 16x64 g4 w2 pf4": dict(F16, G=4, PF=4),
    "f16 16x64 g4 w2 pf3 s4": dict(F16, G=4, PF=3, num_stages=4),
    "f16 16x64 w2 pf4 down g4 pf2": dict(F16, PF=4, w2=dict(G=4, PF=2)),
    "f16 16x64 w2 pf3": dict(F16, PF=3),
    "f16 16x64 w2 pf4 s4": dict(F16, PF=4, num_stages=4),
    "f16 16x32 w1 pf4": dict(F16, BLOCK_N=32, num_warps=1, PF=4),
}
OUT_LINES: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    OUT_LINES.append(s)
    print(s, flush=True)


def copy_bw(cuda: bool) -> float:
    """GB/s of a device copy of 4 GiB float32 (read + write counted), as model_speed.part_ceil."""
    if not cuda:
        return float("nan")
    from model_speed import timed

    bufs = [torch.randn(1 << 30, device="cuda")]
    bufs.append(torch.empty_like(bufs[0]))
    ms = timed(lambda: bufs[1].copy_(bufs[0]), iters=10)
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * (1 << 30) * 4 / ms / 1e6


def route(T, E, k, dev, mode):
    """(topk weights [T, k], ids [T, k] int32): uniform; "third": each token's k experts from
    one random third of the E (the k2-slice dummy router's concentration); "skewed": experts
    drawn with weights exp(2 N(0, 1))."""
    if mode == "uniform":
        ids = torch.rand(T, E, device=dev).argsort(-1)[:, :k].int()
    elif mode == "third":
        sub = torch.randperm(E, device=dev)[: E // 3]
        ids = sub[torch.rand(T, E // 3, device=dev).argsort(-1)[:, :k]].int()
    else:
        p = torch.exp(2.0 * torch.randn(E, device=dev))
        ids = torch.multinomial(p.expand(T, E), k).int()
    return torch.rand(T, k, device=dev), ids


def time_fns(fns, cuda: bool) -> float:
    """ms per call: CUDA-graph replay (model_speed.graph_ms) or, without CUDA, wall clock."""
    if cuda:
        from model_speed import graph_ms

        return graph_ms(fns)
    t = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t) * 1e3 / len(fns)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def shipped_paths(cuda: bool):
    """name -> fn(x, ew, tw, ti) of the paths the server runs today, with the tables' configs."""
    from k2serve.kernels.int4_gemm import int4_moe_gemm
    from k2serve.kernels.int4_gemv import int4_moe_decode, int4_moe_decode_grouped
    from k2serve.kernels.policy import KernelPolicy, load_tables

    pol = KernelPolicy.for_device("cuda") if cuda else KernelPolicy(tables=load_tables())
    t = pol.tables
    backend = pol.int4_gemm_backend
    gemm_cfgs, _ = t.int4_gemm_configs(backend)
    h2, gg = dict(t.int4_decode), dict(t.int4_decode_grouped)
    return {
        "per-pair": lambda x, ew, tw, ti: int4_moe_decode(x, ew, tw, ti, h2),
        "grouped": lambda x, ew, tw, ti: int4_moe_decode_grouped(x, ew, tw, ti, gg),
        f"gemm ({backend})": lambda x, ew, tw, ti: int4_moe_gemm(x, ew, tw, ti, gemm_cfgs,
                                                                 backend=backend),
    }, t.kind  # fmt: skip


def launch_split(ew, x, tw, ti, cfg, cuda):
    """(gate_up ms, down ms) of one config, each launch graph-timed alone on prepared inputs
    (the activation packing of each launch included)."""
    from k2serve.kernels import int4_moe_mma16 as m16
    from k2serve.kernels.int4_moe_mma import _configs
    from k2serve.kernels.moe_align import moe_align_block_size

    T, D = x.shape
    I, k = ew.intermediate, ti.shape[1]
    M = T * k
    c13, c2 = _configs(cfg, D, I)
    sid, eids, npost = moe_align_block_size(ti, ew.num_experts, c13["BLOCK_M"])
    tw1 = tw.reshape(-1).float().contiguous()
    act = torch.empty(M, I, dtype=torch.bfloat16, device=x.device)
    out = torch.zeros(T if c2["ATOMIC"] else M, D, dtype=torch.float32, device=x.device)

    def up():
        a, rs = m16.pack_f16(x)
        m16._launch(a, rs, ew.w13, ew.w13_scale, act, tw1, sid, eids, npost, I, D, M, k, True,
                    False, 1, False, c13)  # fmt: skip

    def down():
        a2, rs2 = m16.pack_f16(act)
        m16._launch(a2, rs2, ew.w2, ew.w2_scale, out, tw1, sid, eids, npost, D, I, M, 1, False,
                    True, k if c2["ATOMIC"] else 1, bool(c2["ATOMIC"]), c2)  # fmt: skip

    return time_fns([up], cuda), time_fns([down], cuda)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32,64,128,192,256", help="T of the uniform cases")
    ap.add_argument("--third", default="128", help="T of the one-third routing cases")
    ap.add_argument("--skewed", default="", help="T of the lognormal routing cases")
    ap.add_argument(
        "--budget",
        type=float,
        default=200.0,
        help="seconds: past it, timing stops and the table prints",
    )
    ap.add_argument(
        "--configs", default="", help="comma-separated names of MMA_SWEEP (default all)"
    )
    ap.add_argument("--dry", action="store_true", help="tiny layer (CPU interpreter without CUDA)")
    args = ap.parse_args(argv)
    t0 = time.time()
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("decode_mma.py: no CUDA device; set TRITON_INTERPRET=1 with --dry")
    from model_speed import _rand_experts

    from k2serve.kernels.int4_moe_mma import int4_moe_mma

    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(int(os.environ.get("SEED", "0")))

    def ts(v):
        return [int(t) for t in v.split(",") if t]

    if args.dry:
        E, D, I, k = 9, 256, 256, 4  # noqa: E741
        cases = [(2, "uniform"), (2, "third")]
    else:
        E, D, I, k = 384, 7168, 2048, 8  # noqa: E741
        cases = [(T, "uniform") for T in ts(args.tokens)]
        cases += [(T, "third") for T in ts(args.third)] + [(T, "skewed") for T in ts(args.skewed)]
        # the target case (T=128) first: the time budget may cut the last ones
        cases.sort(key=lambda c: (c[0] != 128, c[1] != "uniform", c[0]))
    names = [n for n in args.configs.split(",") if n] or list(MMA_SWEEP)
    cands = {n: MMA_SWEEP[n] for n in names}
    info = f"{torch.cuda.get_device_name()} " if cuda else "CPU interpreter "
    import triton

    log(
        f"{info}torch {torch.__version__} triton {triton.__version__} {time.strftime('%Y-%m-%d %H:%M')}"
    )
    bw = copy_bw(cuda)
    log(f"copy bandwidth {bw:.0f} GB/s (read + write, 8 GiB)")
    ew = _rand_experts("int4", E, D, I, dev)
    per_expert = sum(
        t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale)
    )
    shipped, kind = shipped_paths(cuda)
    ref_fn = shipped["per-pair"]
    paths = {**shipped, **{f"mma {n}": (lambda c: lambda x, ew, tw, ti: int4_moe_mma(x, ew, tw, ti, c))(c)
                           for n, c in cands.items()}}  # fmt: skip
    broken: set[str] = set()  # raised: not run again
    failed: set[str] = set()  # over the tolerance somewhere: timed, never picked
    tol = TOL if cuda else 2e-2  # the interpreter rounds fp32 -> bf16 toward zero
    results: dict[tuple[int, str], dict[str, float]] = {}
    hits: dict[tuple[int, str], float] = {}
    out_of_time = False
    ref32_T = 128 if (128, "uniform") in cases else cases[0][0]
    for T, mode in cases:
        if True:
            case = (T, mode)
            routes = [route(T, E, k, dev, mode) for _ in range(2)]
            x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
            hits[case] = sum(int(ti.unique().numel()) for _, ti in routes) / 2
            refs = [ref_fn(x, ew, tw, ti) for tw, ti in routes]
            ref32 = None
            if (T, mode) == (ref32_T, cases[0][1] if args.dry else "uniform"):
                from k2serve.kernels.fused_moe import fused_moe_ref

                ref32 = fused_moe_ref(x, ew, *routes[0])  # fp32 math, bf16 out
            ok, diffs = {}, {}
            for name, fn in paths.items():  # check first
                if name in broken:
                    continue
                try:
                    err = max(
                        rel(fn(x, ew, tw, ti), r) for (tw, ti), r in zip(routes, refs, strict=True)
                    )
                    if ref32 is not None:
                        e32 = rel(fn(x, ew, *routes[0]), ref32)
                        log(f"  fp32-reference T={T} {mode} {name:24s} rel diff {e32:.2e}")
                except Exception as e:  # noqa: BLE001 - a config that does not run is reported
                    log(f"  T={T} {mode} {name}: {type(e).__name__}: {str(e)[:300]}")
                    broken.add(name)
                    continue
                diffs[name] = err
                ok[name] = fn
            # the bar: 4e-3, or 1.1x the largest difference of a shipped path from the per-pair
            # GEMV (the GEMM's bf16 weights and activations differ by ~5e-3: not a wrong answer)
            bar = max(tol, 1.1 * max((diffs[n] for n in shipped if n in diffs), default=0.0))
            for name, err in diffs.items():
                flag = "ok" if err <= bar else "FAIL (timed, never picked)"
                log(f"  check T={T} {mode:7s} {name:24s} rel diff {err:.2e} {flag} (bar {bar:.1e})")
                if err > bar:
                    failed.add(name)
            res = {}
            for name, fn in ok.items():  # then time
                if time.time() - t0 > args.budget:
                    out_of_time = True
                    break
                try:
                    res[name] = time_fns(
                        [lambda tw=tw, ti=ti, fn=fn: fn(x, ew, tw, ti) for tw, ti in routes], cuda
                    )
                except Exception as e:  # noqa: BLE001
                    log(f"  T={T} {mode} {name} timing: {type(e).__name__}: {str(e)[:300]}")
                    broken.add(name)
            results[case] = res
            nb = hits[case] * per_expert
            line = ", ".join(f"{n} {ms:.3f}" for n, ms in sorted(res.items(), key=lambda kv: kv[1]))
            log(
                f"T={T} {mode}: {hits[case]:.0f} experts hit, {nb / 1e9:.2f} GB; ms: {line}  [{time.time() - t0:.0f}s]"
            )
            if out_of_time:
                log(f"budget of {args.budget:.0f}s spent: timing stops here")
                break
        if out_of_time:
            break
    # per-launch split of the three best configs at T=128 uniform (or the first case)
    case = (128, "uniform") if (128, "uniform") in results else next(iter(results), None)
    best_split = None
    if case is not None and not out_of_time:
        res = results[case]
        top = sorted((n for n in res if n.startswith("mma ") and n not in failed), key=res.get)[:5]
        tw, ti = route(case[0], E, k, dev, case[1])
        x = torch.randn(case[0], D, device=dev, dtype=torch.bfloat16)
        split = {}
        for n in top:
            try:
                split[n] = launch_split(ew, x, tw, ti, cands[n[4:]], cuda)
                log(
                    f"  launches T={case[0]} {n}: gate_up {split[n][0]:.3f} ms, down {split[n][1]:.3f} ms"
                )
            except Exception as e:  # noqa: BLE001
                log(f"  launches {n}: {type(e).__name__}: {str(e)[:300]}")
        if split:
            bu = min(split, key=lambda n: split[n][0])
            bd = min(split, key=lambda n: split[n][1])
            c2 = {key: v for key, v in cands[bd[4:]].items() if key != "BLOCK_M"}
            if cands[bu[4:]]["BLOCK_M"] == cands[bd[4:]]["BLOCK_M"]:
                best_split = dict(cands[bu[4:]], w2=c2)
                log(
                    f"  best launches: gate_up {bu}, down {bd}: {split[bu][0] + split[bd][1]:.3f} ms"
                )
    if failed:
        log(f"over the {tol:.0e} check (never picked): {sorted(failed)}")
        results = {c: {n: v for n, v in r.items() if n not in failed} for c, r in results.items()}
    table(results, hits, per_expert, bw, kind, cands, best_split, k)
    log(f"total {time.time() - t0:.0f}s")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "mma_sweep.txt"), "w") as f:
            f.write("\n".join(OUT_LINES) + "\n")


def table(results, hits, per_expert, bw, kind, cands, best_split, k):
    """The markdown table, the best config per T and the lines to paste."""

    def pct(nb, ms):
        return 100 * nb / ms / 1e6 / bw

    log(
        "\n| T | routing | experts hit | per-pair | grouped | GEMM | best mma (config) | mma / best shipped |"
    )
    log("|---|---|---|---|---|---|---|---|")
    wins = {}
    for (T, mode), res in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        nb = hits[(T, mode)] * per_expert
        gemm = next((n for n in res if n.startswith("gemm")), None)
        mma = {n: v for n, v in res.items() if n.startswith("mma ")}
        ship = {n: v for n, v in res.items() if not n.startswith("mma ")}

        def cell(n):
            return f"{res[n]:.3f} ({pct(nb, res[n]):.0f}%)" if n in res else "-"

        if mma:
            b = min(mma, key=mma.get)
            ratio = min(ship.values()) / mma[b] if ship else float("nan")
            wins[(T, mode)] = (b, ratio)
            best = f"{mma[b]:.3f} ({pct(nb, mma[b]):.0f}%, {b[4:]})"
        else:
            best, ratio = "-", float("nan")
        log(f"| {T} | {mode} | {hits[(T, mode)]:.0f} | {cell('per-pair')} | {cell('grouped')} | "
            f"{cell(gemm) if gemm else '-'} | {best} | {ratio:.2f}x |")  # fmt: skip
    log("\nbest mma config per case (ratio = best shipped path / best mma; > 1: mma faster):")
    for case, (b, r) in wins.items():
        log(f"  {case}: {b} {r:.2f}x")
    # the config best most often among the cases where mma wins, and the pair band where it
    # beats every shipped path at both routings
    won = [b for b, r in wins.values() if r > 1]
    if not won:
        log("mma is not faster than the shipped paths in any measured case: nothing to paste")
        return
    top = max(set(won), key=won.count)
    Ts = sorted({T for T, _ in results})
    won_at = [T for T in Ts if all(wins.get(c, ("", 0))[1] > 1 for c in results if c[0] == T)]
    band = []  # the measured T where mma wins every routing, one run without a loss inside
    for T in Ts:
        if T in won_at:
            band.append(T)
        elif band:
            break
    cfg = best_split or cands[top[4:]]
    log(f"most frequent winner: {top}; per-launch best: {json.dumps(best_split)}")
    log(f"T where mma beats every shipped path at every measured routing: {band}")
    if band:
        log(f'for configs/{kind}.json: "int4_decode_mma": {json.dumps(cfg)}, '
            f'"int4_decode_mma_min_pairs": {band[0] * k}, "int4_decode_mma_max_pairs": {band[-1] * k}'
            " (measured T*k only: the band's ends are the measured T)")  # fmt: skip


if __name__ == "__main__":
    main()
