"""The inline PTX of the f16x2 INT4 dequant (int4_dequant.f16x2_dequant_asm) as its three users
build it (int4_gemv._word_dot_h2, int4_gemv_parts._dq_h2, int4_moe_mma16._dq8), run on CPU by
a small emulator of the PTX instructions it uses: each block turns random words into exactly
n - 8 per nibble at the operand positions its caller reads. (The GPU runs these blocks only with
the inline PTX on: the kernel tests under the interpreter take the plain-Triton paths.)"""

import re

import numpy as np
import pytest

pytest.importorskip("triton")

F16 = np.float16


def _h2(v: int) -> tuple[np.float16, np.float16]:
    """(low, high) halves of a 32-bit register as f16."""
    return tuple(np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(F16))


def _pack(lo, hi) -> int:
    b = np.array([lo, hi], dtype=F16).view(np.uint16)
    return int(b[0]) | int(b[1]) << 16


def run_ptx(asm: str, regs: dict) -> dict:
    """Emulate the block's instructions on `regs` (name or "$i" -> int / float)."""

    def val(x):
        return regs[x] if x in regs else int(x, 0)

    for line in asm.replace("{", " { ").replace("}", " } ").split(";"):
        toks = [t for t in re.split(r"[\s,]+", line) if t and t not in "{}"]
        if not toks or toks[0] == ".reg":
            continue
        op, d, *a = toks
        if op == "mov.b32" and len(a) == 2:  # mov.b32 {lo, hi}, r: split into halves
            regs[d], regs[a[0]] = _h2(val(a[1]))
        elif op == "mov.b32":
            regs[d] = val(a[0])
        elif op == "lop3.b32" and a[3] == "0xEA":  # (a & b) | c
            regs[d] = (val(a[0]) & val(a[1])) | val(a[2])
        elif op == "shr.u32":
            regs[d] = val(a[0]) >> val(a[1])
        elif op in ("sub.f16x2", "mul.f16x2", "fma.rn.f16x2"):
            x, y = (_h2(val(r)) for r in a[:2])
            z = _h2(val(a[2])) if op.startswith("fma") else (0, 0)
            f = {"sub.f16x2": lambda p, q, _: p - q, "mul.f16x2": lambda p, q, _: p * q,
                 "fma.rn.f16x2": lambda p, q, r: float(p) * float(q) + float(r)}[op]  # fmt: skip
            regs[d] = _pack(*(F16(f(x[i], y[i], z[i])) for i in range(2)))
        elif op == "cvt.f32.f16":
            regs[d] = np.float32(regs[a[0]])
        elif op == "add.f32":
            regs[d] = np.float32(regs[a[0]] + regs[a[1]])
        else:
            raise AssertionError(f"unexpected PTX {line!r}")
    return regs


WORDS = [0, -1, 0x01234567, -0x789ABCDF] + [
    int(v) for v in np.random.default_rng(0).integers(-(2**31), 2**31, 16)
]


def nibbles(w: int) -> list[int]:
    return [((w >> (4 * j)) & 15) - 8 for j in range(8)]


@pytest.mark.parametrize("w", WORDS)
def test_dq_h2_and_dq8_blocks_give_n_minus_8(w):
    from k2serve.kernels.int4_gemv_parts import _DQ_H2_ASM
    from k2serve.kernels.int4_moe_mma16 import _DQ8_ASM

    n = nibbles(w)
    r = run_ptx(_DQ_H2_ASM.value, {"$4": w & 0xFFFFFFFF})  # $0..$3 = (n_j - 8, n_j+4 - 8)
    assert [tuple(float(h) for h in _h2(r[f"${j}"])) for j in range(4)] == [
        (n[j], n[j + 4]) for j in range(4)
    ]
    r = run_ptx(_DQ8_ASM.value, {"$8": w & 0xFFFFFFFF})  # $0..$7 = n_j - 8
    assert [float(r[f"${j}"]) for j in range(8)] == n


@pytest.mark.parametrize("w", WORDS)
def test_word_dot_h2_block_is_the_word_dot(w):
    from k2serve.kernels.int4_gemv import _WORD_DOT_H2_ASM

    rng = np.random.default_rng(w & 0xFFFF)
    x = rng.integers(-64, 64, 8).astype(np.float64) / 8  # exact in f16, exact f16 sums
    regs = {"$1": w & 0xFFFFFFFF}
    for j in range(4):  # a_j = (x_j, x_j+4) as f16x2
        regs[f"${j + 2}"] = _pack(x[j], x[j + 4])
    out = run_ptx(_WORD_DOT_H2_ASM.value, regs)["$0"]
    assert float(out) == float(np.dot(nibbles(w), x))
