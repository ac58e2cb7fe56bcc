"""The CPU kernel's router at decode (kernels/cpu/router.py, k2router.h) against
grouped_topk_torch: the same ids in the same order and the same weights, bit for bit, for
K2's and DeepSeek-V3's configs, NaN / inf logits, constructed ties, negative biases; and
TopkRouter taking it at decode (and the torch ops elsewhere) with unchanged results."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from k2serve.kernels import cpu as ck
from k2serve.kernels.cpu import router as kr
from k2serve.kernels.router_torch import grouped_topk_torch
from k2serve.model import router as mr
from k2serve.model.router import TopkRouter

native = pytest.mark.skipif(ck.load_kernel("auto") is None, reason="no C++ compiler")

# E, top_k, n_group, topk_group, routed_scaling_factor
K2 = (384, 8, 1, 1, 2.827)
DSV3 = (256, 8, 8, 4, 2.5)
TINY = [(8, 2, 1, 1, 2.5), (16, 4, 4, 2, 2.5), (48, 6, 1, 1, 1.0), (72, 3, 3, 2, 1.0)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _assert_same(got, ref) -> None:
    assert got is not None, "the kernel declined a covered shape"
    (w, ids), (wr, ir) = got, ref
    assert torch.equal(ids, ir), (ids, ir)  # same ids, same (unsorted) order
    assert torch.equal(_bits(w), _bits(wr)), (w, wr)  # bit for bit


def _logits(T: int, E: int, g: torch.Generator, case: str) -> torch.Tensor:
    lg = torch.randn(T, E, generator=g) * 3
    if case == "ties":  # few distinct values: ties at the k-th place, inside groups, of groups
        lg = (lg * 2).round() / 2
    elif case == "equal":  # every score tied
        lg = torch.zeros(T, E)
    elif case == "nan":
        lg[0, ::5] = float("nan")
        lg[-1] = float("nan")  # a whole row
    elif case == "inf":
        lg[0, : E // 2] = float("inf")
        lg[-1, ::2] = float("-inf")
    elif case == "saturated":  # sigmoid == 1.0 exactly for many: ties after the sigmoid
        lg = lg * 20
    return lg


@native
@pytest.mark.parametrize("cfg", [K2, DSV3, *TINY], ids=lambda c: f"E{c[0]}k{c[1]}g{c[2]}")
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("case", ["random", "ties", "equal", "nan", "inf", "saturated"])
@pytest.mark.parametrize("bias_kind", ["random", "negative", "none"])
def test_select_equals_grouped_topk_torch(cfg, T, case, bias_kind):
    E, k, ng, tg, scale = cfg
    g = torch.Generator().manual_seed(E * 10 + T)
    for _ in range(4):
        lg = _logits(T, E, g, case)
        bias = {"random": torch.randn(E, generator=g) * 0.1,
                "negative": -torch.rand(E, generator=g) - 0.5,
                "none": None}[bias_kind]  # fmt: skip
        if case == "ties" and bias is not None:
            bias = (bias * 4).round() / 4
        for renorm in (True, False):
            ref = grouped_topk_torch(lg, bias, k, ng, tg, renorm, scale)
            _assert_same(kr.cpu_router_select(lg, bias, k, ng, tg, renorm, scale), ref)


@native
@pytest.mark.parametrize("cfg", [K2, DSV3], ids=["k2", "dsv3"])
def test_nan_scores_rank_last_and_weigh_zero(cfg):
    E, k, ng, tg, scale = cfg
    lg = torch.randn(2, E)
    lg[0, k // 2 :] = float("nan")  # only k/2 real scores in row 0
    lg[1] = float("nan")
    bias = torch.randn(E) * 0.1
    w, ids = kr.cpu_router_select(lg, bias, k, ng, tg, True, scale)
    assert int(ids.min()) >= 0 and int(ids.max()) < E
    assert all(len(set(r)) == k for r in ids.tolist())  # distinct
    if ng == 1:  # every real score is chosen, and the NaN ones weigh 0
        assert set(range(k // 2)) <= set(ids[0].tolist())
    assert torch.isfinite(w).all() and (w[1] == 0).all()


@native
def test_select_declines_what_torch_computes_otherwise():
    lg, bias = torch.randn(1, 512), torch.zeros(512)
    assert kr.cpu_router_select(lg, bias, 8) is None  # k * 64 <= E: torch's heap path
    assert kr.cpu_router_select(torch.randn(1, 64), None, 16) is None  # k of two vectors
    assert kr.cpu_router_select(lg.double(), None, 8) is None


def _gate(cfg, hidden=256, dtype=torch.bfloat16, seed=0) -> TopkRouter:
    E, k, ng, tg, scale = cfg
    c = SimpleNamespace(
        num_experts_per_tok=k, n_routed_experts=E, n_group=ng, topk_group=tg,
        norm_topk_prob=True, routed_scaling_factor=scale, hidden_size=hidden,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    r = TopkRouter(c, dtype)
    r.weight.data = torch.randn(E, hidden, generator=g).to(dtype) * hidden**-0.5
    r.e_score_correction_bias.data = torch.randn(E, generator=g) * 0.05
    r.layer_idx = 3
    return r


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many TopkRouter calls the kernel answered."""
    n = [0]

    def counted(*a, **kw):
        got = kr.cpu_router_topk(*a, **kw)
        n[0] += got is not None
        return got

    monkeypatch.setattr(mr, "cpu_router_topk", counted)
    return n


@native
@pytest.mark.parametrize("cfg", [K2, DSV3], ids=["k2", "dsv3"])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
def test_router_at_decode_takes_the_kernel_with_the_same_result(cfg, xdt, kernel_calls):
    gate = _gate(cfg)
    g = torch.Generator().manual_seed(1)
    for T in (1, 2, 1, 2):
        x = torch.randn(T, 256, generator=g).to(xdt)
        got = gate(x)
        gate.cpu_kernel_topk = False
        ref = gate(x)
        gate.cpu_kernel_topk = True
        _assert_same(got, ref)
        # and the torch path is what it was: the kernel's logits through grouped_topk_torch
        lg = ck.cpu_linear(x if xdt == torch.bfloat16 else x.float(), gate.weight, torch.float32)
        E, k, ng, tg, scale = cfg
        _assert_same(got, grouped_topk_torch(lg, gate.e_score_correction_bias, k, ng, tg, True,
                                             scale))  # fmt: skip
    assert kernel_calls[0] == 4


@native
def test_router_keeps_torch_ops_off_decode(kernel_calls):
    bf = _gate(K2)
    bf(torch.randn(ck.LINEAR_MAX_ROWS + 1, 256).bfloat16())  # a prompt
    _gate(K2, dtype=torch.float32)(torch.randn(1, 256))  # a float32 gate (F.linear's sums)
    assert kernel_calls[0] == 0


@native
def test_router_reports_a_non_finite_hidden_state_on_the_kernel_path(caplog, kernel_calls):
    gate = _gate(K2)
    x = torch.randn(1, 256).bfloat16()
    x[0, 7] = float("nan")
    with caplog.at_level(logging.WARNING, logger="k2serve.model.router"):
        w, ids = gate(x)
    assert kernel_calls[0] == 1 and gate.nonfinite_count == 1
    assert int(ids.min()) >= 0 and int(ids.max()) < K2[0] and len(set(ids[0].tolist())) == 8
    assert any("layer 3" in r.getMessage() for r in caplog.records)
    gate(torch.randn(1, 256).bfloat16())
    assert gate.nonfinite_count == 1


_CHILD = """
import torch
from k2serve.kernels.cpu import router as kr
from k2serve.kernels.router_torch import grouped_topk_torch
vec = kr.torch_vector()
assert vec is not None, torch.backends.cpu.get_cpu_capability()
g = torch.Generator().manual_seed(0)
for E, k, ng, tg in ((384, 8, 1, 1), (256, 8, 8, 4), (8, 2, 1, 1), (48, 6, 1, 1)):
    for T in (1, 2):
        lg, b = torch.randn(T, E, generator=g) * 3, torch.randn(E, generator=g) * 0.1
        w, i = kr.cpu_router_select(lg, b, k, ng, tg, True, 2.5)
        wr, ir = grouped_topk_torch(lg, b, k, ng, tg, True, 2.5)
        assert torch.equal(i, ir) and torch.equal(w.view(torch.int32), wr.view(torch.int32))
print(torch.backends.cpu.get_cpu_capability(), vec)
"""


@native
@pytest.mark.parametrize("cap", ["avx2", "default"])
def test_select_follows_torchs_other_cpu_capabilities(cap):
    """torch picks its kernels per CPU capability (ATEN_CPU_CAPABILITY lowers it): the
    kernel reproduces the AVX2 (8-float vectors) and default (libm exp) ones too."""
    if cap == "avx2" and "avx2" not in ck._cpu_flags().split():
        pytest.skip("no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == cap.upper(), r.stdout
