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


def test_the_cpu_part_runs_while_the_gpu_part_and_the_shared_expert_run():
    """Order within a hybrid MoE layer: submit the CPU experts, then the GPU experts and the
    shared expert, then wait (KT's submit_forward / sync_forward)."""
    model = load_tiny("int4", expert_placement=make_placement(load_tiny("int4").config, 4))
    moe = model.model.layers[1].mlp
    be = moe.expert_backend
    seen = []
    for obj, name in ((be.cpu_backend, "submit"), (be.cpu_backend, "wait"), (be, "gpu_part")):
        fn = getattr(obj, name)
        setattr(obj, name, lambda *a, _fn=fn, _n=name, **k: (seen.append(_n), _fn(*a, **k))[1])
    shared = moe.shared_experts.forward
    moe.shared_experts.forward = lambda x: (seen.append("shared"), shared(x))[1]
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(3))
    moe(x)
    assert seen == ["submit", "gpu_part", "shared", "wait"]
