"""Every way a hybrid decode graph waits for the CPU experts keeps its output when the CPU part
comes late (a slow or busy host): the CPU part's `out` is filled with NaN and the experts start
after a sleep, so a device that read `out` before the CPU wrote it would put NaN in the
output (the step before's `out`, the same values for the same step, would not show). On the
CPU fakes (host wait, device wait, one graph) and on CUDA (those and the spin-kernel wait)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from k2serve import envs
from k2serve.model.cuda_graph import DecodeGraphRunner

from .conftest import needs_cuda
from .fake_graphs import StreamTapeGraphFactory, TapeGraphFactory
from .test_hybrid_timeline import WordFactory
from .test_piecewise_graphs import (
    PAGES,
    _caches,
    _cuda_decode_md,
    _cuda_runner,
    _decode_md,
    _model,
)


@contextlib.contextmanager
def late_cpu(model, seconds: float):
    """Each hybrid layer's CPU part: `out` <- NaN when it is submitted, and its experts
    computed `seconds` late (on whichever thread computes them: the caller's, or the CPU
    backend's worker thread on a CPU device, where the host wait submits ahead)."""
    saved = []
    for i in model.config.moe_layers:
        cpu = model.model.layers[i].mlp.expert_backend.cpu_backend
        saved.append(cpu)

        def poison(*a, _submit=cpu.submit, **k):
            if k.get("out") is not None:
                k["out"].fill_(float("nan"))
            return _submit(*a, **k)

        def late(fn):
            return lambda *a, **k: (time.sleep(seconds), fn(*a, **k))[1]

        cpu.submit = poison
        cpu._run_native, cpu._run_torch = late(cpu._run_native), late(cpu._run_torch)
    try:
        yield
    finally:
        for cpu in saved:
            for name in ("submit", "_run_native", "_run_torch"):
                del cpu.__dict__[name]  # the class's methods again


# (factory, device_wait, one_graph): the ways of waiting on the fakes
FAKE_WAYS = {
    "host wait": (TapeGraphFactory, False, False),
    "device wait": (StreamTapeGraphFactory, True, False),
    "one graph": (WordFactory, True, True),
}


@pytest.mark.parametrize("way", list(FAKE_WAYS))
def test_a_late_cpu_part_is_waited_for(way):
    make, device_wait, one_graph = FAKE_WAYS[way]
    factory = make()
    model = _model(4)
    runner = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                               graph_factory=factory, device_wait=device_wait,
                               one_graph=one_graph)  # fmt: skip
    runner.capture()
    assert runner.num_pieces[4] == {"host wait": 5, "device wait": 3, "one graph": 1}[way]
    ids = torch.randint(0, 500, (3,), generator=torch.Generator().manual_seed(1))
    pos, md = _decode_md([3, 6, 9])
    out = runner.run(ids, pos, md)
    factory.synchronize()
    want = out.clone()
    with late_cpu(model, 0.02):
        for _ in range(2):
            runner.run(ids, pos, md)
            factory.synchronize()
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, want, rtol=0, atol=0)


# (device_wait, one_graph, spin_wait): the ways of waiting on CUDA
CUDA_WAYS = {
    "host wait": (False, False, False),
    "device wait": (True, False, False),
    "one graph": (True, True, False),
    "one graph, spin kernel": (True, True, True),
}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("zero_copy", [True, False])
@pytest.mark.parametrize("way", list(CUDA_WAYS))
def test_cuda_a_late_cpu_part_is_waited_for(way, zero_copy):
    """bf16 on CUDA: with every CPU part 20 ms late and its `out` NaN until then, each way's
    replays give the output they give on time (1e-3: kernels that add in any order); with
    zero-copy (the result kernel reads `out` in host memory right after the wait: a load
    before the wait passed, or a cached one, would show the NaN; in the one-graph ways the
    result kernel is the wait itself, fused) and with the memcpys."""
    device_wait, one_graph, spin_wait = CUDA_WAYS[way]
    model, runner = _cuda_runner(device_wait=device_wait, one_graph=one_graph,
                                 spin_wait=spin_wait, zero_copy=zero_copy)  # fmt: skip
    hybrid = [model.model.layers[i].mlp.expert_backend for i in model.config.moe_layers]
    assert [be.zero_copy for be in hybrid] == [zero_copy] * len(hybrid)
    # one graph with zero-copy: the fused waits by default (kernels.zero_copy "Fused waits")
    assert runner.fused_waits == (zero_copy and one_graph and envs.hybrid_fused_wait())
    ids = torch.randint(0, 500, (3,), device="cuda")
    pos, md = _cuda_decode_md([3, 6, 9])
    want = runner.run(ids, pos, md).clone()
    with late_cpu(model, 0.02):
        for _ in range(2):
            got = runner.run(ids, pos, md).clone()
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
