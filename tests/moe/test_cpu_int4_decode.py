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
@pytest.mark.parametrize("T", [1, 2, 5, 9, 17])  # 1..8 tokens per pass of a row block, and more
def test_int4_bf16_decode_loop_matches_same_arithmetic(T):
    experts = _experts("int4", n=NE, seed=T, hidden=HID, inter=INTER)
    be = CpuExpertBackend(experts, range(NE), NE, kernel="native", threads=2, amx=False)
    x = torch.randn(T, HID, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, 3, seed=T, repeat=T > 1, num_experts=NE)
    out = be(x, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == (T, HID)
    ref = _same_arithmetic(experts, x, ids, w, round_h=ck.cpu_has_bf16())
    torch.testing.assert_close(out.float(), ref.bfloat16().float(), rtol=1e-2, atol=1e-3)
    # float32 activations take the float32 path (no bf16 h): the same results to bf16 rounding
    out32 = be(x.float(), ids, w)
    torch.testing.assert_close(out.float(), out32.bfloat16().float(), rtol=2e-2, atol=2e-2)
