# ruff: noqa: E501
"""Compile the grouped INT4 decode GEMV variants for sm_90 without a GPU and print, per variant
and launch of one K2 MoE layer (gate_up: N=2048 x2 gated, K=7168; down: N=7168, K=2048):
registers, spilled bytes, CTAs per SM (registers), and the K loop's SASS instructions per
weight by opcode class, for BLOCK_M rows and split into the part shared by the block's rows
and the part per row (from the same config compiled at BLOCK_M=1 and BLOCK_M=2 and 4), then the
total at ROWS real rows per expert (--rows, 2.86 = K2 at T=128 uniform routing).

Run (no GPU; Triton 3.6, what the device runs):
  PYTHONPATH=/tmp/tri36:src python3 benchmarks/gemv_sass.py [--variants shipped,gsum] [--sass DIR]
The variants are benchmarks/gemv_device.py's VARIANTS (one list for both scripts).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gemv_device import VARIANTS  # noqa: E402 - one list of variants for both scripts

LAUNCHES = {"gate_up": dict(N=2048, K=7168, gated=True, a_div=8),
            "down": dict(N=7168, K=2048, gated=False, a_div=1)}  # fmt: skip
CLASSES = [  # (name, opcode regex), first match wins
    ("HFMA2", r"^H(FMA2|MUL2|ADD2)(?!\.F32)"),
    ("cvt", r"^(F2F|HADD2\.F32|F2FP|I2F|F2I)"),
    ("LOP3/shift", r"^(LOP3|SHF|PRMT|SHL|SHR)"),
    ("FFMA/FADD", r"^(FFMA|FADD|FMUL|FMNMX)"),
    ("LDG", r"^LDG"),
    ("LDS/STS", r"^(LDS|STS|LDSM)"),
    ("SHFL", r"^SHFL"),
    ("BAR", r"^BAR"),
    (
        "IMAD/addr",
        r"^(IMAD|IADD|LEA|ISETP|SEL|MOV|IABS|UIADD|UIMAD|ULEA|UMOV|USHF|ULOP|UISETP|USEL|S2R|S2UR|R2UR|CS2R)",
    ),
    ("branch", r"^(BRA|BSSY|BSYNC|EXIT|WARPSYNC|YIELD|NOP)"),
]


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)


def compile_one(cfg: dict, launch: str, arch: int = 90):
    """cfg: one launch's config (BLOCK_M, BLOCK_N, W, num_warps, GS, GSUM, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    L = LAUNCHES[launch]
    ptrs = {"a_ptr": "*i32", "rs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*bf16",
            "c_ptr": "*fp32", "tw_ptr": "*fp32", "sorted_ptr": "*i32", "eid_ptr": "*i32",
            "npost_ptr": "*i32"}  # fmt: skip
    ints = ["N", "K", "num_pairs", "a_stride", "c_stride", "w_stride_e", "w_stride_n",
            "s_stride_e", "s_stride_n"]  # fmt: skip
    if cfg.get("GSUM"):
        from k2serve.kernels.int4_gemv_gsum import _int4_gemv_gsum_kernel as fn

        cons = dict(A_DIV=L["a_div"], GATED=L["gated"], BLOCK_M=cfg["BLOCK_M"],
                    BLOCK_N=cfg["BLOCK_N"], W=cfg["W"], USE_ASM=True, SKIP=cfg.get("SKIP", 1),
                    EVEN_N=L["N"] % cfg["BLOCK_N"] == 0, PREFETCH=cfg.get("PREFETCH", 0), CHAINS=cfg.get("CHAINS", 1),
                    CG=cfg.get("CG", 0), KT=cfg.get("KT", 0))  # fmt: skip
    else:
        from k2serve.kernels.int4_gemv import _int4_gemv_h2_grouped_kernel as fn

        cons = dict(A_DIV=L["a_div"], GATED=L["gated"], BLOCK_M=cfg["BLOCK_M"],
                    BLOCK_N=cfg["BLOCK_N"], W=cfg["W"], WPG=4, USE_ASM=True, GS=cfg.get("GS", 1),
                    SKIP=cfg.get("SKIP", 1), PREFETCH=cfg.get("PREFETCH", 0),
                    F16SUM=cfg.get("F16SUM", 0), CG=cfg.get("CG", 0))  # fmt: skip
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(cons, "constexpr")}
    div16 = [i for i, k in enumerate(sig) if k in ptrs or k in ints]  # K2 sizes: all % 16 == 0
    src = ASTSource(fn=fn, signature=sig, constexprs=cons,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div16})  # fmt: skip
    opts = {"num_warps": cfg["num_warps"]}
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def sass_of(k) -> tuple[str, int, int]:
    """(SASS text, registers, spilled bytes) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    usage = subprocess.run([tool("cuobjdump"), "-res-usage", f.name], capture_output=True,
                           text=True).stdout  # fmt: skip
    sass = subprocess.run([tool("cuobjdump"), "-sass", f.name], capture_output=True,
                          text=True).stdout  # fmt: skip
    os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage.replace("\n", " "))
    return sass, (int(m.group(1)) if m else 0), (int(m.group(2)) if m else -1)


def loop_ops(sass: str) -> list[str]:
    """Opcodes of the K loop: the longest span from a backward branch's target to it."""
    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best: list[str] = []
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(t.group(1), 16) <= a <= addr]
            if len(body) > len(best):
                best = body
    return best


def classify(ops: list[str]) -> dict[str, int]:
    out = collections.Counter()
    for op in ops:
        for name, rx in CLASSES:
            if re.match(rx, op):
                out[name] += 1
                break
        else:
            out["other"] += 1
    return out


def measure(cfg: dict, launch: str):
    """(registers, spilled, loop class counts per weight) for cfg as given."""
    k = compile_one(cfg, launch)
    sass, regs, stack = sass_of(k)
    L = LAUNCHES[launch]
    weights = cfg["BLOCK_N"] * cfg["W"] * 8 * (2 if L["gated"] else 1) / (32 * cfg["num_warps"])
    cls = classify(loop_ops(sass))
    return regs, stack, {c: n / weights for c, n in cls.items()}, sass


def fmt(d: dict[str, float]) -> str:
    keys = [c for c, _ in CLASSES] + ["other"]
    return " ".join(f"{c} {d.get(c, 0):.2f}" for c in keys if abs(d.get(c, 0)) >= 0.005)


def launch_cfg(cfg: dict, launch: str) -> dict:
    c = {key: v for key, v in cfg.items() if key != "w2"}
    return {**c, **cfg.get("w2", {})} if launch == "down" else c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--launches", default="gate_up,down")
    ap.add_argument("--rows", type=float, default=2.86)
    ap.add_argument("--sass", default="", help="write each variant's gate_up SASS here")
    args = ap.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, sm_90; thread-instructions per weight in the K loop")
    ok = True
    for name in args.variants.split(","):
        for launch in args.launches.split(","):
            cfg = launch_cfg(VARIANTS[name], launch)
            try:
                regs, stack, per_w, sass = measure(cfg, launch)
                c1 = measure({**cfg, "BLOCK_M": 1}, launch)[2]
                c2 = measure({**cfg, "BLOCK_M": 2}, launch)[2]
                row = {c: c2.get(c, 0) - c1.get(c, 0) for c in set(c1) | set(c2)}
                shared = {c: c1.get(c, 0) - row.get(c, 0) for c in set(c1) | set(row)}
                tot = sum(shared.values()) + args.rows * sum(row.values())
                ctas = 65536 // max(1, -(-regs // 8) * 8 * 32 * cfg["num_warps"])
                print(f"{name:14s} {launch:7s} regs {regs:3d} spill {stack:3d} CTAs/SM {ctas:2d} "
                      f"warps/SM {ctas * cfg['num_warps']:2d} | BLOCK_M={cfg['BLOCK_M']}: "
                      f"{sum(per_w.values()):.2f}/weight | at {args.rows} rows: {tot:.2f}/weight", flush=True)  # fmt: skip
                print(f"    per row   : {sum(row.values()):.3f}  {fmt(row)}")
                print(f"    shared    : {sum(shared.values()):.3f}  {fmt(shared)}")
                if args.sass and launch == "gate_up":
                    os.makedirs(args.sass, exist_ok=True)
                    with open(os.path.join(args.sass, f"gemv_{name}.sass"), "w") as f:
                        f.write(sass)
            except Exception as e:  # noqa: BLE001 - report and go on
                ok = False
                msg = str(e).strip().splitlines()
                print(f"{name:14s} {launch:7s} FAILED {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}", flush=True)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
