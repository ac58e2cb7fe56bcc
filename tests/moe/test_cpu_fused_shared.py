"""k2_moe_forward_shared (CpuExpertBackend.forward_with_shared, CpuSharedExpert.with_routed):
the routed experts and the shared expert of a MoE layer in one CPU kernel call, against the two
separate kernel calls (float32 outputs: the same sums, one more float32 add), the torch
reference, and the model's MoE block with the fused call switched off. INT4 (the INT4 x bf16
loop at these shapes), FP8 and bf16 routed experts; T = 1, 2 (decode) and longer; some experts
not local; a late pool thread; two NUMA nodes; the cases left to the two calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k2serve.kernels import cpu as ck
from k2serve.moe import cpu_shared
from k2serve.moe.cpu_experts import CpuExpertBackend
from k2serve.moe.cpu_shared import CpuSharedExpert

from .test_cpu_experts import _Expert, _experts, _reference, _routing

HID, INTER, NE, K = 384, 256, 6, 3  # multiples of 128: the INT4 x bf16 loop where built

pytestmark = pytest.mark.skipif(
    ck.load_kernel("auto") is None or not ck.cpu_has_bf16(),
    reason="needs the native CPU kernel on a bf16 CPU",
)


def _shared(seed=9):
    return _Expert("bf16", torch.Generator().manual_seed(seed), hidden=HID, inter=INTER)


def _case(fmt, T, local=None, threads=2, topology=None):
    experts = _experts(fmt, n=NE, seed=T, hidden=HID, inter=INTER)
    ids_local = list(range(NE)) if local is None else local
    kw = dict(kernel="native", threads=threads, amx=False, numa_topology=topology)
    be = CpuExpertBackend([experts[e] for e in ids_local], ids_local, NE, **kw)
    mlp = _shared()
    sh = CpuExpertBackend([mlp], [0], 1, **kw)
    x = torch.randn(T, HID, generator=torch.Generator().manual_seed(100 + T)).bfloat16()
    ids, w = _routing(T, K, seed=T, repeat=T > 1, num_experts=NE)
    return experts, mlp, be, sh, x, ids, w


def _two_calls_f32(be, sh, x, ids, w):
    """The previous path's two kernel calls, each with float32 outputs, added in float32."""
    T = x.shape[0]
    routed = be._run_native(x, ids, w, out=torch.empty(T, HID))
    one = torch.zeros(T, 1, dtype=torch.int64)
    shared = sh._run_native(x, one, torch.ones(T, 1), out=torch.empty(T, HID))
    return routed + shared


@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_fused_equals_the_two_calls_in_float32(fmt, T):
    _, _, be, sh, x, ids, w = _case(fmt, T)
    fused = be.forward_with_shared(x, ids, w, sh, out_dtype=torch.float32)
    two = _two_calls_f32(be, sh, x, ids, w)
    scale = two.abs().max().item()
    torch.testing.assert_close(fused, two, rtol=1e-6, atol=1e-6 * scale)
    # bf16 out: that float32 sum rounded once
    out = be.forward_with_shared(x, ids, w, sh)
    assert out.dtype == torch.bfloat16 and out.shape == (T, HID)
    assert torch.equal(out, fused.bfloat16())


@pytest.mark.parametrize("T", [1, 2])
def test_fused_matches_the_torch_reference(T):
    experts, mlp, be, sh, x, ids, w = _case("int4", T)
    xf = x.float()
    g, u, d = (m.weight.float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    ref = _reference(experts, x, ids, w) + (F.silu(xf @ g.T) * (xf @ u.T)) @ d.T
    out = be.forward_with_shared(x, ids, w, sh)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err


def test_experts_not_local_and_no_local_pair():
    local = [1, 3, 4]
    experts, mlp, be, sh, x, ids, w = _case("int4", 2, local=local)
    ids[0] = torch.tensor([0, 2, 5])  # token 0: no local expert, only the shared expert
    fused = be.forward_with_shared(x, ids, w, sh, out_dtype=torch.float32)
    two = _two_calls_f32(be, sh, x, ids, w)
    torch.testing.assert_close(fused, two, rtol=1e-6, atol=1e-6 * two.abs().max().item())
    ids[:] = 0  # no pair at all on the local experts: the shared expert alone
    fused = be.forward_with_shared(x, ids, w, sh, out_dtype=torch.float32)
    one = torch.zeros(2, 1, dtype=torch.int64)
    alone = sh._run_native(x, one, torch.ones(2, 1), out=torch.empty(2, HID))
    assert torch.equal(fused, alone)


def test_a_late_worker_and_two_nodes_change_nothing():
    """Elastic: a pool thread that starts late finds the work where it is; two NUMA nodes
    compute each row as one does: bit-identical results."""
    _, _, be, sh, x, ids, w = _case("int4", 2, threads=3)
    ref = be.forward_with_shared(x, ids, w, sh)
    lib, pool = be._lib, be._pool._ptr
    for rank in (1, 2):
        lib.k2_pool_delay(pool, rank, 2000)
        try:
            assert torch.equal(be.forward_with_shared(x, ids, w, sh), ref)
        finally:
            lib.k2_pool_delay(pool, -1, 0)
    *_, be2, sh2, x2, ids2, w2 = _case("int4", 2, threads=2, topology="0;0")
    assert be2._pool.num_nodes == 2
    assert torch.equal(be2.forward_with_shared(x2, ids2, w2, sh2), ref)


def test_bad_expert_id_is_a_clear_error():
    _, _, be, sh, x, ids, w = _case("int4", 1)
    ids[0, 0] = NE
    with pytest.raises(ValueError, match="expert id outside"):
        be.forward_with_shared(x, ids, w, sh)


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(cpu_shared, "KERNEL_MIN_THREADS", 1)


def _default_case(T=1):
    """Backends with the default settings, as the model builds them (one shared pool)."""
    experts = _experts("int4", n=NE, seed=T, hidden=HID, inter=INTER)
    be = CpuExpertBackend(experts, range(NE), NE)
    x = torch.randn(T, HID, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, K, seed=T, num_experts=NE)
    return be, _shared(), x, ids, w


@pytest.mark.parametrize("T", [1, 2])
def test_with_routed_is_within_bf16_of_the_two_calls(on, T):
    be, mlp, x, ids, w = _default_case(T)
    sh = CpuSharedExpert()
    y = sh.with_routed(mlp, be, x, ids, w)
    assert y is not None and y.dtype == torch.bfloat16
    before = be(x, ids, w) + sh(mlp, x)  # each rounded to bf16, added in bf16
    scale = before.float().abs().max().item()
    torch.testing.assert_close(y.float(), before.float(), rtol=2e-2, atol=1e-2 * scale)


def test_with_routed_leaves_the_other_cases_to_the_two_calls(on, monkeypatch):
    be, mlp, x, ids, w = _default_case()
    sh = CpuSharedExpert()
    assert sh.with_routed(mlp, be, x, ids, w) is not None
    monkeypatch.setenv("K2SERVE_CPU_FUSED_SHARED", "0")  # the switch
    assert sh.with_routed(mlp, be, x, ids, w) is None
    monkeypatch.delenv("K2SERVE_CPU_FUSED_SHARED")
    h = mlp.register_forward_hook(lambda m, a, o: o)
    assert sh.with_routed(mlp, be, x, ids, w) is None  # a hook on the shared expert
    h.remove()
    assert sh.with_routed(mlp, be, x.float(), ids, w) is None  # float32 activations
    long = torch.randn(ck.LINEAR_MAX_ROWS + 1, HID).bfloat16()
    ids3, w3 = _routing(long.shape[0], K, seed=3, num_experts=NE)
    assert sh.with_routed(mlp, be, long, ids3, w3) is None  # a prompt
    torch_be = CpuExpertBackend(_experts("int4", n=NE, hidden=HID, inter=INTER), range(NE), NE,
                                kernel="torch")  # fmt: skip
    assert sh.with_routed(mlp, torch_be, x, ids, w) is None  # routed experts not on the kernel
    monkeypatch.setattr(cpu_shared, "KERNEL_MIN_THREADS", 10**6)  # the thread rule
    assert sh.with_routed(mlp, be, x, ids, w) is None


@pytest.mark.parametrize("T", [1, 2])
def test_model_moe_block_runs_the_fused_call(on, monkeypatch, T):
    """The model's MoE block at CPU decode: one kernel call (counted) within bf16 rounding of
    the two calls (K2SERVE_CPU_FUSED_SHARED=0), the router run once either way."""
    from tests.model.conftest import tiny_config

    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model

    cfg = ModelConfig.from_hf(tiny_config("kimi", "int4"))
    model = load_model(None, dtype=torch.bfloat16, load_format="dummy", config=cfg, seed=5,
                       progress=False)  # fmt: skip
    moe = model.moe_blocks()[0]
    n = len(moe.experts)
    moe.expert_backend = CpuExpertBackend(list(moe.experts), range(n), n)
    calls = []
    fused = CpuExpertBackend.forward_with_shared
    monkeypatch.setattr(CpuExpertBackend, "forward_with_shared",
                        lambda *a, **kw: calls.append(1) or fused(*a, **kw))  # fmt: skip
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).bfloat16()
    with torch.inference_mode():
        y = moe(x)
        assert len(calls) == 1
        monkeypatch.setenv("K2SERVE_CPU_FUSED_SHARED", "0")
        before = moe(x)
        assert len(calls) == 1
    assert y.dtype == torch.bfloat16 and y.shape == (T, cfg.hidden_size)
    scale = before.float().abs().max().item()
    torch.testing.assert_close(y.float(), before.float(), rtol=2e-2, atol=1e-2 * scale)


def test_auto_and_native_backends_share_one_pool():
    """K2SERVE_CPU_KERNEL=auto (the GEMVs' default pool) and a backend built with
    kernel="native" load the same file: one library object, so one pool (two would put two
    sets of spinning workers on the same cores, and forward_with_shared would refuse them)."""
    assert ck.load_kernel("auto") is ck.load_kernel("native")
    a = CpuExpertBackend(_experts("bf16", 2), [0, 1], 2, kernel="native")
    b = CpuExpertBackend(_experts("bf16", 1), [0], 1, kernel="auto")
    assert a._live_pool() is b._live_pool()
