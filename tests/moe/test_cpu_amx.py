"""The CPU experts' prompt path on AMX tiles (kernels/cpu/k2amx.h) against the float32
reference, and the choice between it and the decode path (dot products), which is what machines
without AMX run for every step (CI): those tests run everywhere, the tile ones where the CPU and
the kernel build have AMX."""

from __future__ import annotations

import pytest
import torch

from k2serve.kernels import cpu as ck
from k2serve.moe import cpu_experts
from k2serve.moe.cpu_experts import CpuExpertBackend

from .test_cpu_experts import E, H, _experts, _reference, _routing

_lib = ck.load_kernel("auto")
native = pytest.mark.skipif(_lib is None, reason="no C++ compiler")
amx = pytest.mark.skipif(
    _lib is None or not _lib.k2_amx_available(), reason="no AMX on this CPU / build"
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@amx
@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16"])
@pytest.mark.parametrize("T", [4, 9, 40, 70])  # pairs per expert below, at, above 16 and 32
def test_amx_matches_reference(fmt, T):
    experts = _experts(fmt, seed=T)
    be = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2, amx=True,
                          amx_min_pairs=0.0, amx_min_tokens=0)  # fmt: skip
    assert be.amx
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, 4, seed=T, repeat=True)
    out = be(hidden, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert torch.isfinite(out).all()
    ref = _reference(experts, hidden, ids, w)
    assert _rel(out, ref) < 1e-2  # bf16 weights and activations, float32 sums
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@amx
def test_amx_subset_of_experts_and_unrouted_tokens():
    experts = _experts("int4", seed=11)
    cpu_ids = [0, 3, 6]
    be = CpuExpertBackend([experts[e] for e in cpu_ids], cpu_ids, E, kernel="native",
                          threads=2, amx_min_pairs=0.0, amx_min_tokens=0)  # fmt: skip
    T = 37
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    ids, w = _routing(T, 3, seed=12)
    ids[0] = torch.tensor([1, 2, 4])  # no CPU expert: a zero row
    on_cpu = torch.isin(ids, torch.tensor(cpu_ids))
    ref = _reference(experts, hidden, ids, torch.where(on_cpu, w, torch.zeros_like(w)))
    out = be(hidden, ids, w)
    assert out[0].abs().max() == 0
    assert _rel(out, ref) < 1e-2


@amx
@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_amx_two_node_split_is_bit_identical(fmt):
    """Each weight row is computed the same way whichever node's threads own it."""
    experts = _experts(fmt, seed=13)
    kw = dict(kernel="native", amx_min_pairs=0.0, amx_min_tokens=0)
    one = CpuExpertBackend(experts, range(E), E, threads=2, numa_topology="0", **kw)
    two = CpuExpertBackend(experts, range(E), E, threads=2, numa_topology="0;0", **kw)
    hidden = torch.randn(50, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids, w = _routing(50, 4, seed=14)
    assert torch.equal(one(hidden, ids, w), two(hidden, ids, w))


@amx
def test_amx_is_chosen_by_pairs_per_expert_and_bf16_activations():
    experts = _experts("int4", seed=15)
    auto = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2)
    dot = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2, amx=False)
    assert auto.amx and not dot.amx
    # 1 token: 4 pairs over 4 experts, under AMX_MIN_PAIRS: the decode path, bit for bit
    x1 = torch.randn(1, H).bfloat16()
    ids1, w1 = _routing(1, 4, seed=16)
    assert cpu_experts.AMX_MIN_PAIRS > 1
    assert torch.equal(auto(x1, ids1, w1), dot(x1, ids1, w1))
    # a decode batch (under AMX_MIN_TOKENS), many pairs per expert: still the decode path
    assert cpu_experts.AMX_MIN_TOKENS > 64
    xs = torch.randn(64, H).bfloat16()
    ids_s, w_s = _routing(64, 4, seed=17)
    assert torch.equal(auto(xs, ids_s, w_s), dot(xs, ids_s, w_s))
    # a prompt: the tile path (bf16 rounding of the weights: close, not equal)
    x = torch.randn(cpu_experts.AMX_MIN_TOKENS, H).bfloat16()
    ids, w = _routing(cpu_experts.AMX_MIN_TOKENS, 4, seed=17)
    a, d = auto(x, ids, w), dot(x, ids, w)
    assert not torch.equal(a, d) and _rel(a, d) < 1e-2
    # float32 activations (float32 models) never take it
    xf = x.float()
    assert torch.equal(auto(xf, ids, w), dot(xf, ids, w))


@native
def test_amx_off_by_environment(monkeypatch):
    monkeypatch.setenv("K2SERVE_CPU_AMX", "0")
    be = CpuExpertBackend(_experts("int4"), range(E), E, kernel="native", threads=2)
    assert not be.amx
    monkeypatch.setenv("K2SERVE_CPU_AMX", "maybe")
    with pytest.raises(ValueError, match="K2SERVE_CPU_AMX"):
        CpuExpertBackend(_experts("int4"), range(E), E, kernel="native", threads=2)


@native
@pytest.mark.parametrize("fmt", ["int4", "fp8", "bf16"])
def test_decode_path_at_prompt_sizes_matches_reference(fmt):
    """What CPUs without AMX run for prompts (and what AMX machines run with amx=False)."""
    experts = _experts(fmt, seed=21)
    be = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2, amx=False)
    assert not be.amx
    T = 40
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids, w = _routing(T, 4, seed=22, repeat=True)
    out = be(hidden, ids, w)
    assert _rel(out, _reference(experts, hidden, ids, w)) < 1e-2


@native
def test_float32_experts_never_use_tiles():
    be = CpuExpertBackend(_experts("f32"), range(E), E, kernel="native", threads=2, amx=True)
    assert not be.amx  # float32 weights stay exact on the decode path


@amx
def test_amx_copy_keeps_the_setting():
    import copy

    be = CpuExpertBackend(_experts("int4"), range(E), E, kernel="native", threads=2,
                          amx_min_pairs=0.0, amx_min_tokens=0)  # fmt: skip
    cp = copy.deepcopy(be)
    assert cp.amx
    x = torch.randn(20, H).bfloat16()
    ids, w = _routing(20, 4, seed=23)
    assert torch.equal(be(x, ids, w), cp(x, ids, w))


@native
def test_long_steps_run_in_chunks(monkeypatch):
    """A step longer than NATIVE_CHUNK_TOKENS is computed chunk by chunk: the same as separate
    calls on the chunks, close to one call; a bad id in a later chunk is still a clear error."""
    experts = _experts("int4", seed=25)
    be = CpuExpertBackend(experts, range(E), E, kernel="native", threads=2)
    x = torch.randn(45, H).bfloat16()
    ids, w = _routing(45, 4, seed=26)
    whole = be(x, ids, w)
    monkeypatch.setattr(cpu_experts, "NATIVE_CHUNK_TOKENS", 16)
    chunked = be(x, ids, w)
    parts = torch.cat([be(x[a : a + 16], ids[a : a + 16], w[a : a + 16]) for a in (0, 16, 32)])
    assert torch.equal(chunked, parts)
    assert _rel(chunked, whole) < 1e-2
    ids[40, 0] = E
    with pytest.raises(ValueError, match="outside"):
        be(x, ids, w)
