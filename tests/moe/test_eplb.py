"""EPLB core: the balancing algorithm, the maps, replica selection and the load window."""

import pytest
import torch

from k2serve.moe.eplb import (
    EplbConfig,
    EplbError,
    ExpertLoadWindow,
    ExpertMap,
    balanced_packing,
    imbalance,
    rank_loads,
    rebalance_experts,
    replicate_experts,
)


def skewed_load(L: int, E: int, seed: int = 0) -> torch.Tensor:
    """Zipf-like routing: a few experts take most pairs, differently in each layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    rows = [base[torch.randperm(E, generator=g)] for _ in range(L)]
    return (torch.stack(rows) * 100_000).round().to(torch.int64)  # [L, E]


def check_map(emap: ExpertMap, E: int) -> None:
    L, P = emap.phy2log.shape
    for layer in range(L):
        # every logical expert has logcnt slots, all listed in log2phy and pointing back
        counts = torch.bincount(emap.phy2log[layer], minlength=E)
        assert torch.equal(counts, emap.logcnt[layer])
        assert (counts >= 1).all()
        for e in range(E):
            slots = emap.log2phy[layer, e]
            slots = slots[slots >= 0]
            assert len(slots) == emap.logcnt[layer, e]
            assert (emap.phy2log[layer, slots] == e).all()


@pytest.mark.parametrize(
    "E,W,R,groups,nodes",
    [(64, 8, 16, 1, 1), (64, 8, 16, 8, 2), (256, 16, 32, 8, 2), (32, 4, 4, 1, 1)],
)
def test_balance_skewed_routing(E, W, R, groups, nodes, capsys):
    L = 3
    load = skewed_load(L, E)
    before = imbalance(ExpertMap.contiguous(L, E, W), load)
    emap = ExpertMap.balanced(load, E + R, W, num_groups=groups, num_nodes=nodes)
    check_map(emap, E)
    assert (emap.phy2log.view(L, W, -1).shape[-1]) == (E + R) // W
    after = imbalance(emap, load)
    with capsys.disabled():
        print(
            f"\nEPLB E={E} W={W} R={R} groups={groups} nodes={nodes}: max/mean rank load "
            f"{before:.3f} before, {after:.3f} after"
        )
    assert after <= 1.15
    assert after < before
    # the rank loads add up to the total load
    assert torch.allclose(rank_loads(emap, load).sum(-1), load.sum(-1).double().float())


def test_hierarchical_keeps_groups_on_one_node():
    L, E, W, R, groups, nodes = 2, 64, 8, 8, 8, 2
    emap = ExpertMap.balanced(skewed_load(L, E, 1), E + R, W, num_groups=groups, num_nodes=nodes)
    per_node = (E + R) // nodes
    gs = E // groups
    for layer in range(L):
        node_of_group: dict[int, int] = {}
        for slot, e in enumerate(emap.phy2log[layer].tolist()):
            node = slot // per_node
            assert node_of_group.setdefault(e // gs, node) == node


def test_replicate_gives_slots_to_the_hottest():
    w = torch.tensor([[100.0, 10, 10, 1]])
    phy2log, rep, logcnt = replicate_experts(w, 7)
    assert logcnt.tolist() == [[4, 1, 1, 1]]  # 100/4 = 25 > 10: all three go to expert 0
    assert phy2log[0, 4:].tolist() == [0, 0, 0] and rep[0, 4:].tolist() == [1, 2, 3]


def test_balanced_packing_even_sizes_and_loads():
    w = torch.tensor([[9.0, 8, 7, 6, 5, 4, 3, 2]])
    pack, rank = balanced_packing(w, 2)
    assert torch.bincount(pack[0]).tolist() == [4, 4]
    loads = [float(w[0][pack[0] == p].sum()) for p in range(2)]
    assert loads == [22.0, 22.0]
    with pytest.raises(EplbError):
        balanced_packing(w, 3)


def test_select_physical_round_robin_and_identity():
    E, W = 8, 2
    load = torch.tensor([[80, 1, 1, 1, 1, 1, 1, 1]])
    emap = ExpertMap.balanced(load, E + 2, W)
    assert int(emap.logcnt[0, 0]) == 3
    ids = torch.zeros(6, 1, dtype=torch.int64)  # six tokens all choosing expert 0
    phys = emap.select_physical(0, ids)
    assert sorted(set(phys.reshape(-1).tolist())) == sorted(
        emap.log2phy[0, 0][emap.log2phy[0, 0] >= 0].tolist()
    )
    assert (emap.phy2log[0][phys] == 0).all()
    other = torch.randint(0, E, (5, 3))
    assert torch.equal(emap.phy2log[0][emap.select_physical(0, other, offset=3)], other)
    ident = ExpertMap.contiguous(1, E, W)
    assert torch.equal(ident.select_physical(0, other), other)


def test_uneven_slots_and_bad_config():
    with pytest.raises(EplbError, match="split evenly"):
        rebalance_experts(torch.ones(1, 8), 9, 2)
    with pytest.raises(EplbError, match="window_size"):
        EplbConfig(window_size=0)
    with pytest.raises(EplbError, match="unknown"):
        EplbConfig.from_dict({"window": 3})
    cfg = EplbConfig.from_dict({"window_size": 4, "step_interval": 2, "num_redundant_experts": 2})
    assert cfg.num_redundant_experts == 2


def test_load_window_slides():
    w = ExpertLoadWindow(num_layers=1, num_experts=2, window_size=3)
    for step in range(5):
        w.record(torch.tensor([[step, 1]]))
    assert w.load().tolist() == [[2 + 3 + 4, 3]]  # only the last three steps
    assert w.filled == 3


def test_identity_map_is_contiguous_with_replicas_at_the_end():
    emap = ExpertMap.identity(2, 8, 2, 2)  # 10 slots, 5 per rank
    check_map(emap, 8)
    assert emap.rank_slots(0, 0) == [0, 1, 2, 3, 4]
    assert emap.rank_slots(1, 1) == [5, 6, 7, 0, 1]
    assert ExpertMap.contiguous(1, 8, 4).rank_slots(0, 3) == [6, 7]
    with pytest.raises(EplbError, match="split evenly"):
        ExpertMap.identity(1, 8, 4, 1)


def test_eplb_load_feeds_the_hybrid_placement(tmp_path):
    import json
    from types import SimpleNamespace

    from k2serve.moe.eplb import routing_counts
    from k2serve.moe.placement import make_placement

    load = skewed_load(2, 16, seed=3)
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(routing_counts(load, [1, 2])))
    cfg = SimpleNamespace(n_routed_experts=16, moe_layers=[1, 2])
    p = make_placement(cfg, num_gpu_experts=4, placement_file=path)
    for m, layer in enumerate((1, 2)):
        hottest = sorted(torch.argsort(load[m], descending=True)[:4].tolist())
        assert list(p.gpu_experts[layer]) == hottest
