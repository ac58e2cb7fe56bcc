"""A CPU decode step's logits on the kernel's calling thread (kernels/cpu/logits.py,
k2logits.h): the bf16 -> float32 widening and the greedy argmax give torch's results exactly
(every bf16 bit pattern; ties, NaN, -0 / +0, -inf rows, rows not a multiple of the vector)."""

from __future__ import annotations

import pytest
import torch

from k2serve.kernels import cpu as ck
from k2serve.kernels.cpu.logits import cpu_argmax, cpu_float32

native = pytest.mark.skipif(ck.load_kernel("auto") is None, reason="no C++ compiler")


@native
def test_widening_equals_to_float32_for_every_bf16():
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every.reshape(2, -1)  # [2, 32768]: NaNs, infs, subnormals, -0
    got = cpu_float32(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.view(torch.int32), x.to(torch.float32).view(torch.int32))
    odd = torch.randn(1, 163840 + 7).bfloat16()  # a tail past the last 16
    assert torch.equal(cpu_float32(odd), odd.float())


def _rows(kind: str, V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(2, V, generator=g)
    if kind == "ties":
        x = (x * 2).round()  # the max repeated
    elif kind == "nan":
        x[0, V // 3] = float("nan")
        x[0, V // 2] = float("nan")
        x[1, -1] = float("nan")
    elif kind == "zeros":  # -0 and +0 are one value: the first of them
        x = torch.full((2, V), -1.0)
        x[0, 5], x[0, 9] = -0.0, 0.0
        x[1, 3], x[1, 4] = 0.0, -0.0
    elif kind == "neginf":
        x = torch.full((2, V), float("-inf"))
        x[1, V - 1] = -1e38
    elif kind == "inf":
        x[0, 7] = float("inf")
        x[0, 3] = float("inf")
    return x


@native
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "zeros", "neginf", "inf"])
@pytest.mark.parametrize("V", [1, 15, 16, 37, 163840])
@pytest.mark.parametrize("rows", [1, 2])
def test_argmax_equals_torch(kind, V, rows):
    if V < 10 and kind in ("zeros", "inf", "nan"):
        pytest.skip("the case needs more columns")
    x = _rows(kind, V, torch.Generator().manual_seed(V))[:rows].contiguous()
    got = cpu_argmax(x)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@native
def test_outside_decode_rows_the_torch_ops_stay():
    x = torch.randn(ck.LINEAR_MAX_ROWS + 1, 64)
    assert cpu_argmax(x) is None and cpu_argmax(x.bfloat16()) is None
    assert cpu_argmax(x[:1, ::2]) is None  # not contiguous
    y = x.bfloat16()
    assert torch.equal(cpu_float32(y), y.float())  # .to() there
