"""moe.cpu_shared: the shared expert at CPU decode as one call of the CPU experts kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k2serve.kernels import cpu as ck
from k2serve.moe import cpu_shared
from k2serve.moe.cpu_shared import CpuSharedExpert
from k2serve.quant.linear import UnquantizedLinear

H, INTER = 256, 128

pytestmark = pytest.mark.skipif(
    ck.load_kernel() is None or not ck.cpu_has_bf16(),
    reason="needs the native CPU kernel on a bf16 CPU",
)


class Mlp(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, (n, k) in {"gate_proj": (INTER, H), "up_proj": (INTER, H),
                             "down_proj": (H, INTER)}.items():  # fmt: skip
            lin = UnquantizedLinear(k, n, torch.bfloat16)
            lin.weight = nn.Parameter((torch.randn(n, k, generator=g) * k**-0.5).bfloat16(),
                                      requires_grad=False)  # fmt: skip
            setattr(self, name, lin)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def ref(mlp: Mlp, x: torch.Tensor) -> torch.Tensor:  # float32 of the same bf16 values
    g, u, d = (m.weight.float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    xf = x.float()
    return (F.silu(xf @ g.T) * (xf @ u.T)) @ d.T


def close(y: torch.Tensor, r: torch.Tensor) -> None:
    err = ((y.float() - r).abs().max() / r.abs().max()).item()
    assert err < 2e-2, err


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(cpu_shared, "KERNEL_MIN_THREADS", 1)


@pytest.mark.parametrize("T", [1, 2])
def test_kernel_matches_the_module(on, T):
    mlp = Mlp(0)
    x = torch.randn(T, H).bfloat16()
    y = CpuSharedExpert()(mlp, x)
    assert y is not None and y.shape == (T, H) and y.dtype == torch.bfloat16
    close(y, ref(mlp, x))
    close(mlp(x), ref(mlp, x))  # the module's own path, for scale


def test_rule_and_cases_it_leaves_to_the_module(monkeypatch):
    mlp, x = Mlp(1), torch.randn(1, H).bfloat16()
    monkeypatch.setattr(cpu_shared, "KERNEL_MIN_THREADS", 10**6)
    assert not cpu_shared.use_kernel() and CpuSharedExpert()(mlp, x) is None
    monkeypatch.setattr(cpu_shared, "KERNEL_MIN_THREADS", 1)
    sh = CpuSharedExpert()
    assert sh(mlp, x.float()) is None  # float32 activations
    assert sh(mlp, torch.randn(ck.LINEAR_MAX_ROWS + 1, H).bfloat16()) is None  # a prompt
    h = mlp.register_forward_hook(lambda m, a, o: o)
    assert sh(mlp, x) is None  # a hook would be skipped
    h.remove()
    assert sh(mlp, x) is not None
    mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.float(), requires_grad=False)
    assert sh(mlp, x) is None  # not bf16 weights


def test_rebuilt_when_a_weight_is_replaced(on):
    mlp, x = Mlp(2), torch.randn(1, H).bfloat16()
    sh = CpuSharedExpert()
    close(sh(mlp, x), ref(mlp, x))
    other = Mlp(3)
    mlp.down_proj.weight = other.down_proj.weight
    close(sh(mlp, x), ref(mlp, x))
