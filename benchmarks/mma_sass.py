# ruff: noqa: E501
"""Compile the tensor-core INT4 decode MoE kernel (kernels/int4_moe_mma16.py, the F16 design
that int4_moe_mma runs) for sm_90 without a GPU and print, per config and launch (gate_up:
gated, A_DIV 8; down: top-k weight): registers, spilled bytes, shared memory, CTAs an SM, and
the K loop's SASS instructions per INT4 weight a thread, by opcode class (the loop: the
backward branch whose body holds the HMMAs). Issue 28: wave 9's bf16 design (removed) ran
~5 thread-instructions a weight (Nsight Compute, H100; 4.92 / 5.70 here); Marlin-class ~1-1.5.

Run (no GPU; Triton 3.6, the version of the device image):
  PYTHONPATH=/tmp/tri36:src python benchmarks/mma_sass.py [--f16 16x128g2s3w4,...] [--sass DIR]
An F16 config name: BLOCK_M x BLOCK_N g G s STAGES w WARPS [x: SWAP=1] [p PF].
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

CLASSES = [  # (name, opcode regex) in print order; the first match wins
    ("HMMA", r"HMMA"), ("HFMA2/HADD2/HMUL2", r"H(FMA2|ADD2|MUL2)"), ("LOP3", r"LOP3"),
    ("SHF", r"SHF"), ("PRMT", r"PRMT"), ("F2F/F2FP/cvt", r"F2F|F2FP|I2F|F2I"),
    ("FFMA/FADD/FMUL", r"FFMA|FADD|FMUL"), ("LDG", r"LDG(?!STS|DEPBAR)"), ("LDGSTS", r"LDGSTS"),
    ("LDSM", r"LDSM"), ("LDS", r"LDS"), ("STS", r"STS"), ("SHFL", r"SHFL"), ("IMAD", r"IMAD"),
    ("IADD/ISETP/SEL", r"IADD|ISETP|SEL|VIADD|LEA"), ("BAR/DEPBAR", r"BAR"), ("MOV", r"MOV"),
]  # fmt: skip
DEFAULT_F16 = (  # the device sweep's F16 tiles, and 8x128 (fewest instructions, slow on the H100)
    "16x64g2s3w2x,16x64g4s3w2x,16x64g8s3w2x,16x32g4s3w1x,16x16g8s3w1x,8x32g8s3w1x,8x32g4s3w1x,"
    "8x64g4s3w2x,16x64g2s3w2xp4,16x128g2s3w4,8x128g2s3w2x"
)


def parse_f16(name: str) -> dict:
    m = re.fullmatch(r"(\d+)x(\d+)g(\d)s(\d)w(\d)(x?)(?:p(\d+))?", name)
    if not m:
        raise ValueError(f"bad F16 config name {name!r}")
    bm, bn, g, st, nw, x, pf = m.groups()
    return dict(F16=1, BLOCK_M=int(bm), BLOCK_N=int(bn), G=int(g), num_stages=int(st),
                num_warps=int(nw), SWAP=int(bool(x)), ATOMIC=0, PF=int(pf or 0))  # fmt: skip


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name)


def compile_kernel(fn, ptrs, cons, num_warps, num_stages, maxnreg=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig, div = {}, []
    for i, n in enumerate(names):
        if n in cons:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            div.append(i)
        else:
            sig[n] = "i32"
            if "stride" in n or n == "K":
                div.append(i)
    src = ASTSource(fn=fn, signature=sig, constexprs=cons,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})  # fmt: skip
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass_of(k) -> tuple[str, int, int]:
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
    return sass, int(m.group(1)), int(m.group(2))


def loop_ops(sass: str) -> list[str]:
    """Opcodes of the innermost backward-branch loop that holds HMMAs."""
    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    best = None
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(t.group(1), 16) <= a <= addr]
            if any(o.startswith("HMMA") for o in body) and (best is None or len(body) < len(best)):
                best = body
    return best or []


def classify(ops: list[str]) -> collections.Counter:
    c = collections.Counter()
    for o in ops:
        if o.startswith("@!PT") or o == "NOP":
            continue
        for name, rx in CLASSES:
            if re.match(rx, o):
                c[name] += 1
                break
        else:
            c["other"] += 1
    return c


def report(label, k, nw, weights_per_iter, sass_dir=None):
    sass, regs, stack = sass_of(k)
    smem = k.metadata.shared
    ctas = min(65536 // max(1, -(-regs // 8) * 8 * 32 * nw), 232448 // max(1, smem), 32)
    ops = loop_ops(sass)
    c = classify(ops)
    per = weights_per_iter / (32 * nw)  # weights a thread an iteration
    tot = sum(c.values())
    cls = ", ".join(f"{n} {c[n] / per:.3f}" for n, _ in CLASSES + [("other", "")] if c.get(n))
    print(f"{label:34s} regs {regs:3d}, spill {stack} B, smem {smem:6d} B, CTAs/SM {ctas:2d}, "
          f"warps/SM {ctas * nw:2d}; loop {tot} instr for {per:.0f} weights/thread = "
          f"{tot / per:.2f}/weight", flush=True)  # fmt: skip
    print(f"{'':34s} per weight: {cls}", flush=True)
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
        for ext, text in (("sass", sass), ("ttgir", k.asm["ttgir"]), ("ptx", k.asm["ptx"])):
            with open(os.path.join(sass_dir, f"{name}.{ext}"), "w") as f:
                f.write(text)


def f16_launch(cfg, gated):
    import triton.language as tl

    from k2serve.kernels.int4_moe_mma16 import _int4_mma_f16_kernel

    ptrs = {"a_ptr": "*fp16", "rs_ptr": "*fp32", "w_ptr": "*i32", "s_ptr": "*i32",
            "c_ptr": "*bf16" if gated else "*fp32", "tw_ptr": "*fp32", "sorted_ptr": "*i32",
            "eid_ptr": "*i32", "npost_ptr": "*i32"}  # fmt: skip
    cons = dict(A_DIV=8 if gated else 1, GATED=gated, MUL_W=not gated, OUT_DIV=1,
                ATOMIC=cfg["ATOMIC"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                G=cfg["G"], SWAP=cfg["SWAP"], DOT_DT=tl.float16, USE_ASM=True,
                PF=cfg.get("PF", 0))  # fmt: skip
    k = compile_kernel(_int4_mma_f16_kernel, ptrs, cons, cfg["num_warps"], cfg["num_stages"],
                       cfg.get("maxnreg"))  # fmt: skip
    return k, cfg["BLOCK_N"] * 32 * cfg["G"] * (2 if gated else 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--f16", default=DEFAULT_F16)
    ap.add_argument("--sass", default="", help="write each kernel's SASS / TTGIR / PTX here")
    args = ap.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, target sm_90; per weight = K loop SASS instructions / "
          "INT4 weights a thread an iteration", flush=True)  # fmt: skip
    todo = [(f"f16 {n}", parse_f16(n)) for n in args.f16.split(",") if n]
    ok = True
    for name, cfg in todo:
        for launch, gated in (("gate_up", True), ("down", False)):
            try:
                k, w = f16_launch(cfg, gated)
                report(f"{name} {launch}", k, cfg["num_warps"], w, args.sass or None)
            except Exception as e:  # noqa: BLE001 - report and go on
                ok = False
                msg = " | ".join(str(e).strip().splitlines()[-4:])[:800]
                print(f"{name} {launch}: FAILED {type(e).__name__}: {msg}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
