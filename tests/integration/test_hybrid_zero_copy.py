"""Zero-copy staging and result of the hybrid MoE layers (issue 33 item 4): the pinned host
buffers read and written by kernels through their host-mapped addresses instead of memcpy
nodes (kernels.zero_copy), the choice between the two, and the benchmark's CPU stand-in that
writes `out` in place as the real CPU experts do."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from .conftest import needs_cuda

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


@pytest.fixture
def interpreted(monkeypatch):
    """kernels.zero_copy with its two kernels rebuilt under Triton's CPU interpreter (the
    module's own are compiled for CUDA): stage_to_host / add_from_host run on CPU tensors."""
    triton = pytest.importorskip("triton")
    from k2serve.kernels import zero_copy as zc

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("_stage_kernel", "_add_kernel"):
        monkeypatch.setattr(zc, name, triton.jit(getattr(zc, name).fn))
    return zc


@pytest.mark.parametrize("T", [1, 5])
def test_staging_kernel_stores_what_the_memcpys_store(interpreted, T):
    """One kernel for the three copies: hidden's bits, int32 ids widened to int64, bf16
    weights to float32 (what copy_ does), into row slices of larger buffers (the reserved
    ones), nothing past the T rows written; a hidden size not a multiple of the block."""
    zc = interpreted
    g = torch.Generator().manual_seed(T)
    D, k = zc.BLOCK + 77, 8
    hidden = torch.randn(T, D, generator=g).to(torch.bfloat16)
    tid = torch.randint(0, 384, (T, k), generator=g, dtype=torch.int32)
    tw = torch.rand(T, k, generator=g).to(torch.bfloat16)
    x = torch.full((T + 2, D), 7.0, dtype=torch.bfloat16)
    ids = torch.full((T + 2, k), -1, dtype=torch.long)
    w = torch.full((T + 2, k), 7.0)
    assert zc.can_stage(hidden, tid, tw, x[:T], ids[:T], w[:T])
    zc.stage_to_host(hidden, tid, tw, x[:T], ids[:T], w[:T])
    assert torch.equal(x[:T], hidden) and (x[T:] == 7).all()
    assert torch.equal(ids[:T], tid.long()) and (ids[T:] == -1).all()
    assert torch.equal(w[:T], tw.float()) and (w[T:] == 7).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_result_kernel_is_torch_add(interpreted, dtype):
    """gpu_out + out (out read from the host buffer) in a new tensor: the sum in float32 of
    gpu_out and out rounded to gpu_out's dtype, as `gpu_out + out.to(gpu_out.dtype)`. Bit
    for bit in float32; in bf16 within one bf16 step (of the sum, and of `out`'s rounding),
    because Triton's interpreter rounds float32 -> bf16 toward zero where the GPU (and
    torch) round to nearest even (the gpu test checks the bits on the device)."""
    zc = interpreted
    g = torch.Generator().manual_seed(1)
    gpu_out = torch.randn(3, zc.BLOCK + 5, generator=g).to(dtype)
    out = torch.randn(3, zc.BLOCK + 5, generator=g)
    for o in (out.to(dtype), out.to(torch.bfloat16), out):
        got = zc.add_from_host(gpu_out, o)
        want = gpu_out + o.to(dtype)
        assert got.dtype == dtype and got.shape == want.shape
        assert got.data_ptr() != gpu_out.data_ptr()
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            # one bf16 step of the sum, and one of `out` where it is rounded to bf16 first
            step = (want.float().abs() + o.float().abs()) * 2.0**-7
            assert ((got.float() - want.float()).abs() <= step).all()


def test_can_stage_refuses_what_the_kernel_does_not_index():
    from k2serve.kernels.zero_copy import HAS_TRITON, can_stage

    if not HAS_TRITON:
        pytest.skip("no Triton")
    h, i, w = torch.zeros(2, 16), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    x, hi, hw = torch.zeros(2, 16), torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4)
    assert can_stage(h, i, w, x, hi, hw)
    assert not can_stage(h.t().contiguous().t(), i, w, x, hi, hw)  # inner stride 2
    assert not can_stage(h, i, w, torch.zeros(3, 16), hi, hw)  # other shape
    assert not can_stage(h, i, w, x.to(torch.bfloat16), hi, hw)  # other dtype: a cast
    assert not can_stage(h, i, w[:, :2], x, hi, hw)


def test_zero_copy_is_used_only_where_asked_and_probed(monkeypatch):
    """moe.hybrid.use_zero_copy: the env switch (default on) or the runner's explicit choice,
    and the device's probe; never on a CPU device."""
    from k2serve.moe import hybrid

    probe = {"ok": True}
    monkeypatch.setattr(hybrid, "zero_copy_supported", lambda index: probe["ok"])
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("K2SERVE_HYBRID_ZERO_COPY", raising=False)
    assert hybrid.use_zero_copy(cuda)
    assert not hybrid.use_zero_copy(torch.device("cpu"))
    assert not hybrid.use_zero_copy(cuda, zero_copy=False)
    monkeypatch.setenv("K2SERVE_HYBRID_ZERO_COPY", "0")
    assert not hybrid.use_zero_copy(cuda)
    assert hybrid.use_zero_copy(cuda, zero_copy=True)  # the explicit choice wins
    probe["ok"] = False
    assert not hybrid.use_zero_copy(cuda, zero_copy=True)  # the probe failed: memcpys
    monkeypatch.setenv("K2SERVE_HYBRID_ZERO_COPY", "maybe")
    with pytest.raises(ValueError, match="K2SERVE_HYBRID_ZERO_COPY"):
        hybrid.use_zero_copy(cuda)


def test_the_result_kernel_loads_out_volatile_in_the_ptx():
    """Compiled for sm_90 (no GPU needed) by benchmarks/zero_copy_compile.py, in a process of
    its own (this CPU session runs Triton in its interpreter mode, which cannot compile): the
    result kernel's loads of the CPU's `out` are `ld.volatile.global` (never the last step's
    `out` from a cache), gpu_out's plain. Exit status 1 = not volatile; others: cannot
    compile here (skipped)."""
    import subprocess

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(BENCH, "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, os.path.join(BENCH, "zero_copy_compile.py")],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    if run.returncode not in (0, 1):
        pytest.skip(f"cannot compile for sm_90 here: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stdout


def _pinned_set(T: int, D: int, k: int, dtype=torch.bfloat16) -> dict:
    return dict(x=torch.full((T + 1, D), 3.0, dtype=dtype, pin_memory=True),
                ids=torch.full((T + 1, k), -1, dtype=torch.long, pin_memory=True),
                w=torch.full((T + 1, k), 3.0, pin_memory=True))  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 33])
def test_cuda_zero_copy_staging_equals_the_memcpys(T):
    """Random inputs, K2's hidden size: the staging kernel's host buffers hold the bits the
    three memcpys write, seen by the host through a ready word written after the kernel
    (cuStreamWriteValue32's fence), the GPU busy first so that the host really waits."""
    from k2serve.kernels.stream_wait import HostReadyWord, host_mapped
    from k2serve.kernels.zero_copy import stage_to_host, zero_copy_supported

    assert zero_copy_supported(torch.cuda.current_device())
    D, k = 7168, 8
    mem, zc = _pinned_set(T, D, k), _pinned_set(T, D, k)
    mapped = {n: host_mapped(t) for n, t in zc.items()}
    word = HostReadyWord()
    g = torch.Generator(device="cuda").manual_seed(T)
    for step in range(3):
        hidden = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        tid = torch.randint(0, 384, (T, k), device="cuda", generator=g, dtype=torch.int32)
        tw = torch.rand(T, k, device="cuda", generator=g)
        torch.cuda._sleep(1_000_000)
        mem["x"][:T].copy_(hidden, non_blocking=True)
        mem["ids"][:T].copy_(tid, non_blocking=True)
        mem["w"][:T].copy_(tw, non_blocking=True)
        stage_to_host(hidden, tid, tw, mapped["x"][:T], mapped["ids"][:T], mapped["w"][:T])
        word.wait(word.record())
        for n in ("x", "ids", "w"):
            assert torch.equal(zc[n], mem[n]), (n, step)
        assert (zc["x"][T:] == 3).all() and (zc["ids"][T:] == -1).all()
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_cuda_result_kernel_equals_gpu_out_plus_out_replay_after_replay():
    """add_from_host = gpu_out + out (torch's bits), and inside a CUDA graph each replay reads
    what the host wrote into `out` since the last one (no stale copy from a cache)."""
    from k2serve.kernels.stream_wait import host_mapped
    from k2serve.kernels.zero_copy import add_from_host

    T, D = 4, 7168
    g = torch.Generator(device="cuda").manual_seed(0)
    gpu_out = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.randn(T, D).to(torch.bfloat16).pin_memory()
    m = host_mapped(out)
    assert torch.equal(add_from_host(gpu_out, m), gpu_out + out.cuda())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = add_from_host(gpu_out, m)
    for step in range(4):
        out.copy_(torch.randn(T, D).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(res, gpu_out + out.cuda()), step


# (device_wait, one_graph, spin_wait)
WAYS = {"host wait": (False, False, False), "one graph, spin kernel": (True, True, True)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("way", list(WAYS))
def test_cuda_zero_copy_graphs_equal_the_memcpy_graphs_and_eager(way):
    """bf16 on CUDA, the tiny int4 model with hybrid layers: decode graphs staging zero-copy
    give the memcpy graphs' output (1e-3: kernels that add in any order) and the eager
    model's (2e-2, as the other CUDA hybrid tests), step after step."""
    from .test_piecewise_graphs import PAGES, PS, _cuda_decode_md, _cuda_runner

    device_wait, one_graph, spin_wait = WAYS[way]
    (m_mem, r_mem), (m_zc, r_zc) = (
        _cuda_runner(device_wait=device_wait, one_graph=one_graph, spin_wait=spin_wait,
                     zero_copy=zc)
        for zc in (False, True)
    )  # fmt: skip
    moe = m_zc.config.moe_layers
    assert [m_mem.model.layers[i].mlp.expert_backend.zero_copy for i in moe] == [False] * len(moe)
    assert [m_zc.model.layers[i].mlp.expert_backend.zero_copy for i in moe] == [True] * len(moe)
    dim = m_mem.config.kv_lora_rank + m_mem.config.qk_rope_head_dim
    caches = [torch.zeros(3 * PAGES, PS, dim, dtype=torch.bfloat16, device="cuda")
              for _ in m_mem.model.layers]  # fmt: skip
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,), device="cuda")
    for _ in range(3):
        pos, md = _cuda_decode_md(lens)
        ref = m_mem.compute_logits(m_mem(ids, pos, md, caches))  # eager, memcpys
        mem = m_mem.compute_logits(r_mem.run(ids, pos, md))
        got = m_zc.compute_logits(r_zc.run(ids, pos, md))
        torch.testing.assert_close(got, mem, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        ids, lens = ref.argmax(-1), [n + 1 for n in lens]
