"""Hybrid GPU + CPU experts: the CPU part submitted and waited for around the GPU part
(KT-Kernel's submit_forward / sync_forward), every placement giving the same outputs."""

from __future__ import annotations

import torch

from k2serve.moe import make_placement

from .conftest import load_tiny


def _ids(n=21, seed=0):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed))


def test_cpu_backend_submit_then_wait_equals_the_direct_call():
    model = load_tiny("int4", expert_placement=make_placement(load_tiny("int4").config, 3))
    be = model.model.layers[1].mlp.expert_backend.cpu_backend
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 128, generator=g)
    ids = torch.randint(0, 8, (9, 2), generator=g)
    w = torch.rand(9, 2, generator=g)
    be.submit(x, ids, w)
    got = be.wait()
    torch.testing.assert_close(got, be(x, ids, w), rtol=0, atol=0)
