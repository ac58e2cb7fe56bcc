"""The setup pipeline's backends from the engine config; the runner's decode CUDA graphs vs
eager (GPU)."""

from __future__ import annotations

import pytest
import torch

from k2serve.engine.config import EngineConfig
from k2serve.engine.runner import ModelRunner
from k2serve.engine.setup import expert_placement, setup_rank

from .conftest import load_tiny, needs_cuda


def test_setup_applies_the_configured_placement_and_the_cpu_runner_is_eager():
    model = load_tiny("int4")
    cfg = EngineConfig(device="cpu", num_gpu_experts=3, moe_backend="torch", page_size=4)
    rank = setup_rank(cfg.replace(num_kv_pages=8), torch.device("cpu"), model_dir=None,
                      model=model)  # fmt: skip
    assert rank.model is model and len(rank.kv_caches) == model.config.num_hidden_layers
    assert rank.kv_caches[0].shape[:2] == (8, 4)
    assert (rank.spec.num_kv_pages, rank.spec.max_model_len) == (8, 32)  # shrunk to the cache
    assert rank.spec.placement is model.expert_placement
    runner = ModelRunner(model, rank.kv_caches, rank.spec)
    assert runner.graph_runner is None
    assert model.has_cpu_experts
    for i in model.config.moe_layers:
        be = model.model.layers[i].mlp.expert_backend
        assert be.name == "hybrid" and be.gpu_expert_ids == (0, 1, 2)
    assert expert_placement(EngineConfig(), model.config) is None


def _greedy_tokens(engine, prompts, max_tokens=10):
    from k2serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    toks = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            toks[out.request_id].extend(out.outputs[0].token_ids)
    engine.check_integrity()
    return toks


@pytest.mark.gpu
@needs_cuda
def test_decode_graphs_give_the_eager_tokens_and_are_replayed():
    from k2serve.engine.engine import LLMEngine

    model = load_tiny("int4", dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1)]
    cfg = EngineConfig(device="cuda", num_kv_pages=64, page_size=16, max_model_len=256,
                       max_num_seqs=8)  # fmt: skip
    eng = LLMEngine(cfg, model=model)
    gr = eng.runner.graph_runner
    assert gr is not None and 8 in gr.graphs and 1 in gr.graphs
    replays = []
    run = gr.run
    gr.run = lambda ids, pos, md: (replays.append(gr.bucket_for(md)), run(ids, pos, md))[1]
    graphed = _greedy_tokens(eng, prompts)
    assert any(b is not None for b in replays)  # decode steps went through a graph
    eager_eng = LLMEngine(cfg, model=model)
    eager_eng.runner.graph_runner = None
    eager = _greedy_tokens(eager_eng, prompts)
    assert graphed == eager


@pytest.mark.gpu
@needs_cuda
def test_enforce_eager_captures_nothing():
    model = load_tiny(dtype=torch.bfloat16, device="cuda")
    cfg = EngineConfig(device="cuda", enforce_eager=True, num_kv_pages=8, page_size=16)
    rank = setup_rank(cfg, torch.device("cuda"), model_dir=None, model=model)
    assert ModelRunner(model, rank.kv_caches, rank.spec).graph_runner is None


def test_decode_graph_safe_follows_the_attention_backend():
    from k2serve.attention import TorchMLABackend
    from k2serve.attention.triton_mla import TritonMLABackend

    model = load_tiny()
    model.set_attn_backend(TorchMLABackend())
    assert not model.decode_graph_safe  # host syncs: the runner must not capture it
    model.set_attn_backend(TritonMLABackend())
    assert model.decode_graph_safe


@pytest.mark.gpu
@needs_cuda
def test_fp8_kv_cache_engine_uses_decode_graphs():
    """An fp8 cache is read by the Triton MLA backend on CUDA, which is graph-safe: the runner
    captures decode graphs for it, and greedy decoding runs."""
    from k2serve.engine.engine import LLMEngine

    model = load_tiny(dtype=torch.bfloat16, device="cuda")
    cfg = EngineConfig(device="cuda", kv_cache_dtype="fp8", num_kv_pages=64, page_size=16,
                       max_model_len=256, max_num_seqs=8)  # fmt: skip
    eng = LLMEngine(cfg, model=model)
    assert eng.runner.graph_runner is not None
    toks = _greedy_tokens(eng, [[5, 6, 7], [9] * 20], max_tokens=6)
    assert all(len(t) == 6 for t in toks.values())
