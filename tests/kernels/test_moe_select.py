"""The routed experts' path chosen on the device from the routing (kernels/moe_select.py and
FusedMoEBackend's `routing_select` bands)."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.test_kernels import DEVICE, _int4_experts, rel

from k2serve.kernels import fused_moe as fm
from k2serve.kernels.moe_select import moe_select, moe_select_ref


@pytest.mark.parametrize("thresholds", [(2.0,), (1.5, 3.0)])
def test_moe_select_matches_reference(thresholds):
    for ids in (
        torch.arange(16).view(8, 2),  # 16 experts hit once: ppe 1
        torch.tensor([[0, 1]] * 8),  # 2 experts: ppe 8
        torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 1], [4, 5]]),  # 6 of 12: ppe 2
    ):
        ids = ids.to(DEVICE)
        got = moe_select(ids, 16, thresholds)
        want = moe_select_ref(ids, 16, thresholds)
        assert got.tolist() == want.tolist()
        assert got[:-1].sum().item() == 1 and got[-1].item() == ids.unique().numel()
    ppe8 = moe_select(torch.tensor([[0, 1]] * 8, device=DEVICE), 16, thresholds)
    assert ppe8[len(thresholds)].item() == 1  # the last (most pairs per expert) path


def test_moe_select_rejects_bad_thresholds():
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ascending"):
        moe_select(ids, 4, (3.0, 2.0))
    with pytest.raises(ValueError, match="1 or 2"):
        moe_select(ids, 4, ())


def test_inactive_path_does_no_work():
    """active = 0: the per-pair GEMV's programs return at once (its output is not written)."""
    from k2serve.kernels import int4_gemv

    ew = _int4_experts(4, 128, 128)  # the flag, not the K loop: the smallest W=16 takes
    x = torch.randn(3, 128, device=DEVICE, dtype=torch.bfloat16) * 7
    w = torch.rand(3, 2, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], device=DEVICE)
    cfg = dict(BLOCK_N=8, W=16, num_warps=4)
    ref = fm.fused_moe_ref(x, ew, w, ids)
    off = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert not rel(int4_gemv.int4_moe_decode(x, ew, w, ids, cfg, active=off), ref) < 0.1  # nan
    on = torch.ones(1, dtype=torch.int32, device=DEVICE)
    assert rel(int4_gemv.int4_moe_decode(x, ew, w, ids, cfg, active=on), ref) < 2e-2


def test_backend_picks_by_pairs_per_expert(chosen_paths):
    """In a routing_select band every candidate is launched and the output is the chosen
    one's: spread routing -> the per-pair GEMV, concentrated -> the grouped GEMV; the
    result is the reference either way. Outside the band: the pair-count rule."""
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = _int4_experts(8, 256, 256)
    band = dict(min_pairs=8, max_pairs=16, paths=["decode", "grouped"], pairs_per_expert=[2.0])
    be = FusedMoEBackend(ew, "auto", "auto", grouped_config=dict(BLOCK_M=4, BLOCK_N=64, W=16,
                         num_warps=4), routing_select=[band], decode_max_pairs=4,
                         decode_config=dict(BLOCK_N=64, W=16, num_warps=4))  # fmt: skip
    assert be.plan(4, 2) == (("decode", "grouped"), (2.0,))
    assert be.plan(2, 2) == (("decode",), ())
    assert be.plan(9, 2) == (("gemm",), ())
    chosen = chosen_paths
    for ids in ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1], [1, 0], [0, 1], [1, 0]]):
        ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        x = torch.randn(4, 256, device=DEVICE, dtype=torch.bfloat16)
        w = torch.rand(4, 2, device=DEVICE)
        assert rel(be(x, ids, w), fm.fused_moe_ref(x, ew, w, ids)) < 2e-2
    assert chosen == [0, 1]


def test_bad_routing_select_table_fails_at_setup():
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = _int4_experts(2, 256, 256)
    bad = dict(min_pairs=8, max_pairs=16, paths=["decode", "gemm"], pairs_per_expert=[2.0, 3.0])
    with pytest.raises(ValueError, match="int4_routing_select"):
        FusedMoEBackend(ew, routing_select=[bad])
