"""Zero-copy staging and result of the hybrid MoE layers (issue 33 item 4): the pinned host
buffers read and written by kernels through their host-mapped addresses instead of memcpy
nodes (kernels.zero_copy), the choice between the two, and the benchmark's CPU stand-in that
writes `out` in place as the real CPU experts do."""

from __future__ import annotations

import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, BENCH)
    try:
        import hybrid_common
    finally:
        sys.path.remove(BENCH)
    return hybrid_common


def test_the_stub_cpu_writes_zeros_into_the_given_out(common):
    """benchmarks' StubCpu: with `out` it zeroes that buffer and returns it (HostJob._collect
    then copies nothing, as with the real kernel); without, a new zero tensor."""
    stub = common.StubCpu(real=None)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    ids, w = torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    out = torch.full((3, 16), float("nan"), dtype=torch.bfloat16)
    stub.submit(x, ids, w, inline=True, out=out)
    got = stub.wait()
    assert got.data_ptr() == out.data_ptr() and not out.any()
    stub.submit(x, ids, w)
    fresh = stub.wait()
    assert fresh.data_ptr() != out.data_ptr()
    assert fresh.shape == x.shape and fresh.dtype == x.dtype and not fresh.any()
