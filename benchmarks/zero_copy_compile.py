"""Compile kernels/zero_copy.py's two kernels for sm_90 without a GPU and print their global
loads and stores from the PTX: the staging kernel's stores to host memory, and the result
kernel's loads of the CPU's `out`, which must be volatile (`ld.volatile.global`: never a
cached copy of the last step's `out`; see kernels/zero_copy.py's docstring).

Run (no GPU needed):  PYTHONPATH=/tmp/tri36:src python3 benchmarks/zero_copy_compile.py
(/tmp/tri36: Triton 3.6, the device's version; any Triton with the CUDA backend works).
Exit status 1 when the result kernel's loads of `out` are not volatile.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

STAGE_SIG = {"x_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*fp32", "hx_ptr": "*bf16",
             "hids_ptr": "*i64", "hw_ptr": "*fp32", "D": "i32", "x_stride": "i32",
             "ids_stride": "i32", "w_stride": "i32", "hx_stride": "i32", "hids_stride": "i32",
             "hw_stride": "i32"}  # fmt: skip
ADD_SIG = {"g_ptr": "*bf16", "h_ptr": "*bf16", "o_ptr": "*bf16", "D": "i32", "g_stride": "i32",
           "h_stride": "i32", "o_stride": "i32"}  # fmt: skip


def ptx(fn, sig: dict, cons: dict, arch: int = 90) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # pointers, D and the row strides divisible by 16, as Triton specializes them at a launch
    # with K2's hidden size (7168) and pinned / caching-allocator buffers
    div16 = [(i,) for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n == "D"
             or (n.endswith("stride") and "ids" not in n and n != "w_stride"
                 and n != "hw_stride")]  # fmt: skip
    attrs = {i: [["tt.divisibility", 16]] for i in div16}
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(cons, "constexpr")},
                    constexprs=cons, attrs=attrs)  # fmt: skip
    opts = {"num_warps": 4}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts).asm["ptx"]


def memory_ops(text: str) -> list[str]:
    """The global loads / stores of a PTX text, in order, with their qualifiers."""
    return re.findall(r"\b((?:ld|st)(?:\.\w+)*\.global(?:\.\w+)*)", text)


def main() -> int:
    import triton

    from k2serve.kernels import zero_copy as zc

    print(f"triton {triton.__version__}, target sm_90")
    stage = memory_ops(ptx(zc._stage_kernel, STAGE_SIG, dict(K=8, KP=8, BLOCK=zc.BLOCK)))
    add = memory_ops(ptx(zc._add_kernel, ADD_SIG, dict(BLOCK=zc.BLOCK)))
    print("staging kernel:", " ".join(stage))
    print("result kernel: ", " ".join(add))
    loads = [op for op in add if op.startswith("ld")]
    vol = [op for op in loads if "volatile" in op]
    ok = bool(vol) and 2 * len(vol) == len(loads)  # the same width: half of them (out's)
    print("result kernel: gpu_out plain load, out volatile load:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
