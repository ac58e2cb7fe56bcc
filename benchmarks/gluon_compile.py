# ruff: noqa: E501
"""Compile the Gluon INT4 GEMM (kernels/int4_gemm_gluon.py) for sm_90 without a GPU and print,
per config and per GEMM of a K2 MoE layer: registers, spilled bytes, shared memory, and the
SASS evidence of the overlap: the WGMMA count and the WARPGROUP.DEPBAR waits (gsb0, 0x1 = one
wgmma left in flight while the next plane is dequantized; 0x0 = wait for all).

Run (no GPU needed; Triton 3.6, the API the kernel is written against):
  PYTHONPATH=/tmp/tri36:src python3 benchmarks/gluon_compile.py [--configs 64x128s5w4,...] [--sass]
A config name is BLOCK_Mx BLOCK_N s STAGES w num_warps [k W2] [h] [i N] (W2 = 16 unless given;
h: the bf16x2 dequant; i N: N wgmmas in flight, 1 unless given; f: the proxy fence; t: TAIL,
an expert's last <= BLOCK_M / 2 pairs in a BLOCK_M / 2 tile; l: L1, words and scales through L1;
w: KW, a K step's words and scales loaded once; ww: KW=2, scales by K-step pair; g: SILU, gate_up stores silu(gate) * up;
c: CARVE, the L1 carveout;
r: MAXNREG, two CTAs an SM's registers).
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
from gluon_int4_device import SWEEP as CONFIGS  # noqa: E402 - the device sweep's names
from gluon_int4_device import cfg_of as parse  # noqa: E402 - one parser of config names


def compile_one(cfg: dict, a_div: int, mul_w: bool, perm_out: bool, arch: int = 90):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from k2serve.kernels.int4_gemm_gluon import _int4_gemm_gluon_kernel
    from k2serve.kernels.int4_gemm_gluon_ws import _int4_gemm_gluon_ws_kernel, ws_regs, ws_split

    ptrs = {"a_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i32", "c_ptr": "*bf16",
            "tw_ptr": "*fp32", "sorted_ptr": "*i32", "eid_ptr": "*i32", "npost_ptr": "*i32",
            "unit_ptr": "*i32"}  # fmt: skip
    ints = ["N", "K", "num_pairs", "a_stride", "c_stride", "w_stride_e", "w_stride_n",
            "s_stride_e", "s_stride_n", "num_blocks"]  # fmt: skip
    cons = dict(A_DIV=a_div, MUL_W=mul_w, PERM_OUT=perm_out, BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"], W2=cfg["W2"], STAGES=cfg["STAGES"], NW=cfg["num_warps"],
                BF16X2=cfg["BF16X2"], INFLIGHT=cfg["INFLIGHT"], FENCE=cfg["FENCE"],
                TAIL=cfg["TAIL"], L1=cfg["L1"], KW=cfg["KW"],
                SILU=cfg["SILU"] and perm_out)  # fmt: skip
    kernel, opts = _int4_gemm_gluon_kernel, {"num_warps": cfg["num_warps"]}
    if cfg.get("WS"):  # the warp-specialized kernel (int4_gemm_gluon_ws.py)
        maxnreg, creg, preg = ws_regs(cfg)
        for key in ("TAIL", "KW", "NW"):
            cons.pop(key)
        nc, cw = ws_split(cfg)
        cons.update(
            NC=nc, CW=cw, PW=cfg.get("PW", 4), CREG=creg, PREG=preg, RELEASE=cfg.get("RELEASE", 1)
        )
        kernel, opts = _int4_gemm_gluon_ws_kernel, {"num_warps": cw, "maxnreg": maxnreg}
    sig = {**ptrs, **dict.fromkeys(ints, "i32"), **dict.fromkeys(cons, "constexpr")}
    div16 = [i for i, k in enumerate(sig) if k in ptrs or k in ints[3:-1]]
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=cons,
                         attrs={(i,): [["tt.divisibility", 16]] for i in div16})  # fmt: skip
    if cfg.get("MAXNREG"):
        opts["maxnreg"] = cfg["MAXNREG"]
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)


def loop_body(sass: str, bars: bool = False):
    """SASS instructions of the K loop (one sub-step: 8 planes): from the target of the
    backward branch after the last HGMMA to that branch; bars: the BAR.SYNC lines in it."""
    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    last = max((i for i, x in enumerate(ins) if x[1].startswith("HGMMA")), default=-1)
    for j in range(max(last, 0), len(ins)):
        t = re.search(r"0x([0-9a-f]+)", ins[j][2]) if ins[j][1].startswith("BRA") else None
        if t and int(t.group(1), 16) < ins[j][0]:
            body = [x for x in ins if int(t.group(1), 16) <= x[0] <= ins[j][0]]
            if bars:
                return [f"{n}{r.split(';')[0]}" for _, n, r in body if n.startswith("BAR.SYNC")]
            return len(body)
    return [] if bars else 0


def report(k, cfg: dict) -> tuple[str, str]:
    """One line of figures, and the SASS text."""
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
    per_sm_smem = 232448 // max(1, k.metadata.shared)
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass)
    counts = {w: waits.count(w) for w in sorted(set(waits))}
    wgmma = len(re.findall(r"\bHGMMA\.", sass))
    body = loop_body(sass)
    per_thread = 8 * cfg["BLOCK_N"] * cfg["W2"] / (32 * nw)  # weights a thread dequantizes
    line = (f"registers {regs:3d}, spilled {stack:3d} B, shared {k.metadata.shared:6d} B, "
            f"CTAs/SM {min(per_sm_regs, per_sm_smem)}; HGMMA {wgmma}, DEPBAR waits {counts}, "
            f"WARPGROUP.ARRIVE {sass.count('WARPGROUP.ARRIVE')}, BAR.SYNC {len(re.findall(r'BAR.SYNC', sass))}, "
            f"LDGSTS {sass.count('LDGSTS')}; loop {body} instr/sub-step = {body / per_thread:.2f} "
            f"per weight")  # fmt: skip
    if cfg.get("WS"):  # the registers of each partition (setmaxnreg), the loop's barriers
        regs = sorted(
            {
                int(v)
                for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])
            }
        )
        line += (f"; WS: setmaxnreg values {regs}, barriers in the (last) consumer loop "
                 f"{loop_body(sass, bars=True)}")  # fmt: skip
    return line, sass


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
        for gemm, a_div, mul_w, perm in (("gate_up", 8, False, True), ("down", 1, True, False)):
            try:
                k = compile_one(cfg, a_div, mul_w, perm)
                line, sass = report(k, cfg)
                print(f"{name:12s} {gemm:8s} {line}", flush=True)
                if args.sass and i == 0 and gemm == "gate_up":
                    os.makedirs(args.sass, exist_ok=True)
                    for ext, text in (
                        ("sass", sass),
                        ("ptx", k.asm["ptx"]),
                        ("ttgir", k.asm["ttgir"]),
                    ):
                        with open(os.path.join(args.sass, f"gluon_int4.{ext}"), "w") as f:
                            f.write(text)
            except Exception as e:  # noqa: BLE001 - report and go on
                ok = False
                msg = str(e).strip().splitlines()
                print(
                    f"{name:12s} {gemm:8s} FAILED {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}",
                    flush=True,
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
