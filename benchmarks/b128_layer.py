# ruff: noqa: E501, E741, B023, F821
"""Issue 28's decode B=128 target on one K2 MoE layer (384 experts of 7168 x 2048, INT4 group
32, top-8): the grouped INT4 decode GEMV's variants against the current kernel, same process.

Run (one GPU, from the repo root):  PYTHONPATH=src python3 benchmarks/b128_layer.py
  [--tokens 32,64,128,192,256] [--variants shipped,S3,X2_S3,...] [--smoke]

Variants are the policy table's `int4_decode_grouped` entry (`shipped`) with overrides
(VARIANTS below): STAGES (the K loop software-pipelined: loads in flight through shared memory),
X2 (word pairs, kernels/int4_x2.py), NPB (N-blocks per program in one flat loop), BLOCK_M, the
down launch's tile. For each token count, on
uniform routing and the dummy router's skew (tokens on a third of the experts, as
benchmarks/moe_libs.py): the per-pair GEMV and the INT4 GEMM (what the dispatch weighs), then
every variant: checked against the per-pair GEMV's output first (relative difference <= 5e-3,
else the variant is not timed for that case), then replayed from a CUDA graph; ms and % of the
copy bandwidth measured in the same run for the bytes actually read (each expert hit: weights +
scales, once). At T=128 each variant's two launches are also timed alone (gate+up, down: which
one limits). Prints a summary table (ms, % copy bw, x vs shipped) and the table entry of the
variant that is fastest at T=128 uniform without losing more than 2% anywhere at T=64..256.
--smoke: tiny sizes on the CPU interpreter (the code paths only; no timing worth reading).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_speed import CEIL, FAILS, log, print_table, row, run_part, timed  # noqa: E402

# overrides of the shipped `int4_decode_grouped` entry; "w2": of the down launch only
VARIANTS = {
    # (w13 registers / programs of 4 warps per SM, sm_90, Triton 3.9: b128_compile.py)
    "shipped": {},  # 167 / 3; down 80 / 6
    "X2_S3_W32_P4": {"X2": 1, "STAGES": 3, "W": 32, "NPB": 4, "w2": {"W": 32}},  # 128 / 4
    "X2_S4_W32_P4_BN8": {
        "X2": 1,
        "STAGES": 4,
        "W": 32,
        "NPB": 4,
        "BLOCK_N": 8,
        "w2": {"W": 32, "BLOCK_N": 8},
    },  # 80 / 6; down 64 / 8
    "X2_S4_W32_P4_R128": {
        "X2": 1,
        "STAGES": 4,
        "W": 32,
        "NPB": 4,
        "maxnreg": 128,
        "w2": {"W": 32},
    },  # 128 + 24 B spilled / 4
    "X2_S3": {"X2": 1, "STAGES": 3},  # 238 / 2
    "X2_S4_W32": {"X2": 1, "STAGES": 4, "W": 32, "w2": {"W": 32}},  # 140 / 3
    "X2_S3_W32": {"X2": 1, "STAGES": 3, "W": 32, "w2": {"W": 32}},  # 140 / 3
    "S3_W32_P4": {"STAGES": 3, "W": 32, "NPB": 4, "w2": {"W": 32}},  # 128 / 4
    "X2_S4_W32_P4": {"X2": 1, "STAGES": 4, "W": 32, "NPB": 4, "w2": {"W": 32}},  # 131 / 3
    "S3": {"STAGES": 3},  # 241 / 2
    "X2_S3_BN8": {"X2": 1, "STAGES": 3, "BLOCK_N": 8, "w2": {"BLOCK_N": 8}},  # 140 / 3
    "X2_S3_R168": {"X2": 1, "STAGES": 3, "maxnreg": 168},  # 168 + 56 B spilled / 3
    "X2_S3_P4": {"X2": 1, "STAGES": 3, "NPB": 4},
    "X2_S3_w2P4": {"X2": 1, "STAGES": 3, "w2": {"NPB": 4}},
    "X2": {"X2": 1},  # 168 / 3
    "S2": {"STAGES": 2},  # 192 / 2
    "X2_S3_W32_P8": {"X2": 1, "STAGES": 3, "W": 32, "NPB": 8, "w2": {"W": 32}},
    "S4": {"STAGES": 4},
    "X2_S4": {"X2": 1, "STAGES": 4},  # 238 / 2
    "S3_P4": {"STAGES": 3, "NPB": 4},
    "X2_S3_M8": {"X2": 1, "STAGES": 3, "BLOCK_M": 8},  # 255 + 88 B spilled / 1
    "X2_S3_w2N32": {"X2": 1, "STAGES": 3, "w2": {"BLOCK_N": 32}},
    "F16SUM_S3": {"F16SUM": 1, "STAGES": 3},
}


def variant(base: dict, over: dict) -> dict:
    cfg = {k: v for k, v in base.items() if k != "w2"}
    w2 = dict(base.get("w2", {}))
    for k, v in over.items():
        if k == "w2":
            w2.update(v)
        else:
            cfg[k] = v
    cfg["w2"] = w2
    return cfg


def measure(fn, dev, iters=20) -> float:
    """ms per call: replayed from a CUDA graph on a GPU, one timed call on the CPU."""
    if dev != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()  # compile / warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return timed(g.replay, iters=iters)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def ceil_bw(dev):
    if dev != "cuda":
        CEIL["bw"] = float("nan")
        return
    n = 1 << 30
    a = torch.randn(n, device=dev)
    b = torch.empty_like(a)
    CEIL["bw"] = 2 * a.numel() * 4 / timed(lambda: b.copy_(a), iters=10) / 1e6
    del a, b
    torch.cuda.empty_cache()
    log(f"ceilings: copy {CEIL['bw']:.0f} GB/s (read+write, 8 GiB)")


def split_launches(ew, x, tw, ids, cfg, asm, dev, label=""):
    """(gate+up ms, down ms) of the grouped GEMV's two launches alone (routing prep, packing
    and the intermediate done outside the timing)."""
    from k2serve.kernels.int4_gemv import _launch_grouped, grouped_launch_configs, pack_h2
    from k2serve.kernels.moe_align import moe_align_block_size

    T, D = x.shape
    k, I = ids.shape[1], ew.intermediate
    M = T * k
    c13, c2 = grouped_launch_configs(cfg, ew, D)
    twf = tw.reshape(-1).float().contiguous()
    srt, eid, npost = moe_align_block_size(ids, ew.num_experts, c13["BLOCK_M"])
    inter = torch.empty(M, I, dtype=torch.float32, device=dev)
    out = torch.empty(M, D, dtype=torch.float32, device=dev)
    a, rs = pack_h2(x, c13["W"])
    a2, rs2 = pack_h2(torch.randn(M, I, device=dev), c2["W"])
    g = ew.group_size
    for name, kern in (("gate+up", _launch_grouped(a, rs, ew.w13, ew.w13_scale, inter, twf, srt, eid,
                                                   npost, I, D, M, k, True, c13, g, asm)),
                       ("down", _launch_grouped(a2, rs2, ew.w2, ew.w2_scale, out, twf, srt, eid,
                                                npost, D, I, M, 1, False, c2, g, asm))):  # fmt: skip
        regs = (getattr(kern, "n_regs", "?"), getattr(kern, "n_spills", "?"),
                getattr(getattr(kern, "metadata", None), "shared", "?"))  # fmt: skip
        log(f"  {label} {name}: registers {regs[0]}, spilled {regs[1]}, shared memory {regs[2]} B")
    ms13 = measure(lambda: _launch_grouped(a, rs, ew.w13, ew.w13_scale, inter, twf, srt, eid, npost,
                                           I, D, M, k, True, c13, g, asm), dev)  # fmt: skip
    ms2 = measure(lambda: _launch_grouped(a2, rs2, ew.w2, ew.w2_scale, out, twf, srt, eid, npost,
                                          D, I, M, 1, False, c2, g, asm), dev)  # fmt: skip
    return ms13, ms2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,64,256,192,32", help="uniform routing")
    ap.add_argument("--skew-tokens", default="128", help="the dummy router's skew")
    ap.add_argument("--split-tokens", default="128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--budget",
        type=float,
        default=95.0,
        help="seconds: no new case starts after this (the summary still prints)",
    )
    ap.add_argument(
        "--no-refs",
        action="store_true",
        help="do not time the per-pair GEMV and the GEMM (still the reference)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU interpreter")
    args = ap.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from routing_modes import routing_ids

    from k2serve.kernels.fused_moe import ExpertWeights
    from k2serve.kernels.int4_gemm import int4_moe_gemm
    from k2serve.kernels.int4_gemv import int4_moe_decode, int4_moe_decode_grouped
    from k2serve.kernels.policy import KernelPolicy, load_tables

    dev = "cpu" if smoke else "cuda"
    E, D, I, K = (12, 256, 128, 2) if smoke else (384, 7168, 2048, 8)
    tables = load_tables() if smoke else KernelPolicy.for_device(dev).tables
    asm = True
    log(f"{'CPU interpreter (smoke)' if smoke else torch.cuda.get_device_name()} torch "
        f"{torch.__version__} triton {__import__('triton').__version__} date {time.strftime('%Y-%m-%d')}; "
        f"table {tables.kind}")  # fmt: skip
    torch.manual_seed(0)
    ceil_bw(dev)

    def pk(n, kk):
        return torch.randint(-(2**31), 2**31 - 1, (E, n, kk // 8), dtype=torch.int32, device=dev)

    def sc(n, kk):
        return (torch.rand(E, n, kk // 32, device=dev) * 0.004 + 0.002).bfloat16()

    ew = ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)
    per13 = ew.w13[0].numel() * 4 + ew.w13_scale[0].numel() * 2
    per2 = ew.w2[0].numel() * 4 + ew.w2_scale[0].numel() * 2
    shipped = {k: (dict(v) if k == "w2" else v) for k, v in tables.int4_decode_grouped.items()}
    if smoke:  # a block that fits the tiny sizes
        shipped = {**shipped, "W": 16, "w2": {**shipped.get("w2", {}), "W": 16}}
    log(f"shipped int4_decode_grouped: {json.dumps(shipped)}")
    names = [n for n in args.variants.split(",") if n]
    cfgs = {n: variant(shipped, VARIANTS[n]) for n in names}
    h2 = dict(tables.int4_decode)
    if smoke:
        h2 = {**h2, "W": 16, "w2": {**h2.get("w2", {}), "W": 16}}
    skew = [[1000 if e % 3 == 0 else 0 for e in range(E)]]  # a third of the experts
    cases = [(int(t), "uniform") for t in args.tokens.split(",") if t]
    cases += [(int(t), "skew") for t in args.skew_tokens.split(",") if t]
    split_at = {int(t) for t in args.split_tokens.split(",") if t}
    res: dict[tuple[int, str], dict[str, float]] = {}
    pct: dict[tuple[int, str], dict[str, float]] = {}
    t_start = time.time()
    for T, mode in cases:
        if time.time() - t_start > args.budget:
            log(f"  budget of {args.budget:.0f}s spent: T={T} {mode} and later cases not run")
            break
        tag = f"T={T} {mode}"
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        tw = torch.rand(T, K, device=dev)
        ids = routing_ids("uniform" if mode == "uniform" else "record:x", T, E, K, 0, T, dev,
                          None if mode == "uniform" else skew)  # fmt: skip
        hits = int(ids.unique().numel())
        nb = hits * (per13 + per2)
        note = f"{hits} experts, {T * K / hits:.2f} pairs/expert"
        ref = int4_moe_decode(x, ew, tw, ids, h2)
        res[(T, mode)], pct[(T, mode)] = {}, {}
        refs = (("per-pair GEMV", lambda: int4_moe_decode(x, ew, tw, ids, h2)),
                ("INT4 GEMM", lambda: int4_moe_gemm(x, ew, tw, ids, tables.int4_prefill)))  # fmt: skip
        for name, fn in () if args.no_refs else refs:
            try:
                ms = measure(fn, dev)
                row("b128", f"{tag} {name}", ms, nb, 0, note)
                res[(T, mode)][name] = ms
            except Exception as e:  # noqa: BLE001 - report, go on
                log(f"  {tag} {name}: {e!r}"[:300])
        for name, cfg in cfgs.items():
            if time.time() - t_start > args.budget + 10:  # the summary must still print
                log(f"  budget spent: {tag} {name} and the variants after it not run")
                break
            try:
                out = int4_moe_decode_grouped(x, ew, tw, ids, cfg, asm)
                err = rel(out, ref)
                if not (err <= 5e-3 or (smoke and err <= 2e-2)):
                    log(
                        f"  {tag} grouped {name}: differs from the per-pair GEMV by {err:.1e}: not timed"
                    )
                    FAILS.append(f"{tag} {name} diff {err:.1e}")
                    continue
                ms = measure(lambda c=cfg: int4_moe_decode_grouped(x, ew, tw, ids, c, asm), dev)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile or run
                log(f"  {tag} grouped {name}: {type(e).__name__}: {str(e)[:400]}")
                FAILS.append(f"{tag} {name}: {type(e).__name__}")
                continue
            res[(T, mode)][name] = ms
            pct[(T, mode)][name] = 100 * nb / ms / 1e6 / CEIL["bw"]
            base = res[(T, mode)].get("shipped", float("nan"))
            row("b128", f"{tag} grouped {name}", ms, nb, 0,
                f"{note}; {base / ms:.3f}x shipped; diff {err:.1e}")  # fmt: skip
            if T in split_at:
                try:
                    m13, m2 = split_launches(ew, x, tw, ids, cfg, asm, dev, f"{tag} {name}")
                    row("b128-split", f"{tag} {name} gate+up", m13, hits * per13)
                    row("b128-split", f"{tag} {name} down", m2, hits * per2)
                except Exception as e:  # noqa: BLE001
                    log(f"  {tag} split {name}: {e!r}"[:300])
    summary(res, pct, cfgs, cases, cases[0])


def summary(res, pct, cfgs, cases, key):
    cols = sorted((c for c in cases if res.get(c)), key=lambda c: (c[1] != "uniform", c[0]))
    log("\n| variant | " + " | ".join(f"T={T} {m}" for T, m in cols) + " |")
    log("|---|" + "---|" * len(cols))
    for name in ["per-pair GEMV", "INT4 GEMM", *cfgs]:
        cells = []
        for c in cols:
            ms = res[c].get(name)
            if ms is None:
                cells.append("-")
                continue
            base = res[c].get("shipped")
            p = pct[c].get(name)
            extra = f" {p:.0f}%" if p is not None and p == p else ""
            cells.append(f"{ms:.3f}{extra}" + (f" {base / ms:.2f}x" if base else ""))
        log(f"| {name} | " + " | ".join(cells) + " |")
    # the pick: fastest at `key` (the first case: T=128 uniform), within 2% of shipped at every
    # other measured T=64..256
    if key not in res or "shipped" not in res[key]:
        return
    ok = []
    for name in cfgs:
        if name not in res[key]:
            continue
        lose = [c for c in cols if 64 <= c[0] <= 256 and "shipped" in res[c]
                and res[c].get(name, float("inf")) > 1.02 * res[c]["shipped"]]  # fmt: skip
        if not lose:
            ok.append(name)
    if not ok:
        log("pick: none of the variants holds within 2% of shipped at T=64..256")
        return
    best = min(ok, key=lambda n: res[key][n])
    log(f"pick: {best} at T={key[0]} {key[1]} {res[key][best]:.3f} ms "
        f"({pct[key].get(best, float('nan')):.0f}% of copy bw) against shipped {res[key]['shipped']:.3f} "
        f"({pct[key].get('shipped', float('nan')):.0f}%)")  # fmt: skip
    log(f'for configs/<kind>.json: "int4_decode_grouped": {json.dumps(cfgs[best])}')


if __name__ == "__main__":
    run_part("b128", main)
    print_table()
