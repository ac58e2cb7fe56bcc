"""The engine wires the config into the model: KV cache dtype (sized by the planner's formula and
allocated in that dtype), expert placement (given to the loader), backends (the runner gets the
config), and shutdown."""

import pytest
import torch

from k2serve import LLM, SamplingParams
from k2serve.config import ModelConfig
from k2serve.moe.placement import describe_placement

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 99, 3, 100, 42], [11, 12, 13]]


def _llm(ckpt, **kw):
    args = dict(dtype="float32", device="cpu", max_model_len=64, page_size=16)
    args.update(kw)
    return LLM(ckpt, **args)


def _cache_tokens(llm) -> int:
    s = llm.llm_engine.get_stats()
    return s.kv_pages_total * llm.llm_engine.config.page_size


def test_kv_cache_dtype_sizes_and_allocates_the_cache(ckpt):
    mc = ModelConfig.from_hf(ckpt)
    # the latent cache holds kv_lora_rank + rope dims per layer per token
    fp32_token = mc.num_hidden_layers * (mc.kv_lora_rank + mc.qk_rope_head_dim) * 4
    budget = fp32_token * 16 * 5  # 5 pages of fp32 (the model's dtype here)
    tokens = {}
    for kv in ("auto", "bf16", "fp8"):
        llm = _llm(ckpt, kv_cache_dtype=kv, kv_cache_memory=budget)
        tokens[kv] = _cache_tokens(llm)
        caches = llm.llm_engine.runner.kv_caches
        want = {"auto": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv]
        assert {c.dtype for c in caches} == {want}
        assert caches[0].shape[0] == llm.llm_engine.get_stats().kv_pages_total
        if kv == "fp8":
            # the model reads the fp8 cache (backend chosen for it), and generates
            spec = llm.llm_engine.spec
            assert spec.kv_cache_dtype == spec.backends.kv_cache_dtype == torch.float8_e4m3fn
            outs = llm.generate(PROMPTS, GREEDY)
            for o in outs:
                assert len(o.outputs[0].token_ids) == GREEDY.max_tokens
                assert torch.isfinite(torch.tensor(o.outputs[0].cumulative_logprob))
            llm.llm_engine.check_integrity()
    assert tokens == {"auto": 5 * 16, "bf16": 10 * 16, "fp8": 20 * 16}


def test_num_gpu_experts_reaches_the_loader_and_the_model(ckpt, monkeypatch):
    import k2serve.weights.loader as loader

    seen = {}
    real = loader.load_model

    def spy(*a, **kw):
        seen["placement"] = kw.get("expert_placement")
        return real(*a, **kw)

    monkeypatch.setattr(loader, "load_model", spy)
    mc = ModelConfig.from_hf(ckpt)
    E = mc.n_routed_experts
    llm = _llm(ckpt, num_gpu_experts=1, num_kv_pages=16)
    model = llm.llm_engine.model
    # the loader got the placement (CPU experts never allocated on the device) ...
    p = seen["placement"]
    assert p is not None and not p.all_on_gpu
    assert all(len(v) == 1 for v in p.gpu_experts.values())
    assert set(p.gpu_experts) == set(mc.moe_layers)
    # ... and the model runs with it
    assert model.expert_placement is p and model.has_cpu_experts
    assert f"1 of {E} per MoE layer" in describe_placement(model)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    ref = [o.outputs[0].token_ids for o in _llm(ckpt, num_kv_pages=16).generate(PROMPTS, GREEDY)]
    assert got == ref  # on the CPU both placements compute the same experts

    # no flag: no placement, every expert on the model's device
    assert _llm(ckpt, num_kv_pages=16).llm_engine.model.expert_placement is None
    assert seen["placement"] is None


def test_runner_gets_the_resolved_spec(ckpt):
    llm = _llm(ckpt, num_kv_pages=16, attention_backend="torch", moe_backend="torch")
    s = llm.llm_engine.spec.backends
    assert (s.attention, s.moe) == ("torch", "torch")
    assert llm.llm_engine.runner.spec is llm.llm_engine.spec
    # no --max-model-len: resolved once (the model's maximum, within the cache) and what the
    # runner reads, so graph block tables are sized from it, not from None
    eng = _llm(ckpt, max_model_len=None, num_kv_pages=3).llm_engine
    want = min(eng.model_config.max_position_embeddings, 3 * 16)
    assert eng.runner.spec.max_model_len == eng.max_model_len == want
    assert eng.runner.spec.max_pages_per_seq == -(-want // 16)
    with pytest.raises(ValueError, match="triton"):  # asked for, so tried, and refused on CPU
        _llm(ckpt, num_kv_pages=16, attention_backend="triton")


def test_shutdown_without_workers_is_a_no_op_and_idempotent(ckpt):
    with _llm(ckpt, num_kv_pages=16) as llm:
        assert llm.generate([1, 2, 3], SamplingParams(max_tokens=2)).__len__() == 1
    llm.close()
    llm.llm_engine.shutdown()


def test_failed_construction_leaves_a_safe_finalizer(ckpt):
    import gc
    import sys

    raised = []
    old, sys.unraisablehook = sys.unraisablehook, raised.append
    try:
        with pytest.raises(ValueError, match="num_gpu_experts"):
            _llm(ckpt, num_gpu_experts=99)
        gc.collect()
    finally:
        sys.unraisablehook = old
    assert raised == []
