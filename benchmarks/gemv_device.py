# ruff: noqa: E501, E741
"""Device check and timing of the grouped INT4 decode GEMV variants (kernels/int4_gemv.py
`int4_moe_decode_grouped`; GSUM variants: kernels/int4_gemv_gsum.py) on one K2 MoE layer
(E=384, D=7168, I=2048, group 32, top-8; random INT4 weights: moe_libs.int4_experts).

Order (correctness before speed; a failing variant prints its error and the run goes on):
1. copy bandwidth (moe_libs.ceilings, same run);
2. check: every variant against the float32 reference (fused_moe_ref) and the shipped config
   at T=128 uniform and T=64 skewed routing, plus the overflow case (all weights -8, every
   activation at the row's largest magnitude: the f16 sums' worst case), tolerance TOL;
3. time: CUDA-graph replay (median), shipped vs each variant at T=64/128/192/256 uniform and
   T=128 skewed (every token's experts from a fixed third of them, as moe_libs' dispatch part);
   ms and % of copy bandwidth for the weights + scales of the experts hit (each counted once);
4. registers per variant and launch (compiled kernels' n_regs), the table.

Run (one GPU, repo root; < 240 s on an H100):  OUT=/dir bash benchmarks/gemv_device.sh
or  PYTHONPATH=src python3 benchmarks/gemv_device.py [--variants shipped,gsum] [--tokens 64,128]
Without CUDA: `TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/gemv_device.py --dry`
(a tiny layer through the interpreter: the checks run, the times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOL = 2e-2  # tests/kernels' grouped GEMV tolerance against the float32 reference
SHIPPED = dict(BLOCK_M=4, BLOCK_N=16, W=64, num_warps=4, GS=1,
               w2=dict(BLOCK_N=16, W=64, num_warps=4, GS=1))  # fmt: skip
GS1 = dict(BLOCK_M=4, BLOCK_N=16, W=64, num_warps=4, GSUM=1, w2=dict(BLOCK_N=16, W=64, num_warps=4))
# name -> config (gate_up launch; "w2": the down launch's overrides). "shipped" = h100.json's
# int4_decode_grouped before wave 11 (run 3 put "gsum kt r128" in the table; the run prints
# the table's entry). Registers / SASS instructions
# per weight of each: benchmarks/gemv_sass.py (offline, Triton 3.6). Run 1 (lead, H100,
# 2026-11-25 02:45, GSUM only): every GSUM tile 1.2-1.6x slower than shipped (T=128 uniform
# 8.14 ms gsum, 6.97 n8, 7.60 pf, 7.26 m8 against 5.62) although it issues ~30% fewer
# instructions; so here F16SUM 2 (the same group sums inside the shipped kernel: its lanes
# along K and 4-deep chains) and GSUM with 4-deep chains (c4) or rows not branched (skip0).
VARIANTS = {
    "shipped": SHIPPED,
    "f16sum2": dict(SHIPPED, F16SUM=2, w2=dict(SHIPPED["w2"], F16SUM=2)),
    "f16sum2 pf": dict(SHIPPED, F16SUM=2, PREFETCH=1, w2=dict(SHIPPED["w2"], F16SUM=2, PREFETCH=1)),
    "f16sum2 n8": dict(SHIPPED, F16SUM=2, BLOCK_N=8, w2=dict(SHIPPED["w2"], F16SUM=2)),
    "f16sum2 m8": dict(SHIPPED, F16SUM=2, BLOCK_M=8, w2=dict(SHIPPED["w2"], F16SUM=2)),
    "f16sum2 cg": dict(SHIPPED, F16SUM=2, CG=1, w2=dict(SHIPPED["w2"], F16SUM=2, CG=1)),
    "shipped cg": dict(SHIPPED, CG=1, w2=dict(SHIPPED["w2"], CG=1)),
    "gsum": GS1,
    "gsum cg": dict(GS1, CG=1, w2=dict(GS1["w2"], CG=1)),
    "gsum kt": dict(GS1, KT=1, w2=dict(GS1["w2"], KT=1)),
    "gsum kt c4": dict(GS1, KT=1, CHAINS=4, w2=dict(GS1["w2"], KT=1, CHAINS=4)),
    "gsum kt r128": dict(GS1, KT=1, maxnreg=128, w2=dict(GS1["w2"], KT=1)),
    "gsum kt n8": dict(GS1, KT=1, BLOCK_N=8, w2=dict(BLOCK_N=8, W=64, num_warps=4, KT=1)),
    "gsum c4": dict(GS1, CHAINS=4, w2=dict(GS1["w2"], CHAINS=4)),
    "gsum skip0": dict(GS1, SKIP=0, w2=dict(GS1["w2"], SKIP=0)),
}
OUT_LINES: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    OUT_LINES.append(s)
    print(s, flush=True)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def routing(T, skewed, seed, dev):
    """(topk weights [T, 8], ids [T, 8]): uniform, or from a fixed third of the experts."""
    import moe_libs as ml
    from routing_modes import routing_ids

    skew = [[1000 if e % 3 == 0 else 0 for e in range(ml.E)]]
    ids = routing_ids("record:x" if skewed else "uniform", T, ml.E, ml.K, 0, seed, dev,
                      skew if skewed else None)  # fmt: skip
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(T, ml.K, generator=g).to(dev), ids


def run_variant(cfg, x, ew, tw, ids):
    from k2serve.kernels.int4_gemv import int4_moe_decode_grouped

    return int4_moe_decode_grouped(x, ew, tw, ids, cfg)


def check_part(ew, names, dev, dry):
    """Each variant against the float32 reference and the shipped config; the overflow case."""
    import moe_libs as ml

    from k2serve.kernels.fused_moe import ExpertWeights, fused_moe_ref

    ok = {n: True for n in names}
    cases = [(128, False), (64, True)] if not dry else [(4, False), (4, True)]
    for T, skewed in cases:
        tw, ids = routing(T, skewed, 1, dev)
        x = torch.randn(T, ml.D, device=dev, dtype=torch.bfloat16)
        ref = fused_moe_ref(x, ew, tw, ids)
        ship = run_variant(SHIPPED, x, ew, tw, ids)
        tag = f"T={T} {'skewed' if skewed else 'uniform'}"
        log(f"  check {tag}: shipped rel err vs fp32 ref {rel(ship, ref):.3e}")
        for n in names:
            try:
                out = run_variant(VARIANTS[n], x, ew, tw, ids)
                e_ref, e_ship = rel(out, ref), rel(out, ship)
                good = bool(torch.isfinite(out).all()) and e_ref < TOL
                ok[n] &= good
                log(f"  check {tag} {n:14s} vs ref {e_ref:.3e} vs shipped {e_ship:.3e} "
                    f"{'ok' if good else 'FAIL'}")  # fmt: skip
            except Exception as e:  # noqa: BLE001
                ok[n] = False
                log(f"  check {tag} {n:14s} ERROR {e!r}"[:300])
    # overflow: every weight nibble 0 (-8), scales 1, activations all +max: every product at
    # the bound; the exact sums are -8 * 32 * (K / 32) * x per output (float32 reference)
    E1 = 2
    w13 = torch.zeros(E1, 2 * ml.I, ml.D // 8, dtype=torch.int32, device=dev)
    w2 = torch.zeros(E1, ml.D, ml.I // 8, dtype=torch.int32, device=dev)
    s13 = torch.full((E1, 2 * ml.I, ml.D // 32), 2.0**-12, dtype=torch.bfloat16, device=dev)
    s2 = torch.full((E1, ml.D, ml.I // 32), 2.0**-8, dtype=torch.bfloat16, device=dev)
    ewo = ExpertWeights("int4", w13, w2, s13, s2, 32)
    x = torch.empty(8, ml.D, device=dev, dtype=torch.bfloat16)
    x[0::2] = 255.0  # every row's max right under a power of two (bf16)
    x[1::2] = -127.5
    tw = torch.ones(8, 2, device=dev)
    ids = torch.tensor([[0, 1]] * 8, device=dev)
    ref = fused_moe_ref(x, ewo, tw, ids)
    for n in names:
        try:
            out = run_variant(VARIANTS[n], x, ewo, tw, ids)
            e = rel(out, ref)
            good = bool(torch.isfinite(out).all()) and e < TOL
            ok[n] &= good
            log(f"  check overflow {n:14s} finite {bool(torch.isfinite(out).all())} vs ref {e:.3e} "
                f"{'ok' if good else 'FAIL'}")  # fmt: skip
        except Exception as ex:  # noqa: BLE001
            ok[n] = False
            log(f"  check overflow {n:14s} ERROR {ex!r}"[:300])
    return ok


DEFAULTS = dict(GS=1, SKIP=1, PREFETCH=0, F16SUM=0, CG=0, CHAINS=1, KT=0)  # the launchers'


def regs_of(cfg) -> str:
    """gate_up / down registers of the kernels compiled for cfg (Triton's cache of the jit)."""
    from k2serve.kernels.int4_gemv import _int4_gemv_h2_grouped_kernel
    from k2serve.kernels.int4_gemv_gsum import _int4_gemv_gsum_kernel

    fn = _int4_gemv_gsum_kernel if cfg.get("GSUM") else _int4_gemv_h2_grouped_kernel
    out = []
    for gated, c in ((True, cfg), (False, {**cfg, **cfg.get("w2", {})})):
        want = {n: c.get(n, DEFAULTS.get(n)) for n in ("BLOCK_N", "W", "BLOCK_M", *DEFAULTS)}
        found = "?"
        for cache in fn.device_caches.values():  # Triton 3.6: (kernels, keys, target, ...)
            for k in cache[0].values():
                consts = getattr(k.src, "constants", {})
                vals = {fn.arg_names[key[0]]: v for key, v in consts.items()}
                same = all(vals[n] == v for n, v in want.items() if n in vals)
                md = k.metadata
                if (same and vals.get("GATED") == gated and md.num_warps == c["num_warps"]
                        and getattr(md, "maxnreg", None) == c.get("maxnreg")):  # fmt: skip
                    found = str(k.n_regs)
        out.append(found)
    return "/".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", default="128,64,192,256")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; later timings skipped")
    ap.add_argument("--dry", action="store_true", help="tiny layer, interpreter, no timing")
    args = ap.parse_args(argv)
    import moe_libs as ml

    t0 = time.time()
    cuda = torch.cuda.is_available() and not args.dry
    dev = "cuda" if cuda else "cpu"
    ml.DEV = dev
    if args.dry:
        ml.E, ml.D, ml.I = 8, 256, 256
        for v in VARIANTS.values():  # W=64 needs K % 512: the tiny layer takes W=32
            v["W"] = min(v["W"], 32)
            v["w2"] = {**v.get("w2", {}), "W": min(v.get("w2", {}).get("W", 64), 32)}
    names = [n for n in args.variants.split(",") if n != "shipped"]
    log(f"gemv_device: variants {['shipped'] + names}; torch {torch.__version__}, device {dev}"
        + (f" {torch.cuda.get_device_name()}" if cuda else ""))  # fmt: skip
    if cuda:
        from k2serve.kernels.policy import KernelPolicy

        table = dict(KernelPolicy.for_device("cuda").tables.int4_decode_grouped)
        log(
            f"  table int4_decode_grouped: {table}{'' if table == SHIPPED else ' (differs from SHIPPED: shipped = SHIPPED here)'}"
        )
        ml.ceilings()
    torch.manual_seed(0)
    ew = ml.int4_experts(dev)
    ok = check_part(ew, names, dev, args.dry)
    if not cuda:
        log("no CUDA: checks only")
        return 0 if all(ok.values()) else 1
    from model_speed import CEIL, graph_ms

    bw = CEIL["bw"]
    per = sum(t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale))
    cases = [(int(T), False) for T in args.tokens.split(",")] + [(128, True)]
    res: dict[tuple, dict[str, float]] = {}
    hits: dict[tuple, int] = {}
    for T, skewed in cases:
        if time.time() - t0 > args.budget:
            log(f"  budget spent: T={T} skipped")
            continue
        routes = [routing(T, skewed, s, dev) for s in (2, 3)]
        hits[(T, skewed)] = sum(r[1].unique().numel() for r in routes) / len(routes)
        x = torch.randn(T, ml.D, device=dev, dtype=torch.bfloat16)
        res[(T, skewed)] = {}
        for n in ["shipped"] + names:
            if n != "shipped" and not ok.get(n):
                continue
            cfg = VARIANTS[n]
            try:
                ms = graph_ms([lambda tw=tw, ti=ti, c=cfg, x=x: run_variant(c, x, ew, tw, ti)
                               for tw, ti in routes])  # fmt: skip
                res[(T, skewed)][n] = ms
                nb = hits[(T, skewed)] * per
                log(f"  time T={T} {'skewed ' if skewed else 'uniform'} {n:14s} {ms:7.3f} ms "
                    f"{100 * nb / (ms * 1e6) / bw:5.1f}% of copy bw")  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log(f"  time T={T} {n}: ERROR {e!r}"[:300])
    log(
        f"\ncopy bw {bw:.0f} GB/s; ms (% of copy bw for the experts hit), one K2 layer's routed experts"
    )
    heads = [f"T={T}{' skew' if s else ''}" for T, s in res]
    log(f"{'variant':14s} {'regs gu/dn':>10s} " + " ".join(f"{h:>15s}" for h in heads))
    for n in ["shipped"] + names:
        try:
            r = regs_of(VARIANTS[n])
        except Exception as e:  # noqa: BLE001
            r = f"? {type(e).__name__}"
        cells = []
        for key in res:
            ms = res[key].get(n)
            nb = hits[key] * per
            cells.append(f"{ms:6.3f} ({100 * nb / (ms * 1e6) / bw:4.1f}%)" if ms else f"{'-':>15s}")
        log(f"{n:14s} {r:>10s} " + " ".join(f"{c:>15s}" for c in cells))
    log(f"checks: {ok}; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        rc = main()
    finally:
        out = os.environ.get("OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "gemv_device.txt"), "w") as f:
                f.write("\n".join(OUT_LINES) + "\n")
    sys.exit(rc)
