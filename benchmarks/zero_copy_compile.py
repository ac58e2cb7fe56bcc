"""Compile kernels/zero_copy.py's two kernels for sm_90 without a GPU and print their global
loads and stores from the PTX: the staging kernel's stores to host memory, and the result
kernel's loads of the CPU's `out`, which must be volatile (`ld.volatile.global`: never a
cached copy of the last step's `out`; see kernels/zero_copy.py's docstring). Then their fused
variants (the docstring's "Fused waits"), checked in order: the staging kernel's data stores,
fence.sc.sys, bar.sync, the counter's atom.acq_rel, the flag's clear (st.relaxed.sys),
fence.sc.sys, bar.sync, the word (st.relaxed.sys) last; the result kernel's volatile loads of
the flag, then fence.acq_rel.sys, then the volatile loads of `out`.

Run (no GPU needed):  PYTHONPATH=/tmp/tri36:src python3 benchmarks/zero_copy_compile.py
(/tmp/tri36: Triton 3.6, the device's version; any Triton with the CUDA backend works).
Exit status 1 when the result kernel's loads of `out` are not volatile or a fused
variant's order is not the above.
"""

from __future__ import annotations

import os
import re
import sys

STAGE_SIG = {"x_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*fp32", "hx_ptr": "*bf16",
             "hids_ptr": "*i64", "hw_ptr": "*fp32", "D": "i32", "x_stride": "i32",
             "ids_stride": "i32", "w_stride": "i32", "hx_stride": "i32", "hids_stride": "i32",
             "hw_stride": "i32"}  # fmt: skip
ADD_SIG = {"g_ptr": "*bf16", "h_ptr": "*bf16", "o_ptr": "*bf16", "D": "i32", "g_stride": "i32",
           "h_stride": "i32", "o_stride": "i32"}  # fmt: skip
I32P = {"word_ptr": "*i32", "flag_ptr": "*i32", "count_ptr": "*i32"}
STAGE_SIG_F = {**STAGE_SIG, **I32P}
ADD_SIG_F = {**ADD_SIG, "flag_ptr": "*i32"}


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


def ordering_ops(text: str) -> list[str]:
    """The global loads / stores / atomics, fences and CTA barriers of a PTX text, in order."""
    pat = r"\b((?:ld|st|atom)(?:\.\w+)*\.global(?:\.\w+)*|fence\.\w+\.\w+|bar\.sync)"
    return re.findall(pat, text)


def fused_stage_ok(ops: list[str]) -> bool:
    """Data stores, then fence.sc.sys, bar.sync, the atomic; after it the flag's clear,
    fence.sc.sys, bar.sync and the word's store, the last global store."""
    try:
        atom = next(i for i, o in enumerate(ops) if o.startswith("atom") and "acq_rel" in o)
    except StopIteration:
        return False
    data = [i for i, o in enumerate(ops[:atom]) if o.startswith("st.global")]
    head = [o for o in ops[data[-1] + 1 : atom] if not o.startswith("ld")] if data else []
    clear = next((i for i in range(atom, len(ops)) if ops[i].startswith("st.relaxed")), len(ops))
    tail = [o for o in ops[clear:] if o.startswith(("st.relaxed", "fence", "bar"))]
    fenced = head[:1] == ["fence.sc.sys"] and head[1:] and set(head[1:]) == {"bar.sync"}
    return bool(fenced) and tail == [
        "st.relaxed.sys.global.b32", "fence.sc.sys", "bar.sync", "st.relaxed.sys.global.b32"
    ] and ops[-1] == "st.relaxed.sys.global.b32"  # fmt: skip


def fused_add_ok(ops: list[str]) -> bool:
    """The flag's volatile loads, then fence.acq_rel.sys, then `out`'s volatile loads."""
    if "fence.acq_rel.sys" not in ops:
        return False
    f = ops.index("fence.acq_rel.sys")
    flag = [o for o in ops[:f] if o == "ld.volatile.global.b32"]
    out = [o for o in ops[f:] if o.startswith("ld.volatile") and o != "ld.volatile.global.b32"]
    early = [o for o in ops[:f] if o.startswith("ld.volatile") and o not in flag]
    return bool(flag) and bool(out) and not early


def main() -> int:
    import triton

    from k2serve.kernels import zero_copy as zc

    print(f"triton {triton.__version__}, target sm_90")
    plain = dict(K=8, KP=8, BLOCK=zc.BLOCK, WORD=False, CLEAR=False)
    stage = memory_ops(ptx(zc._stage_kernel, STAGE_SIG_F, plain))
    add = memory_ops(ptx(zc._add_kernel, ADD_SIG_F, dict(BLOCK=zc.BLOCK, WAIT=False)))
    print("staging kernel:", " ".join(stage))
    print("result kernel: ", " ".join(add))
    loads = [op for op in add if op.startswith("ld")]
    vol = [op for op in loads if "volatile" in op]
    ok = bool(vol) and 2 * len(vol) == len(loads)  # the same width: half of them (out's)
    print("result kernel: gpu_out plain load, out volatile load:", "ok" if ok else "FAIL")
    # the fused waits: the word (and the flag's clear) after fenced data; a spin before `out`
    stage_f = ordering_ops(ptx(zc._stage_kernel, STAGE_SIG_F, dict(
        K=8, KP=8, BLOCK=zc.BLOCK, WORD=True, CLEAR=True)))  # fmt: skip
    add_f = ordering_ops(ptx(zc._add_kernel, ADD_SIG_F, dict(BLOCK=zc.BLOCK, WAIT=True)))
    print("fused staging kernel:", " ".join(stage_f))
    print("fused result kernel: ", " ".join(add_f))
    ok_s, ok_a = fused_stage_ok(stage_f), fused_add_ok(add_f)
    print("fused staging kernel: data, fence.sc.sys, bar.sync, atom, flag, fence, bar, word:",
          "ok" if ok_s else "FAIL")  # fmt: skip
    print("fused result kernel: flag spin, fence.acq_rel.sys, then out:", "ok" if ok_a else "FAIL")
    return 0 if ok and ok_s and ok_a else 1


if __name__ == "__main__":
    # compiled, not interpreted; only when run as a script: a test that imports this module
    # for its order checks must not take the interpreter away from the rest of its session
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
