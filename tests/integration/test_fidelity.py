"""The fidelity harness (k2serve.testing.fidelity): pinned routing, per-layer comparison, the
router's own check. CPU tests use the torch backends and the CPU/hybrid expert path; the fused
GPU paths run in the `gpu`-marked tests at the end."""

from __future__ import annotations

import pytest
import torch

from k2serve.kernels.router_torch import grouped_topk_torch
from k2serve.model.backends import setup_backends
from k2serve.moe import make_placement
from k2serve.testing.fidelity import (
    RoutingPin,
    Variant,
    check_model,
    check_router_topk,
    decode_batch,
    gpu_variants,
    prefix_prefill_batch,
    reference_setup,
    run_pass,
)

from .conftest import load_tiny, needs_cuda

_ref = reference_setup


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_replay_pins_the_routing_of_another_pass():
    model = load_tiny("bf16", dtype=torch.bfloat16)
    _ref(model)
    batch = decode_batch(4, 20)
    from k2serve.testing.fidelity import random_kv_caches

    kv = random_kv_caches(model.config, batch.num_pages, batch.page_size, torch.bfloat16, "cpu")
    pin = RoutingPin(model)
    run_pass(model, batch, kv, pin, record=True)
    # forge a recording: reversed expert ids; the replayed pass must use them
    forged = {i: [(w, (model.config.n_routed_experts - 1) - ids) for w, ids in calls]
              for i, calls in pin.recorded.items()}  # fmt: skip
    pin.recorded = forged
    seen = {}

    def spy(i):
        be = model.model.layers[i].mlp.expert_backend

        def fn(h, ids, w):
            seen[i] = ids.clone()
            return be(h, ids, w)

        return fn

    for i in pin.routers:
        model.model.layers[i].mlp.expert_backend = spy(i)
    run_pass(model, batch, kv, pin)
    for i, calls in forged.items():
        assert torch.equal(seen[i], calls[0][1])


@pytest.mark.parametrize("fmt", ["bf16", "int4", "fp8"])
def test_hybrid_experts_within_bf16_rounding_with_pinned_routing(fmt):
    model = load_tiny(fmt, dtype=torch.bfloat16)
    split = make_placement(model.config, 3)
    variants = [
        Variant(
            "hybrid 3/8 on the GPU side",
            lambda m: setup_backends(m, "torch", "torch", "torch", placement=split),
        )
    ]
    res = check_model(
        model,
        variants,
        [decode_batch(1, 40), decode_batch(8, 40), prefix_prefill_batch()],
        reference=_ref,
        log=lambda s: None,
    )
    assert all(r.ok for r in res), [r.line() for r in res]


@pytest.mark.parametrize("bug", ["ids", "scale"])
def test_a_wrong_kernel_fails(bug):
    """The check can fail: an expert-id bug or a 5% scale error in one layer's experts."""
    model = load_tiny("bf16", dtype=torch.bfloat16)

    def broken(m):
        _ref(m)
        be = m.model.layers[2].mlp.expert_backend
        if bug == "ids":
            m.model.layers[2].mlp.expert_backend = lambda h, i, w: be(h, (i + 1) % 8, w)
        else:
            m.model.layers[2].mlp.expert_backend = lambda h, i, w: be(h, i, w) * 1.05

    (res,) = check_model(model, [Variant("broken", broken)], [decode_batch(8, 40)],
                         reference=_ref, log=lambda s: None)  # fmt: skip
    assert not res.ok
    assert res.worst[0] == "layer 2"  # the harness names the layer where it enters


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("groups", [(1, 1), (8, 4)])
def test_router_topk_against_float64(ties, groups):
    ok, why = check_router_topk(grouped_topk_torch, 64, 64, 8, *groups, "cpu", ties=ties)
    assert ok, why


def test_router_check_catches_a_wrong_topk():
    def wrong(logits, bias, k, ng, tg, renorm, scale):
        w, ids = grouped_topk_torch(logits, bias, k + 1, ng, tg, renorm, scale)
        return w[:, 1:], ids[:, 1:]  # drops one of the best experts

    ok, why = check_router_topk(wrong, 32, 64, 8, 1, 1, "cpu")
    assert not ok and "top-k" in why


@pytest.mark.parametrize("ties", [False, True])
def test_fused_router_kernel_against_float64(ties):
    """The Triton router top-k (Triton's interpreter on the CPU; CUDA when present)."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CUDA or under TRITON_INTERPRET=1")
    from k2serve.kernels.router import fused_grouped_topk

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for E, k, ng, tg in ((384, 8, 1, 1), (256, 8, 8, 4), (64, 6, 1, 1)):
        ok, why = check_router_topk(fused_grouped_topk, 33, E, k, ng, tg, dev, ties=ties)
        assert ok, (E, k, ng, tg, why)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["bf16", "int4", "fp8"])
def test_fused_gpu_paths_within_bf16_rounding(fmt):
    model = load_tiny(fmt, dtype=torch.bfloat16, device="cuda")
    batches = [decode_batch(1, 40), decode_batch(8, 40), decode_batch(128, 40),
               prefix_prefill_batch()]  # fmt: skip
    res = check_model(model, gpu_variants(model), batches, reference=_ref)
    assert all(r.ok for r in res), [r.line() for r in res if not r.ok]
