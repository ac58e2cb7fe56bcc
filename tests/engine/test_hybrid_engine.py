"""Hybrid experts through the engine: every placement gives the all-on-one greedy tokens;
`record_routing` writes a counts file that round-trips into a placement (and into `plan`);
`dynamic_expert_placement` moves experts while serving and keeps the tokens."""

import json

import pytest
import torch

from k2serve import LLM, SamplingParams
from k2serve.config import ModelConfig
from k2serve.moe import make_placement

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 100, 42], [11, 12, 13], list(range(40, 70))]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _llm(ckpt, **kw):
    args = dict(dtype="float32", device="cpu", max_model_len=64, page_size=16, num_kv_pages=32)
    args.update(kw)
    return LLM(ckpt, **args)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def reference(ckpt):
    return _tokens(_llm(ckpt))


@pytest.mark.parametrize("n_gpu", [0, 2])
@pytest.mark.parametrize("threshold", [None, 8])
def test_every_placement_gives_the_all_on_one_greedy_tokens(ckpt, reference, n_gpu, threshold):
    """threshold 8: prompts of 8+ tokens stream the CPU experts (layer-wise prefill)."""
    llm = _llm(ckpt, num_gpu_experts=n_gpu, gpu_prefill_token_threshold=threshold)
    assert llm.llm_engine.model.has_cpu_experts
    lw = getattr(llm.llm_engine.model, "layerwise_prefill", None)
    assert (lw is not None) == (threshold is not None)
    assert _tokens(llm) == reference
    assert lw is None or lw.copies > 0
    llm.llm_engine.check_integrity()


def test_record_routing_writes_a_counts_file_that_drives_the_placement(ckpt, tmp_path):
    f = tmp_path / "routing.json"
    llm = _llm(ckpt, record_routing=str(f))
    _tokens(llm)
    assert not f.exists() or json.loads(f.read_text())  # flushed at most once a minute
    llm.llm_engine.shutdown()  # ... and at shutdown
    data = json.loads(f.read_text())
    mc = ModelConfig.from_hf(ckpt)
    k = mc.num_experts_per_tok
    # every token of every step was routed once per MoE layer, k experts each
    n_tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert sorted(int(x) for x in data["layers"]) == list(mc.moe_layers)
    for counts in data["layers"].values():
        assert sum(counts) == n_tokens * k
    p = make_placement(mc, 2, f)
    for layer, counts in data["layers"].items():
        top = sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:2]
        assert p.gpu_experts[int(layer)] == tuple(sorted(top))
    llm2 = _llm(ckpt, num_gpu_experts=2, expert_placement_file=str(f))
    assert llm2.llm_engine.model.expert_placement.gpu_experts == p.gpu_experts


@pytest.mark.parametrize("threshold", [None, 8])
def test_dynamic_placement_moves_experts_and_keeps_the_tokens(ckpt, reference, threshold):
    llm = _llm(ckpt, num_gpu_experts=1, dynamic_expert_placement=True,
               expert_placement_interval=2, gpu_prefill_token_threshold=threshold)  # fmt: skip
    model = llm.llm_engine.model
    before = dict(model.expert_placement.gpu_experts)
    assert _tokens(llm) == reference
    placer = llm.llm_engine.runner.routing.placer
    assert placer.steps >= 2
    after = model.expert_placement.gpu_experts
    assert after != before  # the hottest expert of some layer was not expert 0
    for layer, gpu in after.items():
        be = model.model.layers[layer].mlp.expert_backend
        assert tuple(sorted(be.gpu_expert_ids)) == gpu
        assert set(be.cpu_backend.expert_ids) == set(range(model.config.n_routed_experts)) - set(
            gpu
        )
    assert _tokens(llm) == reference  # and the moved experts compute the same tokens


def test_flags_parse_and_bad_values_are_named():
    import argparse

    from k2serve.engine.config import EngineConfig

    ap = argparse.ArgumentParser()
    EngineConfig.add_cli_args(ap)
    argv = (
        "--record-routing r.json --dynamic-expert-placement --num-gpu-experts 2 "
        "--gpu-prefill-token-threshold 4096 --expert-placement-interval 50"
    )
    args = ap.parse_args(argv.split())
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.record_routing, cfg.dynamic_expert_placement) == ("r.json", True)
    assert (cfg.gpu_prefill_token_threshold, cfg.expert_placement_interval) == (4096, 50)
    for bad, match in (
        (dict(gpu_prefill_token_threshold=-1), "gpu_prefill_token_threshold"),
        (dict(dynamic_expert_placement=True), "needs num_gpu_experts"),
        (dict(expert_placement_interval=0), "expert_placement_interval"),
        (dict(record_routing="r.json", tensor_parallel_size=2), "-tp 1"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
