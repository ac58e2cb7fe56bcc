# ruff: noqa: E501
"""Compile the Gluon FP8-block GEMM (kernels/fp8_gemm_gluon.py) for sm_90 without a GPU and print,
per config and per GEMM of a K2 MoE layer (gate_up with the SiLU store, down with the routing
weights): registers, spilled bytes, shared memory, CTAs an SM holds, and SASS facts: HGMMA count,
the WARPGROUP.DEPBAR waits (gsb0, 0x1: one sub-step's MMA in flight while the next tile is
converted), LDS / conversion instructions and the K loop's instructions per weight.

Run (no GPU needed; Triton 3.6):
  PYTHONPATH=/tmp/tri36:src python3 benchmarks/gluon_fp8_compile.py [--configs 128x128k64s4w8p,...] [--sass DIR]
Config names: benchmarks/fp8_gluon_device.py's `cfg_of` (the device sweep's list by default).
Exit status 1 when a config fails to compile or spills.
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
from fp8_gluon_device import SWEEP as CONFIGS  # noqa: E402 - the device sweep's names
from fp8_gluon_device import cfg_of as parse  # noqa: E402 - one parser of config names
from gluon_compile import loop_body, tool  # noqa: E402 - the INT4 script's SASS helpers

GEMMS = {"gate_up": (8, False, True), "down": (1, True, False)}  # A_DIV, MUL_W, SILU


def compile_one(cfg: dict, a_div: int, mul_w: bool, silu: bool, arch: int = 90):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k2serve.kernels.fp8_gemm_gluon import _fp8_gemm_gluon_kernel
    from k2serve.kernels.fp8_gemm_gluon_ws import (
        _fp8_gemm_gluon_ws_kernel,
        fp8_ws_check,
        fp8_ws_smem_bytes,
    )
    from k2serve.kernels.int4_gemm_gluon_ws import ws_regs, ws_split

    ptrs = {"a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "c_ptr": "*bf16",
            "tw_ptr": "*fp32", "sorted_ptr": "*i32", "eid_ptr": "*i32", "npost_ptr": "*i32",
            "unit_ptr": "*i32"}  # fmt: skip
    ints = ["N", "K", "num_pairs", "a_stride", "c_stride", "w_stride_e", "w_stride_n",
            "s_stride_e", "s_stride_n", "num_blocks"]  # fmt: skip
    cons = dict(A_DIV=a_div, MUL_W=mul_w, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                KS=cfg["KS"], STAGES=cfg["STAGES"], NW=cfg["num_warps"], PROMOTE=cfg["PROMOTE"],
                CVT32=cfg["CVT32"], SILU=silu and cfg["SILU"], TAIL=cfg["TAIL"])  # fmt: skip
    kernel, opts = _fp8_gemm_gluon_kernel, {"num_warps": cfg["num_warps"]}
    if cfg.get("WS"):  # the warp-specialized kernel (fp8_gemm_gluon_ws.py)
        fp8_ws_check(dict(cfg, SILU=silu and cfg["SILU"]))
        maxnreg, creg, preg = ws_regs(cfg, fp8_ws_smem_bytes(cfg))
        nc, cw = ws_split(cfg)
        for key in ("TAIL", "NW", "PROMOTE", "CVT32"):
            cons.pop(key)
        ptrs.pop("unit_ptr")
        ints.remove("num_blocks")
        cons.update(NC=nc, CW=cw, FENCE=bool(cfg.get("FENCE")), PW=cfg.get("PW", 4),
                    RELEASE=cfg.get("RELEASE", 1), CREG=creg, PREG=preg)  # fmt: skip
        kernel, opts = _fp8_gemm_gluon_ws_kernel, {"num_warps": cw, "maxnreg": maxnreg}
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(cons, "constexpr")}
    # what a launch at K2 sizes specializes: pointers, strides and N, K divisible by 16
    div16 = [
        i
        for i, k in enumerate(sig)
        if k in ptrs or k in ("N", "K", "a_stride", "c_stride", "w_stride_e", "w_stride_n")
    ]
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=cons,
                         attrs={(i,): [["tt.divisibility", 16]] for i in div16})  # fmt: skip
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def report(k, cfg: dict) -> tuple[str, str, int]:
    """One line of figures, the SASS text, and the spilled bytes."""
    nw = cfg["num_warps"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    usage = subprocess.run(
        [tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
    ).stdout
    sass = subprocess.run(
        [tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True
    ).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage.replace("\n", " "))
    regs, stack = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
    per_sm_regs = 65536 // max(1, -(-regs // 8) * 8 * 32 * nw)
    per_sm_smem = 232448 // max(1, k.metadata.shared + 1024)
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    counts = {w: waits.count(w) for w in sorted(set(waits))}
    body = loop_body(sass)
    # the loop runs one 128-column K block: BLOCK_N * 128 weights over the CTA's threads
    per_thread = cfg["BLOCK_N"] * 128 / (32 * nw)
    line = (f"registers {regs:3d}, spilled {stack:3d} B, shared {k.metadata.shared:6d} B, "
            f"CTAs/SM {min(per_sm_regs, per_sm_smem)}; HGMMA {len(re.findall(r'HGMMA[.]', sass))}, "
            f"DEPBAR waits {counts}, LDS {len(re.findall(r'LDS[.]', sass))}, "
            f"F2F {len(re.findall(r'F2F[.]', sass))}, PRMT {sass.count('PRMT')}; "
            f"loop {body} instr/K block = {body / per_thread:.2f} per weight")  # fmt: skip
    if cfg.get("WS"):  # the registers of each partition (setmaxnreg), the loop's barriers
        ptx = k.asm["ptx"]
        regs_ws = sorted(
            {int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
        )
        line += (f"; WS: maxnreg {k.metadata.maxnreg if hasattr(k.metadata, 'maxnreg') else '?'}, "
                 f"setmaxnreg values {regs_ws}, stages {cfg['STAGES']}, barriers in the (last) "
                 f"consumer loop {loop_body(sass, bars=True)}, mbarrier waits (try_wait) "
                 f"{ptx.count('mbarrier.try_wait')}")  # fmt: skip
    return line, sass, stack


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--sass", default="", help="write the first config's SASS/PTX/TTGIR here")
    args = ap.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, target sm_90", flush=True)
    ok = True
    for i, name in enumerate(args.configs.split(",")):
        cfg = parse(name)
        for gemm, (a_div, mul_w, silu) in GEMMS.items():
            try:
                k = compile_one(cfg, a_div, mul_w, silu)
                line, sass, stack = report(k, cfg)
                ok &= stack == 0
                print(f"{name:18s} {gemm:8s} {line}", flush=True)
                if args.sass and i == 0 and gemm == "gate_up":
                    os.makedirs(args.sass, exist_ok=True)
                    for ext, text in (
                        ("sass", sass),
                        ("ptx", k.asm["ptx"]),
                        ("ttgir", k.asm["ttgir"]),
                    ):
                        with open(os.path.join(args.sass, f"gluon_fp8.{ext}"), "w") as f:
                            f.write(text)
            except Exception as e:  # noqa: BLE001 - report and go on
                ok = False
                msg = str(e).strip().splitlines()
                print(
                    f"{name:18s} {gemm:8s} FAILED {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}",
                    flush=True,
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
