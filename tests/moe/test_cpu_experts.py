"""CpuExpertBackend (native kernel and torch fallback) against the torch reference backend.

Tiny shapes (hidden 128, intermediate 64: multiples of 32 as the kernel needs; FP8 blocks of
128x128 cover partial blocks), INT4 / FP8 / bf16 / float32 experts, T = 1, 3, 17, ids that
repeat within a token row, all / some / no tokens on CPU experts, an injected 2-node topology.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from k2serve.kernels import cpu as ck
from k2serve.moe.cpu_experts import CpuExpertBackend
from k2serve.moe.hybrid import HybridExpertBackend
from k2serve.moe.torch_ref import TorchExpertBackend
from k2serve.quant.fp8 import quantize_fp8_block
from k2serve.quant.int4 import quantize_int4
from k2serve.quant.linear import Fp8BlockLinear, Int4GroupLinear, UnquantizedLinear

H, INTER, E = 128, 64, 8

native = pytest.mark.skipif(ck.load_kernel("auto") is None, reason="no C++ compiler")


def _linear(fmt: str, out_f: int, in_f: int, g: torch.Generator) -> nn.Module:
    w = torch.randn(out_f, in_f, generator=g) * in_f**-0.5
    if fmt == "int4":
        lin = Int4GroupLinear(in_f, out_f, 32)
        packed, scale, shape = quantize_int4(w, 32)
        lin.weight_packed.data.copy_(packed)
        lin.weight_scale.data.copy_(scale)
        lin.weight_shape.data.copy_(shape)
    elif fmt == "fp8":
        lin = Fp8BlockLinear(in_f, out_f, (128, 128))
        q, s = quantize_fp8_block(w, (128, 128))
        lin.weight.data.copy_(q)
        lin.weight_scale_inv.data.copy_(s)
    else:
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        lin = UnquantizedLinear(in_f, out_f, dtype)
        lin.weight.data.copy_(w)
    return lin


class _Expert(nn.Module):
    def __init__(self, fmt: str, g: torch.Generator, hidden=H, inter=INTER) -> None:
        super().__init__()
        self.gate_proj = _linear(fmt, inter, hidden, g)
        self.up_proj = _linear(fmt, inter, hidden, g)
        self.down_proj = _linear(fmt, hidden, inter, g)


def _experts(fmt: str, n=E, seed=0, **kw) -> nn.ModuleList:
    g = torch.Generator().manual_seed(seed)
    return nn.ModuleList(_Expert(fmt, g, **kw) for _ in range(n))


def _routing(T: int, k: int, seed: int, repeat: bool = False, num_experts=E):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(T)])
    if repeat and T > 0:
        ids[:, -1] = ids[:, 0]  # the same expert twice in one token row
    w = torch.rand(T, k, generator=g) + 0.1
    return ids.long(), w.float()


def _reference(experts, hidden, ids, w):
    x = hidden.float()
    return TorchExpertBackend(experts)(x, ids, w)


def _tol(fmt, dtype):
    return 2e-2 if dtype == torch.bfloat16 else 1e-4


@native
@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16", "f32"])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_matches_reference(fmt, T, dtype):
    experts = _experts(fmt)
    be = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2)
    assert be.impl == "native"
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
    ids, w = _routing(T, 4, seed=T, repeat=T > 1)
    out = be(hidden, ids, w)
    assert out.dtype == dtype and out.shape == (T, H)
    ref = _reference(experts, hidden, ids, w)
    tol = _tol(fmt, dtype)
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@native
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_subset_of_experts_on_cpu(fmt):
    """Some tokens hit CPU experts, some none: only the CPU experts' pairs are computed."""
    experts = _experts(fmt, seed=1)
    cpu_ids = [1, 4, 5, 7]
    be = CpuExpertBackend([experts[e] for e in cpu_ids], cpu_ids, E, kernel="native", threads=2)
    T = 9
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    ids, w = _routing(T, 2, seed=3)
    ids[0] = torch.tensor([0, 2])  # token 0 has no CPU expert
    on_cpu = torch.isin(ids, torch.tensor(cpu_ids))
    ref = _reference(experts, hidden, ids, torch.where(on_cpu, w, torch.zeros_like(w)))
    out = be(hidden, ids, w)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert out[0].abs().max() == 0


@native
def test_no_token_hits_a_cpu_expert():
    experts = _experts("int4", seed=2)
    be = CpuExpertBackend([experts[6], experts[7]], [6, 7], E, kernel="native", threads=2)
    hidden = torch.randn(5, H)
    ids = torch.tensor([[0, 1]] * 5)
    out = be(hidden, ids, torch.ones(5, 2))
    assert out.shape == (5, H) and out.abs().max() == 0


@native
@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16"])
def test_injected_two_node_topology_equals_one_node(fmt):
    experts = _experts(fmt, seed=4)
    one = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2, numa_topology="0")
    two = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2,
                           numa_topology="0;0")  # fmt: skip
    three = CpuExpertBackend(experts, range(E), E, kernel="native", threads=3,
                             numa_topology="0;0;0")  # fmt: skip
    assert two._pool.num_nodes == 2 and three._pool.num_nodes == 3
    for T in (1, 6):
        hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
        ids, w = _routing(T, 4, seed=T + 10)
        a, b, c = one(hidden, ids, w), two(hidden, ids, w), three(hidden, ids, w)
        assert torch.equal(a, b) and torch.equal(a, c)  # each row computed the same way


def test_torch_fallback_matches_reference():
    experts = _experts("int4", seed=5)
    be = CpuExpertBackend(experts, range(E), E, kernel="torch")
    assert be.impl == "torch"
    hidden = torch.randn(3, H)
    ids, w = _routing(3, 4, seed=5, repeat=True)
    torch.testing.assert_close(be(hidden, ids, w), _reference(experts, hidden, ids, w))


def test_no_compiler_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / c++ / clang++ to be found
    monkeypatch.setenv("K2SERVE_CACHE_DIR", str(tmp_path / "cache"))
    ck._load.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            be = CpuExpertBackend(_experts("int4"), range(E), E, kernel="auto")
            CpuExpertBackend(_experts("int4"), range(E), E, kernel="auto")
        assert be.impl == "torch"
        msg = "native CPU expert kernel unavailable"
        warnings = [r for r in caplog.records if msg in r.message]
        assert len(warnings) == 1
        with pytest.raises(ck.KernelBuildError, match="no C\\+\\+ compiler"):
            CpuExpertBackend(_experts("int4"), range(E), E, kernel="native")
        hidden = torch.randn(2, H)
        ids, w = _routing(2, 2, seed=6)
        experts = be.experts
        torch.testing.assert_close(be(hidden, ids, w), _reference(experts, hidden, ids, w))
    finally:
        ck._load.cache_clear()


@native
def test_shapes_the_kernel_cannot_read_use_the_torch_path():
    experts = _experts("bf16", n=2, hidden=48, inter=40)  # not multiples of 32
    be = CpuExpertBackend(experts, [0, 1], 2, kernel="auto")
    assert be.impl == "torch"
    with pytest.raises(ValueError, match="does not read"):
        CpuExpertBackend(experts, [0, 1], 2, kernel="native")


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_out_of_range_expert_id_is_a_clear_error(kernel):
    if kernel == "native" and ck.load_kernel("auto") is None:
        pytest.skip("no C++ compiler")
    be = CpuExpertBackend(_experts("int4"), range(E), E, kernel=kernel, threads=2)
    ids = torch.tensor([[0, E]])  # E is outside [0, E)
    with pytest.raises(ValueError, match="outside"):
        be(torch.randn(1, H), ids, torch.ones(1, 2))
    # the backend is usable afterwards
    assert be(torch.randn(1, H), torch.tensor([[0, 1]]), torch.ones(1, 2)).shape == (1, H)


@native
def test_submit_runs_without_the_gil_and_wait_returns_the_result():
    experts = _experts("int4", seed=7)
    be = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2)
    hidden = torch.randn(4, H)
    ids, w = _routing(4, 4, seed=7)
    be.submit(hidden, ids, w)
    # the main thread is free meanwhile (a Python thread can run while the kernel works)
    done = []
    t = threading.Thread(target=lambda: done.append(sum(range(1000))))
    t.start()
    t.join()
    out = be.wait()
    assert done and out.shape == (4, H)
    torch.testing.assert_close(out, _reference(experts, hidden, ids, w), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="nothing was submitted"):
        be.wait()
    be.submit(hidden, ids, w)
    with pytest.raises(RuntimeError, match="not waited"):
        be.submit(hidden, ids, w)
    be.wait()


def test_hybrid_sums_gpu_and_cpu_parts():
    experts = _experts("int4", seed=8)
    cpu_ids, gpu_ids = [0, 3, 6], [1, 2, 4, 5, 7]
    cpu = CpuExpertBackend([experts[e] for e in cpu_ids], cpu_ids, E, threads=2)
    gpu = TorchExpertBackend(nn.ModuleList(experts[e] for e in gpu_ids))
    hyb = HybridExpertBackend(gpu, gpu_ids, cpu, E, "cpu")
    hidden = torch.randn(7, H)
    ids, w = _routing(7, 4, seed=8, repeat=True)
    torch.testing.assert_close(
        hyb(hidden, ids, w), _reference(experts, hidden, ids, w), rtol=1e-4, atol=1e-4
    )


def test_numa_topology_parsing(tmp_path):
    assert ck.parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert ck.numa_topology("0-1;2-3") == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="cpulists"):
        ck.numa_topology("a-b")
    for n, cpus in ((0, "0"), (1, "1"), (2, "")):
        d = tmp_path / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
    allowed = sorted(__import__("os").sched_getaffinity(0))
    topo = ck.numa_topology(root=str(tmp_path))
    assert [c for node in topo for c in node] == [c for c in (0, 1) if c in allowed] or topo == [
        allowed
    ]
    assert ck.numa_topology(root=str(tmp_path / "missing")) == [allowed]


@native
def test_a_forked_child_gets_its_own_pool():
    """A fork has none of the parent's pool threads: the backend makes the child its own pool
    instead of waiting forever for the parent's."""
    import multiprocessing as mp

    experts = _experts("int4", seed=9)
    be = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2)
    hidden = torch.randn(2, H)
    ids, w = _routing(2, 4, seed=9)
    expected = be(hidden, ids, w)  # the parent's pool is started

    def child(q):
        q.put(torch.equal(be(hidden, ids, w), expected))

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and q.get(timeout=5)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_deepcopy_rebuilds_the_backend_on_the_copied_experts(kernel):
    import copy

    experts = _experts("int4", seed=10)
    be = CpuExpertBackend(experts, range(E), E, kernel=kernel, threads=2)
    dup = copy.deepcopy(be)
    assert dup.impl == be.impl and dup.expert_ids == be.expert_ids
    assert dup.experts[0].gate_proj.weight_packed is not be.experts[0].gate_proj.weight_packed
    hidden = torch.randn(3, H)
    ids, w = _routing(3, 4, seed=10)
    torch.testing.assert_close(dup(hidden, ids, w), be(hidden, ids, w))
    dup.experts[0].gate_proj.weight_scale.data.mul_(2)  # the copy reads its own tensors
    ones = torch.ones_like(w)
    assert not torch.equal(dup(hidden, ids, ones), be(hidden, ids, ones))
