"""Experts split between the model's device and the CPU: placement, loading, same logits."""

from __future__ import annotations

import json

import pytest
import torch

from k2serve.moe import describe_placement, make_placement
from k2serve.moe.placement import PlacementError

from .conftest import load_tiny, tiny_config

E = 8  # routed experts per layer in the tiny config; MoE layers 1 and 2


def _ids(n=21, seed=0):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed))


def test_num_gpu_experts_keeps_the_first_n_without_counts():
    p = make_placement(tiny_config(), 3)
    assert p.gpu_experts == {1: (0, 1, 2), 2: (0, 1, 2)}
    assert p.cpu_experts(1) == (3, 4, 5, 6, 7)
    assert p.device_of(2, 2) == "gpu" and p.device_of(2, 3) == "cpu"
    assert p.tensor_on_cpu("model.layers.1.mlp.experts.5.down_proj.weight_packed")
    assert not p.tensor_on_cpu("model.layers.1.mlp.experts.0.down_proj.weight_packed")
    assert not p.tensor_on_cpu("model.layers.1.mlp.shared_experts.down_proj.weight_packed")
    assert make_placement(tiny_config()).all_on_gpu


def test_counts_file_puts_the_hottest_experts_on_the_gpu(tmp_path):
    f = tmp_path / "counts.json"
    f.write_text(json.dumps({"layers": {"2": [5, 0, 9, 9, 1, 7, 0, 2]}}))
    p = make_placement(tiny_config(), 3, f)
    assert p.gpu_experts[2] == (2, 3, 5)  # counts 9, 9, 7
    assert p.gpu_experts[1] == (0, 1, 2)  # layer absent from the file
    assert "counts.json" in p.describe()


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not JSON"),
        (json.dumps({"layers": {"0": [1] * E}}), "not a MoE layer"),
        (json.dumps({"layers": {"1": [1] * (E - 1)}}), "8 non-negative counts"),
        (json.dumps({"layers": {"1": [-1] + [1] * (E - 1)}}), "non-negative"),
        (json.dumps({"layers": {"x": [1] * E}}), "not an int"),
    ],
)
def test_bad_counts_file_is_a_clear_error(tmp_path, content, match):
    f = tmp_path / "c.json"
    f.write_text(content)
    with pytest.raises(PlacementError, match=match):
        make_placement(tiny_config(), 2, f)


@pytest.mark.parametrize("n", [-1, E + 1, "4"])
def test_bad_num_gpu_experts_is_rejected(n):
    with pytest.raises(PlacementError, match="num_gpu_experts"):
        make_placement(tiny_config(), n)


@pytest.mark.parametrize("n", [4, 0, 7])
def test_half_on_cpu_gives_the_logits_of_all_on_one(n):
    ids = _ids()
    ref_model = load_tiny("int4")
    ref = ref_model.compute_logits(ref_model(ids, torch.arange(len(ids))))
    placement = make_placement(ref_model.config, n)
    model = load_tiny("int4", expert_placement=placement)
    for i in model.config.moe_layers:
        be = model.model.layers[i].mlp.expert_backend
        assert be.name == "hybrid" and len(be.cpu_backend.expert_ids) == E - n
    got = model.compute_logits(model(ids, torch.arange(len(ids))))
    # fp32 throughout; only the order of the per-expert sums differs
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert str(n) in describe_placement(model) and "host memory" in describe_placement(model)


def test_cpu_experts_are_computed_by_the_cpu_backend(tmp_path):
    f = tmp_path / "counts.json"
    f.write_text(json.dumps({"layers": {"1": [0, 1, 2, 3, 4, 5, 6, 7]}}))
    model = load_tiny("int4", expert_placement=make_placement(tiny_config("int4"), 4, f))
    cpu = model.model.layers[1].mlp.expert_backend.cpu_backend
    assert cpu.expert_ids == (0, 1, 2, 3)  # the coldest by the counts
    seen = []
    wait = cpu.wait
    cpu.wait = lambda: (seen.append(wait()), seen[-1])[1]  # the CPU backend's results
    ids = _ids(30, seed=1)
    model(ids, torch.arange(len(ids)))
    assert seen and seen[0].abs().sum() > 0  # some tokens routed to a CPU expert
    # INT4 weights stay packed in host memory
    assert cpu.experts[0].gate_proj.weight_packed.dtype == torch.int32


def test_loader_puts_cpu_experts_in_host_memory(tmp_path):
    """Loading to the meta device shows the device map: CPU-placed experts' tensors are read
    into host memory, everything else goes to `device`."""
    from k2serve.weights.loader import load_model
    from k2serve.weights.make_checkpoint import make_checkpoint

    cfg = tiny_config("int4")
    make_checkpoint(tmp_path, cfg.to_hf(), seed=1, tokenizer=False, progress=False)
    p = make_placement(cfg, 5)
    model = load_model(tmp_path, dtype=torch.float32, device="meta", expert_placement=p,
                       setup_backends=False, progress=False)  # fmt: skip
    for name, t in model.state_dict().items():
        want = "cpu" if p.tensor_on_cpu(name) else "meta"
        assert t.device.type == want, name
    assert sum(p.tensor_on_cpu(n) for n in model.state_dict()) == 2 * 3 * 3 * 3  # layers,
    # experts 5..7, projections, tensors per INT4 linear


def test_recorded_routing_counts_drive_the_placement(tmp_path):
    from k2serve.moe.placement import RoutingRecorder

    model = load_tiny("int4")
    ids = _ids(25, seed=2)
    with RoutingRecorder(model) as rec:
        model(ids, torch.arange(len(ids)))
    model(ids, torch.arange(len(ids)))  # after remove(): not counted
    k = model.config.num_experts_per_tok
    assert sorted(rec.counts) == [1, 2]
    assert all(int(c.sum()) == len(ids) * k for c in rec.counts.values())
    f = tmp_path / "counts.json"
    rec.save(f)
    p = make_placement(model.config, 3, f)
    for layer, c in rec.counts.items():
        hottest = sorted(range(E), key=lambda e: (-int(c[e]), e))[:3]
        assert p.gpu_experts[layer] == tuple(sorted(hottest))
        assert set(p.cpu_experts(layer)).isdisjoint(hottest)
