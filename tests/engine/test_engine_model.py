"""The engine on a real (tiny, random-weight) Kimi-K2-architecture checkpoint: the paged MLA path
with the torch attention backend, against transformers and against itself under every
scheduling variation."""

import random

import pytest
import torch

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine
from k2serve.engine.sampling_params import SamplingParams

from .conftest import run_to_completion
from .hf_greedy import hf_greedy, hf_model

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base_engine(ckpt):
    return LLMEngine(
        EngineConfig(
            model=ckpt,
            dtype="float32",
            device="cpu",
            num_kv_pages=128,
            max_model_len=256,
            page_size=8,
        )
    )


def engine_like(base: LLMEngine, **overrides) -> LLMEngine:
    """A new engine sharing the loaded model and tokenizer of `base` (fresh cache)."""
    cfg = dict(dtype="float32", device="cpu", num_kv_pages=128, max_model_len=256, page_size=8)
    cfg.update(overrides)
    from k2serve.attention import allocate_kv_caches

    return LLMEngine(
        EngineConfig(**cfg),
        model=base.model,
        tokenizer=base.tokenizer,
        kv_cache_factory=lambda n, ps, dt, dev: allocate_kv_caches(
            base.model_config, n, ps, dt, dev
        ),
    )


def mixed_prompts(n=6, seed=0, vocab=1700):
    rng = random.Random(seed)
    lengths = [1, 3, 9, 17, 30, 45][:n]
    return [[rng.randrange(10, vocab) for _ in range(k)] for k in lengths]


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def generate(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params if isinstance(params, SamplingParams) else params[i])
    out = run_to_completion(engine)
    return [out[str(i)].outputs for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(ckpt, base_engine):
    """transformers greedy tokens for mixed_prompts()."""
    torch.manual_seed(0)
    model = hf_model(ckpt)
    return [hf_greedy(model, p, MAX_TOKENS, base_engine.eos_token_ids) for p in mixed_prompts()]


def test_batched_equals_one_at_a_time_equals_transformers(base_engine, reference):
    prompts = mixed_prompts()
    batched = [o[0].token_ids for o in generate(base_engine, prompts, greedy())]
    alone = [generate(base_engine, [p], greedy())[0][0].token_ids for p in prompts]
    assert batched == alone == reference
    assert any(len(r) == MAX_TOKENS for r in reference)


@pytest.mark.parametrize("chunk", [3, 16])
def test_chunked_prefill_equals_unchunked(base_engine, reference, chunk):
    eng = engine_like(base_engine, max_num_batched_tokens=chunk)
    got = [o[0].token_ids for o in generate(eng, mixed_prompts(), greedy())]
    assert got == reference


def test_prefix_cache_hit_equals_miss(base_engine, reference):
    eng = engine_like(base_engine)
    prompts = mixed_prompts()
    first = [o[0].token_ids for o in generate(eng, prompts, greedy())]
    eng.add_request("again", prompts[-1], greedy())
    again = run_to_completion(eng)["again"]
    assert again.num_cached_tokens == (len(prompts[-1]) - 1) // 8 * 8 > 0
    assert first == reference and again.outputs[0].token_ids == reference[-1]
    # a shared system-prompt prefix with different tails
    nocache = engine_like(base_engine, enable_prefix_caching=False)
    tails = [[11, 12], [13], [14, 15, 16]]
    ps = [prompts[-1][:24] + t for t in tails]
    hit = [o[0].token_ids for o in generate(eng, ps, greedy())]
    miss = [o[0].token_ids for o in generate(nocache, ps, greedy())]
    assert hit == miss
    assert eng.get_stats().prefix_cache_hits > 0 and nocache.get_stats().prefix_cache_hits == 0


def test_preemption_under_tiny_cache(base_engine):
    prompts = mixed_prompts()
    params = greedy(12, ignore_eos=True)
    roomy = [o[0].token_ids for o in generate(engine_like(base_engine), prompts, params)]
    tight = engine_like(base_engine, num_kv_pages=8, max_model_len=64)
    got = [o[0].token_ids for o in generate(tight, prompts, params)]
    assert tight.get_stats().num_preemptions > 0
    assert got == roomy


def test_seeded_sampling_reproducible_across_batch_compositions(base_engine):
    prompts = mixed_prompts()
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=10, ignore_eos=True
    )
    alone = generate(engine_like(base_engine), [prompts[2]], seeded)[0][0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=6)
    mix = [other, other, seeded, other, greedy(), other]
    eng = engine_like(base_engine, max_num_batched_tokens=11)
    crowd = generate(eng, prompts, mix)[2][0].token_ids
    assert crowd == alone
    different = generate(engine_like(base_engine), [prompts[2]], seeded.clone(seed=8))[0][0]
    assert different.token_ids != alone


def test_stop_string_spanning_tokens_real_tokenizer(base_engine):
    tok = base_engine.tokenizer
    prompt = mixed_prompts()[3]
    ids = generate(base_engine, [prompt], greedy(24, ignore_eos=True))[0][0].token_ids
    pieces = [tok.decode([t]) for t in ids]
    # choose a stop string from the end of one multi-char token into the next token
    k = next(
        i
        for i in range(1, len(ids) - 1)
        if len(pieces[i]) >= 2 and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]
    )
    stop = pieces[k][-1] + pieces[k + 1][:1]
    text = tok.decode(ids)
    j = text.find(stop)
    out = generate(base_engine, [prompt], greedy(24, ignore_eos=True, stop=[stop]))[0][0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:j]
    assert tok.decode(out.token_ids).startswith(text[: j + len(stop)])
