"""The router never returns an expert id outside [0, E) (nor a repeated one), whatever its input:
NaN / +-inf logits, on the torch path and in the fused Triton kernel (run by the interpreter
on CPU); a non-finite hidden state is reported with the layer's index."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from k2serve.kernels import router as kr
from k2serve.kernels.router_torch import grouped_topk_torch as grouped_topk
from k2serve.model.router import TopkRouter

CASES = [(1, 1, 48, 6), (8, 4, 64, 8), (4, 2, 32, 4)]  # n_group, topk_group, E, k


def _bad_logits(E: int) -> torch.Tensor:
    lg = torch.randn(6, E)
    lg[0] = float("nan")  # every logit NaN
    lg[1, ::3] = float("nan")  # some NaN
    lg[2] = float("inf")
    lg[3] = float("-inf")
    lg[4, : E // 2] = float("-inf")
    lg[4, E // 2 :] = float("nan")
    return lg  # row 5 is finite


def _check(ids: torch.Tensor, w: torch.Tensor, E: int, k: int) -> None:
    assert ids.shape[1] == k
    assert int(ids.min()) >= 0 and int(ids.max()) < E, ids
    for row in ids.tolist():
        assert len(set(row)) == k, row  # distinct
    assert not torch.isnan(w[[0, 1, 4]]).all(dim=1).any()  # NaN scores get weight 0, not NaN
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("n_group,topk_group,E,k", CASES)
def test_torch_paths_keep_ids_in_range(n_group, topk_group, E, k):
    lg, bias = _bad_logits(E), torch.randn(E) * 0.1
    w, ids = kr.grouped_topk_torch(lg, bias, k, n_group, topk_group, True, 2.5)
    _check(ids, w, E, k)
    w, ids = grouped_topk(lg, bias, k, n_group, topk_group, True, 2.5)
    _check(ids, w, E, k)


@pytest.mark.parametrize("n_group,topk_group,E,k", CASES)
def test_fused_kernel_keeps_ids_in_range(n_group, topk_group, E, k):
    if not kr.HAS_TRITON or not (torch.cuda.is_available() or kr.INTERPRET):
        pytest.skip("needs Triton (CUDA or TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lg, bias = _bad_logits(E).to(dev), (torch.randn(E) * 0.1).to(dev)
    w, ids = kr.fused_grouped_topk(lg, bias, k, n_group, topk_group, True, 2.5, torch.int64)
    _check(ids.cpu(), w.cpu(), E, k)
    # the finite row is unchanged by the guards: same set as the torch path
    wt, it = kr.grouped_topk_torch(lg.cpu(), bias.cpu(), k, n_group, topk_group, True, 2.5)
    assert set(ids[5].tolist()) == set(it[5].tolist())


def _router(E=16, k=4):
    cfg = SimpleNamespace(
        num_experts_per_tok=k, n_routed_experts=E, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, hidden_size=32,
    )  # fmt: skip
    r = TopkRouter(cfg, torch.float32)
    r.weight.data.normal_()
    r.layer_idx = 7
    return r


def test_router_warns_naming_the_layer_on_a_non_finite_hidden_state(caplog):
    r = _router()
    x = torch.randn(3, 32)
    x[1, 4] = float("nan")
    with caplog.at_level(logging.WARNING, logger="k2serve.model.router"):
        w, ids = r(x)
    assert int(ids.min()) >= 0 and int(ids.max()) < 16
    msgs = [rec.getMessage() for rec in caplog.records]
    assert any("non-finite hidden state" in m and "layer 7" in m for m in msgs), msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="k2serve.model.router"):
        r(torch.randn(3, 32))  # finite: silent
        r(x)  # a second bad call: counted, not logged again
    assert not caplog.records and r.nonfinite_count == 2
