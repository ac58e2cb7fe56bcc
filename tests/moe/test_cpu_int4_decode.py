"""The INT4 x bf16 decode loop of the CPU kernel (k2cpu.cpp, dot_rows_i4bf: 128 columns per
64-byte load, one FMA per four groups) at shapes that take it (hidden and intermediate multiples
of 128; the tiny shapes of test_cpu_experts.py take the float32 path), against a float32
reference of the same arithmetic: exact products of the dequantized weights with the bf16
activations, float32 sums, h = silu(gate) * up rounded to bf16 once (as the kernel stores it for
down_proj). Only the summation order differs, so the tolerance is float32-sized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k2serve.kernels import cpu as ck
from k2serve.moe.cpu_experts import CpuExpertBackend

from .test_cpu_experts import _experts, _routing

_lib = ck.load_kernel("auto")
native = pytest.mark.skipif(_lib is None, reason="no C++ compiler")
HID, INTER, NE = 384, 256, 6  # 3 and 2 blocks of 128 columns


def _same_arithmetic(experts, x, ids, w, round_h: bool):
    """float32 reference with the kernel's one rounding (h to bf16 on CPUs with AVX512-BF16,
    where the loop runs; elsewhere the float32 path keeps h in float32); x [T, HID] bf16."""
    out = torch.zeros(x.shape[0], HID)
    xf = x.float()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = experts[int(ids[t, j])]
            g = xf[t] @ e.gate_proj.dequantized_weight(torch.float32).T
            u = xf[t] @ e.up_proj.dequantized_weight(torch.float32).T
            h = F.silu(g) * u
            h = h.bfloat16().float() if round_h else h
            out[t] += w[t, j] * (h @ e.down_proj.dequantized_weight(torch.float32).T)
    return out


@native
# every tokens-per-pass case of a row block (1..8: 5 and 6 were a speculative verify step's cliff
# on the 16-core host), and more than one pass
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_int4_bf16_decode_loop_matches_same_arithmetic(T):
    experts = _experts("int4", n=NE, seed=T, hidden=HID, inter=INTER)
    be = CpuExpertBackend(experts, range(NE), NE, kernel="native", threads=2, amx=False)
    x = torch.randn(T, HID, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, 3, seed=T, repeat=T > 1, num_experts=NE)
    out = be(x, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == (T, HID)
    ref = _same_arithmetic(experts, x, ids, w, round_h=ck.cpu_has_bf16())
    # atol: to the outputs' scale (one h rounded to the other side of a bf16 tie, from a
    # different float32 summation order, moves an output by ~1e-3 of that scale)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref.bfloat16().float(), rtol=1e-2, atol=1e-3 * scale)
    # float32 activations take the float32 path (no bf16 h): the same results to bf16 rounding
    out32 = be(x.float(), ids, w)
    torch.testing.assert_close(out.float(), out32.bfloat16().float(), rtol=2e-2, atol=2e-2)


def _int4_case(T, threads=3, **kw):
    experts = _experts("int4", n=NE, seed=T, hidden=HID, inter=INTER)
    be = CpuExpertBackend(experts, range(NE), NE, kernel="native", threads=threads, amx=False, **kw)
    x = torch.randn(T, HID, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, 3, seed=T, repeat=T > 1, num_experts=NE)
    return be, x, ids, w


@native
@pytest.mark.parametrize("T", [1, 5, 6, 16])
def test_a_late_worker_changes_nothing(T):
    """A pool thread that starts late (its core taken by torch's spinning OpenMP threads or
    another process) skips the step or joins it midway: the result is bit-identical, as every
    output row block sums its experts in the same order whoever computes it."""
    be, x, ids, w = _int4_case(T)
    # two inputs in turn: a step that read h before its gate/up rows were written would read
    # the other input's h (the scratch of the call before)
    steps = [(x, ids, w), (-x, ids.flip(0), w.flip(0))]
    refs = [be(*s) for s in steps]
    lib, pool = be._lib, be._pool._ptr
    try:
        # skips the step / joins it in gate/up or in down (the step takes ~0.1-1 ms here)
        for rank, usec in ((1, 20000), (2, 10), (2, 30), (1, 60), (2, 100), (2, 200), (1, 400)):
            lib.k2_pool_delay(pool, rank, usec)
            for i in range(4):
                assert torch.equal(be(*steps[i % 2]), refs[i % 2])
    finally:
        lib.k2_pool_delay(pool, -1, 0)
    assert torch.equal(be(*steps[0]), refs[0])


@native
@pytest.mark.parametrize("topology", ["0;0;0", "0;0"])
def test_uneven_node_splits_equal_one_node(topology):
    """Three (two) injected nodes split 8 blocks of gate/up rows 2/3/3 (4/4) and 12 blocks of
    output rows unevenly: each expert's down rows wait for the gate/up blocks of every node."""
    for T in (1, 5, 16):
        one, x, ids, w = _int4_case(T, threads=3, numa_topology="0")
        split, *_ = _int4_case(T, threads=3, numa_topology=topology)
        assert torch.equal(one(x, ids, w), split(x, ids, w))


@native
@pytest.mark.parametrize("T", [1, 6])
def test_the_kernel_writes_bf16_and_into_a_given_tensor(T):
    """bf16 activations: the kernel returns bf16, its float32 sums rounded to nearest even
    (what torch's conversion of the float32 result gives, bit for bit); `out=` is written in
    place (no copy on torch's threads), in bf16 or float32."""
    be, x, ids, w = _int4_case(T)
    f32 = torch.empty(T, HID)
    assert be._run_native(x, ids, w, f32) is f32  # the kernel's float32 sums
    out = be(x, ids, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, f32.bfloat16())
    given = torch.full((T, HID), 7.0, dtype=torch.bfloat16)
    be.submit(x, ids, w, inline=True, out=given)
    assert be.wait() is given and torch.equal(given, out)
    # a tensor the kernel cannot write (strided): filled by a copy, the same values
    strided = torch.empty(HID, T, dtype=torch.bfloat16).T
    be.submit(x, ids, w, inline=True, out=strided)
    assert be.wait() is strided and torch.equal(strided, out)
    # tokens routed to no expert of this backend: zero rows, in either dtype
    none = CpuExpertBackend(be.experts[:2], [0, 1], NE, kernel="native", threads=3, amx=False)
    far = torch.full_like(ids, NE - 1)
    assert torch.equal(none(x, far, w), torch.zeros(T, HID, dtype=torch.bfloat16))


@native
def test_prewake_changes_nothing_and_runs_beside_a_call():
    """prewake (the engine calls it once a step's routing is known) only wakes the pool's
    threads: results are unchanged, and it takes no lock, so it may come while another
    thread's call runs."""
    be, x, ids, w = _int4_case(6)
    ref = be(x, ids, w)
    be.prewake(5000)
    assert torch.equal(be(x, ids, w), ref)
    be.submit(x, ids, w)  # on the backend's worker thread
    for _ in range(20):
        be.prewake(100)
    assert torch.equal(be.wait(), ref)
    torch_be = CpuExpertBackend(be.experts, range(NE), NE, kernel="torch")
    torch_be.prewake()  # no kernel: nothing to wake
