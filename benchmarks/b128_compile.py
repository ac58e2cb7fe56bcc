# ruff: noqa: E501
"""Compile the grouped INT4 decode GEMV's variants (b128_layer.VARIANTS) for sm_90 without a GPU
and print each launch's registers, spilled bytes, shared memory and cp.async count: how many
programs fit an SM (65536 registers) and whether the pipelined loop spilled, before a device run.

Run (no GPU needed, Triton with its NVIDIA backend installed):
  PYTHONPATH=src python3 benchmarks/b128_compile.py [--variants shipped,X2_S3,...] [--arch 90]
Shapes: K2's (gate+up: N=2048 rows of K=7168; down: N=7168 of K=2048); the figures depend on
the launch's constexprs only. Registers as ptxas reports them (cuobjdump -res-usage).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def compile_launch(cfg: dict, gated: bool, arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k2serve.kernels.int4_gemv import _int4_gemv_h2_grouped_kernel, _stages

    x2 = bool(cfg.get("X2", 0))
    w = "*i64" if x2 else "*i32"
    ptrs = {"a_ptr": w, "rs_ptr": "*fp32", "w_ptr": w, "s_ptr": "*bf16", "c_ptr": "*fp32",
            "tw_ptr": "*fp32", "sorted_ptr": "*i32", "eid_ptr": "*i32", "npost_ptr": "*i32"}  # fmt: skip
    ints = ["N", "K", "num_pairs", "a_stride", "c_stride", "w_stride_e", "w_stride_n",
            "s_stride_e", "s_stride_n"]  # fmt: skip
    cons = dict(A_DIV=8 if gated else 1, GATED=gated, BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"], W=cfg["W"] // 2 if x2 else cfg["W"], WPG=2 if x2 else 4,
                USE_ASM=True, GS=cfg.get("GS", 1), SKIP=cfg.get("SKIP", 1),
                PREFETCH=cfg.get("PREFETCH", 0), F16SUM=cfg.get("F16SUM", 0), X2=x2,
                STAGES=_stages(cfg), NPB=max(1, int(cfg.get("NPB", 1))))  # fmt: skip
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(cons, "constexpr")}
    div16 = [i for i, k in enumerate(sig) if k in ptrs or k in ints[3:]]  # pointers, strides
    src = ASTSource(fn=_int4_gemv_h2_grouped_kernel, signature=sig, constexprs=cons,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div16})  # fmt: skip
    opts = {"num_warps": cfg["num_warps"]}
    if cfg.get("maxnreg"):
        opts["maxnreg"] = int(cfg["maxnreg"])
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage.replace("\n", " "))
    regs, stack = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
    rounded = -(-regs // 8) * 8
    per_sm = 65536 // max(1, rounded * 32 * cfg["num_warps"])
    return (
        f"registers {regs:3d} (programs/SM {per_sm}), spilled {stack:3d} B, shared "
        f"{k.metadata.shared:6d} B, cp.async {k.asm['ptx'].count('cp.async.')}"
    )


def main(argv=None):
    from b128_layer import VARIANTS, variant

    from k2serve.kernels.policy import load_tables

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    shipped = {
        k: (dict(v) if k == "w2" else v) for k, v in load_tables().int4_decode_grouped.items()
    }
    for name in args.variants.split(","):
        cfg = variant(shipped, VARIANTS[name])
        c13 = {k: v for k, v in cfg.items() if k != "w2"}
        c2 = {**c13, **cfg["w2"]}
        for launch, c, gated in (("gate+up", c13, True), ("down", c2, False)):
            try:
                print(f"{name:14s} {launch:8s} {compile_launch(c, gated, args.arch)}", flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                print(
                    f"{name:14s} {launch:8s} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True
                )


if __name__ == "__main__":
    main()
