"""Sharding without processes: shapes, what each rank keeps, the loader's slices, and the
errors for sizes that do not split."""

import pytest
import torch

from k2serve.config import ModelConfig
from k2serve.distributed import ShardingError, shard_model
from k2serve.distributed.parallel import ParallelMoE
from k2serve.weights.loader import build_meta_model, load_model
from k2serve.weights.presets import preset_config

from .conftest import small_config


def _config(fmt="bf16", **overrides) -> dict:
    """bf16 / int4: the small test shape; fp8: the tiny preset (64-wide heads, so 2 heads per
    rank fill one 128-wide FP8 block) with experts wide enough to split in whole blocks."""
    if fmt == "fp8":
        cfg = preset_config("tiny", "fp8")
        cfg.update(moe_intermediate_size=256, n_routed_experts=8, num_hidden_layers=2)
        cfg.update(overrides)
        return cfg
    return small_config(fmt, **overrides)


def _meta(fmt="bf16", **overrides):
    return build_meta_model(ModelConfig.from_hf(_config(fmt, **overrides)), torch.float32)


@pytest.mark.parametrize("fmt", ["bf16", "int4", "fp8"])
def test_shapes_and_ownership(fmt):
    c = ModelConfig.from_hf(_config(fmt))
    full = _meta(fmt)
    full_sd = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    W = 2
    kept = []
    for rank in range(W):
        m = _meta(fmt)
        plan = shard_model(m, rank, W, expert_parallel=True)
        attn = m.model.layers[0].self_attn
        assert attn.num_heads == c.num_attention_heads // W
        assert attn.q_b_proj.out_features == c.num_attention_heads // W * c.qk_head_dim
        assert attn.o_proj.in_features == c.num_attention_heads // W * c.v_head_dim
        assert attn.kv_a_proj_with_mqa.out_features == c.kv_lora_rank + c.qk_rope_head_dim
        moe = m.model.layers[1].mlp
        assert isinstance(moe, ParallelMoE) and len(moe.experts) == c.n_routed_experts // W
        names = set(m.state_dict())
        experts = {n.split(".")[5] for n in names if ".mlp.experts." in n and "layers.1." in n}
        assert experts == {str(e) for e in range(rank * 4, rank * 4 + 4)}
        assert not names & plan.dropped and names | plan.dropped <= set(full_sd) | names
        kept.append(experts)
    assert kept[0].isdisjoint(kept[1])


def _bytes(m) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("ep", [False, True])
def test_loader_reads_each_ranks_slice(ckpts, fmt, ep):
    """Each rank's loaded tensors are exactly its slices of the full model's tensors, and the
    two shards hold the full model once plus the replicated tensors a second time."""
    full = load_model(ckpts[fmt], dtype=torch.float32, progress=False)
    full_sd = full.state_dict()
    total, names, split = 0, [], set()
    for rank in range(2):
        m = load_model(ckpts[fmt], dtype=torch.float32, progress=False, tp_rank=rank, tp_size=2,
                       expert_parallel=ep)  # fmt: skip
        plan = m.tp_plan
        for name, t in m.state_dict().items():
            if name in plan.local_values:  # int4 weight_shape: the local [out, in]
                lin = m.get_submodule(name.rsplit(".", 1)[0])
                assert t.tolist() == [lin.out_features, lin.in_features]
                continue
            want = full_sd[name]
            if name in plan.splits:
                dim, start, stop = plan.splits[name]
                assert stop - start == want.shape[dim] // 2
                want = want.narrow(dim, start, stop - start)
            assert torch.equal(t, want), name
        total += _bytes(m)
        names.append(set(m.state_dict()))
        split |= set(plan.splits)
    replicated = (names[0] & names[1]) - split
    assert any(".experts." in n for n in split) != ep  # EP keeps experts whole
    extra = sum(full_sd[n].numel() * full_sd[n].element_size() for n in replicated)
    assert total == _bytes(full) + extra


def test_dummy_shards_are_slices_of_the_single_process_dummy():
    cfg = ModelConfig.from_hf(small_config("int4"))
    full = load_model(None, config=cfg, load_format="dummy", dtype=torch.float32, progress=False)
    m = load_model(None, config=cfg, load_format="dummy", dtype=torch.float32, progress=False,
                   tp_rank=1, tp_size=2, expert_parallel=True)  # fmt: skip
    full_sd = full.state_dict()
    for name, t in m.state_dict().items():
        if name in m.tp_plan.splits:
            dim, start, stop = m.tp_plan.splits[name]
            assert torch.equal(t, full_sd[name].narrow(dim, start, stop - start)), name
        elif name not in m.tp_plan.local_values:
            assert torch.equal(t, full_sd[name]), name


@pytest.mark.parametrize(
    ("fmt", "overrides", "world", "ep", "field"),
    [
        ("bf16", {}, 3, False, "num_attention_heads=4"),
        ("bf16", {"n_routed_experts": 6}, 4, True, "n_routed_experts=6"),
        ("fp8", {"moe_intermediate_size": 128}, 2, False, "moe_intermediate_size=128"),  # 64 rows
        ("fp8", {"moe_intermediate_size": 128}, 2, True, "n_shared_experts=1"),  # shared: 64 rows
        ("int4", {"moe_intermediate_size": 96}, 2, False, "moe_intermediate_size=96"),  # 48 cols
        ("bf16", {"intermediate_size": 255}, 2, False, "intermediate_size=255"),
    ],
)
def test_sizes_that_do_not_split_name_the_field(fmt, overrides, world, ep, field):
    m = _meta(fmt, **overrides)
    with pytest.raises(ShardingError, match=field.replace("(", r"\(")) as e:
        shard_model(m, 0, world, expert_parallel=ep)
    assert f"tensor_parallel_size={world}" in str(e.value)


def test_llm_refuses_a_shape_that_does_not_split(tmp_path):
    """The error comes from rank 0's load, before any worker is started."""
    import json

    from k2serve import LLM

    (tmp_path / "config.json").write_text(json.dumps(_config("fp8", moe_intermediate_size=128)))
    with pytest.raises(ShardingError, match="moe_intermediate_size"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", tensor_parallel_size=2,
            num_kv_pages=8)  # fmt: skip


def test_fused_gate_up_of_a_shard_splits_at_the_shard_width():
    """fuse_projections after sharding (what every rank does on CUDA): the fused dense-MLP
    forward of a rank's shard equals the unfused one, so the split width is the shard's
    (run on 2 H200s found it split at the full intermediate_size)."""
    cfg = ModelConfig.from_hf(small_config("bf16"))
    m = load_model(None, config=cfg, load_format="dummy", dtype=torch.float32, progress=False,
                   tp_rank=1, tp_size=2)  # fmt: skip
    mlp = m.model.layers[0].mlp
    assert mlp.gate_proj.out_features == cfg.intermediate_size // 2
    mlp.down_proj = torch.nn.Identity()
    x = torch.randn(3, cfg.hidden_size)
    want = mlp.forward(x)  # silu(gate) * up of this rank's half, unfused (.forward: no all-reduce)
    assert mlp.fuse_projections()
    torch.testing.assert_close(mlp.forward(x), want)
