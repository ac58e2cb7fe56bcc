"""Speculative decoding on CUDA (skipped without it): verify tokens laid out as one-token
sequences replay the decode CUDA graphs, EAGLE-3 graphs recaptured with the auxiliary hidden
states; greedy output equals speculation off."""

import pytest
import torch

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine
from k2serve.engine.sampling_params import SamplingParams
from k2serve.weights.eagle3 import write_eagle3_checkpoint

from .test_spec_decode import generate
from .test_spec_decode_model import check_peaked_identical, peaked_reference, preset_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype, backend", [("float32", "torch"), ("bfloat16", "auto")])
@pytest.mark.parametrize("method", ["ngram", "eagle3-mla", "eagle3-llama"])
def test_cuda_greedy_identical(ckpt, tmp_path, method, dtype, backend):
    base = dict(model=ckpt, device="cuda", dtype=dtype, attention_backend=backend,
                num_kv_pages=256, max_model_len=512, page_size=16, max_num_seqs=8)  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method.startswith("eagle3"):
        plain = LLMEngine(EngineConfig(**base))
        d = str(tmp_path / method)
        write_eagle3_checkpoint(d, plain.model_config, method.split("-")[1], draft_vocab_size=700)
        spec = {"method": "eagle3", "model": d, "num_speculative_tokens": 3}
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(10, 60, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 45, 60)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = generate(LLMEngine(EngineConfig(**base)), ps, params)
    eng = LLMEngine(EngineConfig(**base, speculative_config=spec))
    assert eng.runner.flatten_verify
    if backend == "auto":
        assert eng.runner.graph_runner is not None
    got = generate(eng, ps, params, stagger=True)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert eng.drafter.stats.num_drafts > 0


# ---- the peaked k2-slice in bf16 (weights.random_init.peak_logits) --------------------------
@pytest.fixture(scope="module")
def peaked_ref(tmp_path_factory):
    """(model dir, prompts, params, speculation-off outputs, model config): k2-slice INT4, 2
    layers (1 dense + 1 MoE at real K2 sizes), bf16, CUDA graphs."""
    path = preset_dir(tmp_path_factory.mktemp("k2slice"), "k2-slice", 2)
    return peaked_reference(path, "cuda")


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle3-mla", "eagle3-llama"])
def test_peaked_k2_slice_bf16_greedy_identical(peaked_ref, tmp_path, method):
    """Speculative output equals speculation off token for token for every drafter
    (model-free drafts accepted here, the random EAGLE-3 heads' drafts mostly rejected)."""
    eng = check_peaked_identical(peaked_ref, tmp_path, method, "cuda")
    # K=3: one request's 1 + k rows (k = 0..3) each replay their own graph, no padding row
    assert {1, 2, 3, 4} <= set(eng.runner.graph_runner.buckets)
    if method.startswith("eagle3"):  # the draft's one-token steps replayed CUDA graphs
        g = eng.drafter.eagle.graphs
        assert g is not None and g.num_replays > 0


@pytest.mark.parametrize("head", ["mla", "llama"])
def test_cuda_draft_graphs_equal_eager_float32(ckpt, tmp_path, monkeypatch, head):
    """float32, CUDA graphs on for the target: the EAGLE-3 draft's graphs (default) propose
    exactly what the eager head proposes (K2SERVE_EAGLE_GRAPHS=0), step by step over a
    continuous-batching run, so the acceptance is identical; greedy output equals speculation
    off either way."""
    from .test_spec_decode_eagle_graphs import _record

    base = dict(model=ckpt, device="cuda", dtype="float32", num_kv_pages=256,
                max_model_len=512, page_size=16, max_num_seqs=6)  # fmt: skip
    plain = LLMEngine(EngineConfig(**base))
    d = str(tmp_path / head)
    write_eagle3_checkpoint(d, plain.model_config, head, draft_vocab_size=700, seed=1)
    spec = {"method": "eagle3", "model": d, "num_speculative_tokens": 3}
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(10, 60, (n,), generator=g).tolist() for n in (1, 3, 9, 17, 30, 45, 60, 7)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in generate(plain, ps, params)]
    runs = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("K2SERVE_EAGLE_GRAPHS", graphs)
        eng = LLMEngine(EngineConfig(**base, speculative_config=spec))
        assert eng.runner.graph_runner is not None
        log = _record(eng)
        got = generate(eng, ps, params, stagger=True)
        assert [o.outputs[0].token_ids for o in got] == ref
        runs[graphs] = eng, log
    (eager, eager_log), (graph, graph_log) = runs["0"], runs["1"]
    assert eager.drafter.eagle.graphs is None
    gr = graph.drafter.eagle.graphs
    assert gr is not None and gr.num_replays > len(graph_log)
    se, sg = eager.drafter.stats, graph.drafter.stats
    assert (sg.num_drafts, sg.num_draft_tokens, sg.num_accepted_tokens_per_pos) == (
        se.num_drafts,
        se.num_draft_tokens,
        se.num_accepted_tokens_per_pos,
    )
    assert graph_log == eager_log
