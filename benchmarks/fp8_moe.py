# ruff: noqa: E741, E501, B023
"""FP8-block routed experts on one GPU: kernels/fp8_moe.py (weights as the MMA's left operand,
fp8 tiles converted in registers) against the generic fused_moe kernel it replaces, at K2 sizes.

Run (repo root): PYTHONPATH=src python3 benchmarks/fp8_moe.py [--parts check,time,sweep]
One K2 MoE layer: E=384, D=7168, I=2048, top-8, random float8_e4m3fn weights with random fp32
128x128 block scales; T = 1, 8, 32, 128, 256, 512, 1024, 8192 tokens, uniform random routing.
- check: relative error of the new path against the generic kernel (and against the fp32
  reference fused_moe_ref at T = 1, 8).
- time: ms of the new path (the shipped table's config) and of the generic kernel (the peer),
  GB/s of the expert bytes actually read (weights + scales of the experts hit), % of the copy
  bandwidth measured in the same run, TFLOP/s and % of the bf16 matmul rate measured in the run;
  "auto": what the engine runs (FusedMoEBackend with the device policy: the generic kernel up to
  the table's fp8_moe_generic_max_pairs, the new path above) and its ratio to the faster of the
  two (>= ~1.00x when the limit is right); then the pair counts where the generic kernel won.
- sweep: each GEMM (gate+up, down) timed alone over candidate tiles per BLOCK_M; prints the
  winners as a `fp8_moe` table for kernels/configs/<kind>.json.
- generic (not in the default parts): the generic kernel's small-M config against its own
  rule and the new path at T = 128..1024, uniform and one-third routing.
- band (not in the default parts): what FusedMoEBackend with the device policy runs ("auto":
  inside an fp8_routing_select band the candidate moe_select picks from the routing) beside
  the fixed paths (the small-M generic kernel, fp8_moe, the Gluon GEMM where it runs) at
  T = 256, 384, 512, 768, uniform and one-third routing; auto's output is checked against the
  fixed path it chose (and every path against fp8_moe) before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import model_speed as ms  # noqa: E402  (timers, ceilings, routing)

E, D, I, K = 384, 7168, 2048, 8
DEV = "cuda"
TOKENS = (1, 8, 32, 128, 256, 512, 1024, 8192)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def make_experts(dev=None):
    """Random fp8 experts (values N(0, 1) rounded to e4m3) with scales in [0.005, 0.015)."""
    from k2serve.kernels.fused_moe import ExpertWeights

    dev = dev or DEV

    def fp8(n, k):
        out = torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device=dev)
        for e0 in range(0, E, 16):
            out[e0 : e0 + 16] = torch.randn(min(16, E - e0), n, k, device=dev, dtype=torch.bfloat16)
        return out

    def sc(n, k):
        return torch.rand(E, -(-n // 128), -(-k // 128), device=dev) * 0.01 + 0.005

    return ExpertWeights("fp8", fp8(2 * I, D), fp8(D, I), sc(2 * I, D), sc(D, I))


def expert_bytes(ew, hit):
    per = (ew.w13[0].numel() + ew.w2[0].numel()) * 1 + (
        ew.w13_scale[0].numel() + ew.w2_scale[0].numel()
    ) * 4
    return hit * per


def inputs(T, seed, dev=DEV):
    """One K2 MoE layer's inputs for T tokens: x [T, D] bf16, top-K weights and uniform ids."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
    tw = torch.rand(T, K, device=dev, generator=g)
    ids = torch.rand(T, E, device=dev, generator=g).argsort(-1)[:, :K].int()
    return x, tw, ids


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def part_check(ew, table):
    from k2serve.kernels import fp8_moe, fused_moe

    for T in TOKENS:
        x, tw, ids = inputs(T, T)
        new = fp8_moe.fp8_moe(x, ew, tw, ids, table=table)
        old = fused_moe.fused_moe(x, ew, tw, ids)
        err = rel(new, old)
        line = f"check T={T:5d}: rel err vs generic kernel {err:.2e}"
        ok = bool(torch.isfinite(new).all()) and err < 2e-2
        if T <= 8:
            ref = fused_moe.fused_moe_ref(x, ew, tw, ids)
            e_new, e_old = rel(new, ref), rel(old, ref)
            line += f"; vs fp32 reference: new {e_new:.2e}, generic {e_old:.2e}"
            ok = ok and e_new < 2e-2
        log(line + ("  ok" if ok else "  FAIL"))
        if not ok:
            ms.FAILS.append(f"check T={T}")


def part_time(ew, policy):
    from k2serve.kernels import fp8_moe, fused_moe
    from k2serve.moe.fused_moe import FusedMoEBackend

    table = policy.tables.fp8_moe
    backend = FusedMoEBackend(ew, **policy.moe_kwargs())  # what the engine runs
    log(f"ceilings: copy {ms.CEIL['bw']:.0f} GB/s, bf16 matmul {ms.CEIL['mm']:.0f} TFLOP/s")
    log(
        f"auto: fp8_impl={backend.fp8_impl!r}, generic kernel up to {backend.fp8_generic_max_pairs} pairs"
    )
    log(
        "| T | pairs | experts hit | config (BM; w13 BNxBK; w2 BNxBK) | new ms | GB/s | % copy bw | TFLOP/s | % matmul | generic ms | generic % copy bw | speedup | auto ms | auto runs | auto % copy bw | auto vs faster |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    generic_won = []
    for T in TOKENS:
        x, tw, ids = inputs(T, 100 + T)
        hit = int(ids.unique().numel())
        nb, fl = expert_bytes(ew, hit), 2 * 3 * D * I * T * K
        cfg = fp8_moe.pick_config(T * K, table)
        it = 5 if T >= 1024 else 30
        t_new = ms.timed(lambda: fp8_moe.fp8_moe(x, ew, tw, ids, table=table), iters=it)
        t_old = ms.timed(lambda: fused_moe.fused_moe(x, ew, tw, ids), iters=it)
        t_auto = ms.timed(lambda: backend(x, ids, tw), iters=it)
        runs = "new" if backend.fp8_uses_gemm(T * K) else "generic"
        if t_old < t_new:
            generic_won.append(T * K)
        gbs, gbs_old = nb / t_new / 1e6, nb / t_old / 1e6
        tfs = fl / t_new / 1e9
        c13, c2 = cfg["w13"], cfg["w2"]
        desc = f"{cfg['BLOCK_M']}; {c13['BLOCK_N']}x{c13['BLOCK_K']} w{c13['num_warps']}s{c13['num_stages']}g{c13['GROUP_M']}; {c2['BLOCK_N']}x{c2['BLOCK_K']} w{c2['num_warps']}s{c2['num_stages']}g{c2['GROUP_M']}"
        log(f"| {T} | {T * K} | {hit} | {desc} | {t_new:.3f} | {gbs:.0f} | {100 * gbs / ms.CEIL['bw']:.0f}% | {tfs:.0f} | "
            f"{100 * tfs / ms.CEIL['mm']:.0f}% | {t_old:.3f} | {100 * gbs_old / ms.CEIL['bw']:.0f}% | {t_old / t_new:.2f}x | "
            f"{t_auto:.3f} | {runs} | {100 * nb / t_auto / 1e6 / ms.CEIL['bw']:.0f}% | {min(t_new, t_old) / t_auto:.2f}x |")  # fmt: skip
    log(f"generic kernel faster at pair counts {generic_won or 'none'} "
        f"(table: fp8_moe_generic_max_pairs={backend.fp8_generic_max_pairs})")  # fmt: skip


GENERIC_TS = (128, 192, 256, 320, 384, 512, 768, 1024)


def part_generic(ew, policy):
    """Where the generic kernel's small-M config (16-row blocks: weight streaming) stops
    winning: it, the generic kernel's own rule (large-M past 4 pairs an expert) and the new
    path (the table) at T = GENERIC_TS under uniform and one-third routing (every token's
    experts from a fixed third: 8 pairs an expert at T=128), CUDA-graph timed; checked
    against each other first."""
    from k2serve.kernels import fp8_moe, fused_moe

    table = policy.tables.fp8_moe
    small = fused_moe.kernel_config(1, E, "fp8")  # the small-M block sizes
    sub = torch.randperm(E, device=DEV)[: E // 3]
    log(f"generic small-M config {small}")
    log("| T | routing | experts hit | small-M ms | % copy bw | generic rule ms | new ms | best |")
    log("|---|---|---|---|---|---|---|---|")
    for T in GENERIC_TS:
        for mode in ("uniform", "third"):
            x, tw, ids = inputs(T, 200 + T)
            if mode == "third":
                ids = sub[torch.rand(T, E // 3, device=DEV).argsort(-1)[:, :K]].int()
            hit = int(ids.unique().numel())
            fns = {
                "small-M": lambda: fused_moe.fused_moe(x, ew, tw, ids, small),
                "generic rule": lambda: fused_moe.fused_moe(x, ew, tw, ids),
                "new": lambda: fp8_moe.fp8_moe(x, ew, tw, ids, table=table),
            }
            ref = fns["new"]()
            for name, fn in fns.items():
                err = rel(fn(), ref)
                if not err < 2e-2:
                    log(f"check T={T} {mode} {name}: rel err {err:.2e} vs new FAIL")
                    ms.FAILS.append(f"generic T={T} {mode} {name}")
            t = {name: ms.graph_ms([fn]) for name, fn in fns.items()}
            pct = 100 * expert_bytes(ew, hit) / t["small-M"] / 1e6 / ms.CEIL["bw"]
            log(f"| {T} | {mode} | {hit} | {t['small-M']:.3f} | {pct:.0f}% | "
                f"{t['generic rule']:.3f} | {t['new']:.3f} | {min(t, key=t.get)} |")  # fmt: skip


BAND_TS = (256, 384, 512, 768)


def _band_row(be, T, mode, sub, small):
    """One (T, routing) row of part_band: check, then time (CUDA graphs)."""
    from k2serve.kernels import fused_moe
    from k2serve.kernels.moe_select import moe_select

    x, tw, ids = inputs(T, 300 + T, DEV)
    if mode == "third":
        ids = sub[torch.rand(T, sub.numel(), device=DEV).argsort(-1)[:, :K]].int()
    hit = int(ids.unique().numel())
    paths, limits = be.plan(T, K)
    chosen = paths[0]
    if len(paths) > 1:
        chosen = paths[int(moe_select(ids, E, limits)[:-1].argmax())]
    fixed = {
        "small-M": lambda: fused_moe.fused_moe(x, be.weights, tw, ids, small),
        "fp8_gemm": lambda: be.run_path("fp8_gemm", x, ids, tw),
    }
    if be.fp8_gluon_min_pairs is not None:
        fixed["fp8_gluon"] = lambda: be.run_path("fp8_gluon", x, ids, tw)
    ref, out, want = fixed["fp8_gemm"](), be(x, ids, tw), be.run_path(chosen, x, ids, tw)
    same, err = torch.equal(out, want), rel(out, want)
    ok = same or err < 1e-3
    errs = {}
    for name, fn in fixed.items():
        try:
            errs[name] = rel(fn(), ref)
        except Exception as e:  # noqa: BLE001 - a GPU-only path failing: report, go on
            log(f"band T={T} {mode} {name}: {type(e).__name__}: {e}")
            ms.FAILS.append(f"band T={T} {mode} {name} raised")
    ok = ok and all(v < 2e-2 for v in errs.values())
    log(f"check T={T} {mode}: plan {paths} {limits}, chose {chosen}: auto vs it "
        f"{'bit-identical' if same else f'rel {err:.2e}'}; vs fp8_moe "
        + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + ("  ok" if ok else "  FAIL"))  # fmt: skip
    if not ok:
        ms.FAILS.append(f"band T={T} {mode}")
        return None
    t = {name: ms.graph_ms([fixed[name]]) for name in errs}
    t_auto = ms.graph_ms([lambda: be(x, ids, tw)])
    best = min(t, key=t.get)
    return (f"| {T} | {mode} | {hit} | {T * K / hit:.1f} | {'+'.join(paths)} | {chosen} | "
            + " | ".join(f"{t[n]:.3f}" if n in t else "-" for n in ("small-M", "fp8_gemm", "fp8_gluon"))
            + f" | {t_auto:.3f} | {best} | {t_auto / t[best]:.2f}x |")  # fmt: skip


def part_band(ew, policy, ts=BAND_TS):
    """The routing bands (fp8_routing_select) against the fixed paths: see the docstring."""
    from k2serve.kernels import fused_moe
    from k2serve.moe.fused_moe import FusedMoEBackend

    be = FusedMoEBackend(ew, **policy.moe_kwargs())  # what the engine runs
    small = fused_moe.kernel_config(1, E, "fp8")  # the small-M block sizes
    bands = [(b["min_pairs"], b["max_pairs"], list(b["paths"]), list(b["pairs_per_expert"]))
             for b in be.fp8_routing_select]  # fmt: skip
    log(f"fp8_routing_select bands here: {bands}; generic up to {be.fp8_generic_max_pairs} "
        f"pairs; Gluon from {be.fp8_gluon_min_pairs}")  # fmt: skip
    sub = torch.randperm(E, device=DEV)[: E // 3]
    rows = []
    for T in ts:
        for mode in ("uniform", "third"):
            try:
                row = _band_row(be, T, mode, sub, small)
            except Exception as e:  # noqa: BLE001 - report, go on to the next row
                log(f"band T={T} {mode}: {type(e).__name__}: {e}")
                ms.FAILS.append(f"band T={T} {mode} raised")
                row = None
            if row:
                rows.append(row)
    log("| T | routing | experts hit | pairs/expert | plan | auto chose | small-M ms | fp8_gemm ms "
        "| fp8_gluon ms | auto ms | best fixed | auto / best |")  # fmt: skip
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        log(row)


# candidate tiles (BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M), chosen so that none
# spills registers on sm_90 (ptxas); decode: 16-row blocks; prefill: 32-128-row blocks
DEC13 = [(16, 128, 4, 4, 1), (32, 128, 4, 4, 1), (32, 128, 4, 6, 1), (64, 128, 4, 4, 1)]
DEC2 = [(32, 128, 4, 4, 1), (64, 128, 4, 4, 1), (128, 64, 4, 4, 1)]
PRE13 = {
    32: [(128, 64, 4, 4, 4), (64, 128, 4, 4, 4), (128, 64, 8, 4, 4)],
    64: [(128, 64, 8, 4, 4), (128, 64, 8, 4, 1), (64, 128, 4, 4, 4)],
    128: [(128, 32, 8, 4, 4), (64, 64, 8, 4, 4)],
}
PRE2 = {
    32: [(128, 64, 4, 4, 4), (128, 128, 8, 3, 4)],
    64: [(128, 64, 8, 4, 4), (128, 64, 8, 4, 1)],
    128: [(128, 64, 8, 4, 4), (128, 32, 8, 4, 4)],
}
BMS = {1: (16,), 8: (16,), 32: (16,), 128: (16,), 256: (16,), 512: (16, 32), 1024: (16, 32),
       8192: (64, 128)}  # fmt: skip


def tile(c):
    return dict(BLOCK_N=c[0], BLOCK_K=c[1], num_warps=c[2], num_stages=c[3], GROUP_M=c[4])


def part_sweep(ew):
    from k2serve.kernels import fp8_moe
    from k2serve.kernels.moe_align import moe_align_block_size

    entries = []
    for T in TOKENS:
        x, tw, ids = inputs(T, 200 + T)
        M = T * K
        twf = tw.reshape(-1).float().contiguous()
        inter = torch.randn(M, I, device=DEV, dtype=torch.bfloat16)
        h = torch.empty(M, I, device=DEV, dtype=torch.bfloat16)
        out = torch.empty(M, D, device=DEV, dtype=torch.bfloat16)
        it = 5 if T >= 1024 else 20
        best = None
        for bm in BMS[T]:
            al = moe_align_block_size(ids, E, bm)
            c13 = DEC13 if bm == 16 else PRE13[bm]
            c2 = DEC2 if bm == 16 else PRE2[bm]
            r13, r2 = [], []
            for c in c13:
                f = lambda: fp8_moe._gemm(
                    x,
                    ew.w13,
                    ew.w13_scale,
                    h,
                    twf,
                    *al,
                    I,
                    D,
                    M,
                    K,
                    True,
                    False,
                    bm,
                    tile(c),
                    up_s_row=I // 128,
                )
                r13.append((ms.timed(f, iters=it), c))
            for c in c2:
                f = lambda: fp8_moe._gemm(
                    inter, ew.w2, ew.w2_scale, out, twf, *al, D, I, M, 1, False, True, bm, tile(c)
                )
                r2.append((ms.timed(f, iters=it), c))
            log(
                f"sweep T={T} BLOCK_M={bm}: gate+up "
                + ", ".join(f"{c[0]}x{c[1]} w{c[2]}s{c[3]}g{c[4]} {t:.3f}" for t, c in r13)
            )
            log(
                f"sweep T={T} BLOCK_M={bm}: down    "
                + ", ".join(f"{c[0]}x{c[1]} w{c[2]}s{c[3]}g{c[4]} {t:.3f}" for t, c in r2)
            )
            b13, b2 = min(r13), min(r2)
            if best is None or b13[0] + b2[0] < best[0]:
                best = (b13[0] + b2[0], bm, b13[1], b2[1])
        hit = int(ids.unique().numel())
        gbs = expert_bytes(ew, hit) / best[0] / 1e6
        log(
            f"sweep T={T}: best BLOCK_M={best[1]} gate+up {best[2]} down {best[3]}: {best[0]:.3f} ms (two GEMMs), {100 * gbs / ms.CEIL['bw']:.0f}% of copy bw"
        )
        entries.append(
            {
                "max_pairs": M if T != TOKENS[-1] else None,
                "BLOCK_M": best[1],
                "w13": tile(best[2]),
                "w2": tile(best[3]),
            }
        )
    log("fp8_moe table (kernels/configs/<kind>.json):")
    print(
        '  "fp8_moe": [\n    ' + ",\n    ".join(json.dumps(e) for e in entries) + "\n  ]",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,time,sweep")
    ap.add_argument("--band-ts", default=",".join(map(str, BAND_TS)), help="band: the T values")
    args = ap.parse_args()
    parts = args.parts.split(",")
    from k2serve.kernels.policy import KernelPolicy

    log(f"device {torch.cuda.get_device_name()}")
    ms.part_ceil()
    ew = make_experts()
    torch.cuda.synchronize()
    log(
        f"experts: {E} x ({ew.w13[0].numel() + ew.w2[0].numel()} fp8 weights), {expert_bytes(ew, E) / 1e9:.1f} GB"
    )
    policy = KernelPolicy.for_device(DEV)  # the engine's policy (its tables: the shipped configs)
    table = policy.tables.fp8_moe
    if "check" in parts:
        part_check(ew, table)
    if "time" in parts:
        part_time(ew, policy)
    if "sweep" in parts:
        part_sweep(ew)
    if "generic" in parts:
        part_generic(ew, policy)
    if "band" in parts:
        part_band(ew, policy, tuple(int(t) for t in args.band_ts.split(",")))
    log(f"done; failures: {ms.FAILS or 'none'}")
    return 1 if ms.FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
