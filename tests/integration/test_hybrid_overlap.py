"""Hybrid GPU + CPU experts: the CPU part submitted and waited for around the GPU part
(KT-Kernel's submit_forward / sync_forward), every placement giving the same outputs."""

from __future__ import annotations

import pytest
import torch

from k2serve.model.backends import setup_backends
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


def test_swap_keeps_each_expert_its_weights_and_the_logits():
    from k2serve.moe.dynamic import replace_layer

    ref_model = load_tiny("int4")
    model = load_tiny("int4", expert_placement=make_placement(ref_model.config, 3))
    ids = torch.randint(0, 500, (19,), generator=torch.Generator().manual_seed(1))
    ref = model.compute_logits(model(ids, torch.arange(19)))
    moe = model.model.layers[2].mlp
    swaps = replace_layer(moe, torch.tensor([0, 0, 0, 1, 0, 5, 9, 2.0]))  # want 5, 6, 7
    assert swaps == 3 and sorted(moe.expert_backend.gpu_expert_ids) == [5, 6, 7]
    assert sorted(moe.expert_backend.cpu_backend.expert_ids) == [0, 1, 2, 3, 4]
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    for name, t in ref_sd.items():  # experts[e] holds expert e wherever it lives
        torch.testing.assert_close(sd[name], t, rtol=0, atol=0)
    got = model.compute_logits(model(ids, torch.arange(19)))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_gpu", [3, 0])
def test_layerwise_prefill_streams_the_cpu_experts_and_keeps_the_logits(n_gpu):
    """Above the threshold each hybrid layer's CPU experts are copied into the double buffer
    (here the "GPU" is the CPU) and run by the GPU backend's math: same logits; below it the
    CPU backend computes them."""
    from k2serve.moe.layerwise import setup_layerwise_prefill

    ref_model = load_tiny("int4")
    model = load_tiny("int4", expert_placement=make_placement(ref_model.config, n_gpu))
    lw = setup_layerwise_prefill(model, 16)
    assert lw is not None and len(lw.backends) == 2
    cpu = model.model.layers[1].mlp.expert_backend.cpu_backend
    calls = []
    submit = cpu.submit
    cpu.submit = lambda *a, **k: (calls.append(a[0].shape[0]), submit(*a, **k))[1]
    runs = []
    run = lw.run
    lw.run = lambda i, x, *a: (runs.append((i, x.shape[0])), run(i, x, *a))[1]
    for n, streamed in ((24, True), (9, False), (40, True)):
        ids = _ids(n, seed=n)
        ref = ref_model.compute_logits(ref_model(ids, torch.arange(n)))
        del runs[:]
        got = model.compute_logits(model(ids, torch.arange(n)))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert runs == ([(0, n), (1, n)] if streamed else [])
        assert (calls[-1:] == [n]) != streamed
    # two hybrid layers, two slots: both stay loaded, the second long step copied nothing
    assert lw.loaded == [0, 1] and lw.copies == 2


def test_layerwise_prefill_is_off_by_default_on_a_cpu_device_and_with_0():
    from k2serve.moe.layerwise import setup_layerwise_prefill

    model = load_tiny("int4", expert_placement=make_placement(load_tiny("int4").config, 3))
    assert setup_layerwise_prefill(model, None) is None
    assert setup_layerwise_prefill(model, 0) is None


def test_layerwise_prefill_set_up_again_keeps_its_stacks():
    from k2serve.moe.layerwise import setup_layerwise_prefill

    model = load_tiny("int4", expert_placement=make_placement(load_tiny("int4").config, 3))
    lw = setup_layerwise_prefill(model, 16)
    assert setup_layerwise_prefill(model, 32) is lw and lw.threshold == 32
    assert setup_layerwise_prefill(model, 0) is None and not lw.use_for(10**6)


def test_a_used_hybrid_model_deep_copies():
    import copy

    model = load_tiny("int4", expert_placement=make_placement(load_tiny("int4").config, 3))
    ids = _ids(5)
    ref = model(ids, torch.arange(5))  # the CPU backends' workers exist now
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(ids, torch.arange(5)), ref, rtol=0, atol=0)


def test_layerwise_prefill_follows_rebuilt_backends():
    from k2serve.moe.layerwise import setup_layerwise_prefill

    p = make_placement(load_tiny("int4").config, 3)
    model = load_tiny("int4", expert_placement=p)
    old = setup_layerwise_prefill(model, 16)
    setup_backends(model, "torch", "torch", "torch", placement=p)  # new hybrid backends
    new = setup_layerwise_prefill(model, 16)
    assert new is not old and old.threshold == 0 and model.layerwise_prefill is new
    assert all(be.layerwise is new for be in new.backends)
    ids = _ids(20, seed=4)
    ref = load_tiny("int4")
    torch.testing.assert_close(
        model.compute_logits(model(ids, torch.arange(20))),
        ref.compute_logits(ref(ids, torch.arange(20))),
        rtol=1e-5,
        atol=1e-5,
    )


def test_double_buffer_bytes_is_what_the_slots_take():
    from k2serve.moe.layerwise import double_buffer_bytes, setup_layerwise_prefill

    p = make_placement(load_tiny("int4").config, 3)
    model = load_tiny("int4", expert_placement=p)
    want = double_buffer_bytes(model, p)
    lw = setup_layerwise_prefill(model, 16)
    assert 2 * lw.slot_bytes <= want <= 2.01 * lw.slot_bytes  # + the int32 shape tensors
    assert double_buffer_bytes(model, make_placement(model.config)) == 0


@pytest.mark.parametrize("layers", [4, 5])  # 3 and 4 MoE layers: odd and even slot cycles
def test_layerwise_prefill_with_more_layers_than_slots(layers):
    from k2serve.moe.layerwise import setup_layerwise_prefill
    from k2serve.weights.loader import load_model

    from .conftest import tiny_config

    cfg = tiny_config("int4", num_hidden_layers=layers)
    kw = dict(dtype=torch.float32, device="cpu", load_format="dummy", config=cfg, seed=2,
              progress=False)  # fmt: skip
    ref = load_model(None, **kw)
    model = load_model(None, expert_placement=make_placement(cfg, 2), **kw)
    lw = setup_layerwise_prefill(model, 8)
    for n in (12, 30, 9, 17):  # repeated steps: slots reused across steps
        ids = _ids(n, seed=n)
        torch.testing.assert_close(
            model.compute_logits(model(ids, torch.arange(n))),
            ref.compute_logits(ref(ids, torch.arange(n))),
            rtol=1e-5,
            atol=1e-5,
        )
    assert lw.copies >= 3 * (layers - 1)


def test_without_cuda_the_device_wait_is_refused_and_graphs_wait_on_the_host():
    """No CUDA: the probe says no (it does not raise), so a runner keeps the host wait."""
    from k2serve.kernels.stream_wait import cuda_host_signal_supported

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the gpu tests cover the probe")
    assert cuda_host_signal_supported(0) is False
