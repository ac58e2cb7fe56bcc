"""EAGLE-3 drafting on a tiny random Kimi-K2-architecture target (float32, CPU), with random
draft heads in both published layouts written by `weights.eagle3`: greedy output identical to
no speculation (chunked prefill, continuous batching, prefix caching), the engine's drafts equal
a from-scratch recomputation of the head over the whole sequence (so the draft's paged KV, its
positions and the auxiliary hidden states are right), and bad drafts are start-up errors."""

import json
import os

import pytest
import torch

from k2serve.attention import allocate_kv_caches
from k2serve.attention.base import AttentionMetadata
from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine
from k2serve.engine.sampling_params import SamplingParams
from k2serve.weights.eagle3 import write_eagle3_checkpoint

from .test_spec_decode import generate

BASE = dict(dtype="float32", device="cpu", num_kv_pages=256, max_model_len=512, page_size=8)
LAYOUTS = [("llama", False, None, False), ("mla", False, 700, False), ("llama", True, 900, False),
           ("mla", True, None, True)]  # fmt: skip


@pytest.fixture(scope="module")
def target(ckpt):
    return LLMEngine(EngineConfig(model=ckpt, **BASE))


def like(base, **kw):
    return LLMEngine(
        EngineConfig(**dict(BASE, **kw)),
        model=base.model,
        tokenizer=base.tokenizer,
        kv_cache_factory=lambda n, ps, dt, dev: allocate_kv_caches(
            base.model_config, n, ps, dt, dev
        ),
    )


def draft_dir(tmp_path, target, layout, eagle31, dv, fused):
    d = str(tmp_path / f"draft-{layout}-{eagle31}-{dv}-{fused}")
    write_eagle3_checkpoint(d, target.model_config, layout, eagle31=eagle31, draft_vocab_size=dv,
                            seed=1, fused_qkv_a=fused)  # fmt: skip
    return d


def eagle_engine(target, d, k=3, **kw):
    spec = {"method": "eagle3", "model": d, "num_speculative_tokens": k}
    return like(target, speculative_config=spec, **kw)


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (1, 5, 13, 29, 40)]


@pytest.mark.parametrize("layout, eagle31, dv, fused", LAYOUTS)
def test_greedy_identical_and_drafts_verified(tmp_path, target, layout, eagle31, dv, fused):
    d = draft_dir(tmp_path, target, layout, eagle31, dv, fused)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ps = prompts() + prompts()[3:]  # repeats: prefix-cache hits
    ref = generate(like(target), ps, params)
    eng = eagle_engine(target, d, max_num_batched_tokens=24)
    eng.runner.flatten_verify = fused  # one case in the CUDA layout of verify steps
    assert eng.drafter.eagle.head.config.eagle31 == eagle31
    got = generate(eng, ps, params, stagger=True)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    st = eng.drafter.stats
    assert st.num_drafts > 20 and st.num_draft_tokens > 2 * st.num_drafts


def _reference_drafts(eng, tokens: list[int], k: int) -> list[int]:
    """The head run from scratch over the whole sequence (one chunk, a fresh cache)."""
    prop = eng.drafter.eagle
    head, model = prop.head, eng.model
    P = len(tokens) - 1
    model(torch.tensor(tokens[:P]), torch.arange(P))  # no cache: one causal sequence
    hidden = head.combine_aux(model.aux_hidden_states)  # [P, H]
    cache = head.new_kv_cache(8, 64, prop.kv_cache.dtype, "cpu")

    def md(start, n):
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            context_lens=torch.tensor([start], dtype=torch.int32),
            block_table=torch.arange(8, dtype=torch.int32)[None],
            slot_mapping=torch.arange(start, start + n), max_query_len=n,
            max_seq_len=start + n, page_size=64, num_decodes=int(n == 1),
        )  # fmt: skip

    emb = model.model.embed_tokens
    normed, h = head(emb(torch.tensor(tokens[1:])), hidden, torch.arange(P), md(0, P), cache)
    out = [int(head.draft_tokens(normed[-1:])[0])]
    h = h[-1:]
    for j in range(2, k + 1):
        pos = P + j - 2
        normed, h = head(emb(torch.tensor(out[-1:])), h, torch.tensor([pos]), md(pos, 1), cache)
        out.append(int(head.draft_tokens(normed)[0]))
    return out


@pytest.mark.parametrize("layout", ["llama", "mla"])
def test_engine_drafts_equal_reference_recomputation(tmp_path, target, layout):
    d = draft_dir(tmp_path, target, layout, False, 600, False)
    eng = eagle_engine(target, d, k=4, max_num_batched_tokens=16)  # prompts prefill in chunks
    eng.runner.flatten_verify = layout == "mla"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts()[1:]):
        eng.add_request(str(i), p, params)
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_integrity()
        for r in eng.scheduler.running:
            if r.spec_token_ids and checked < 12:
                assert r.spec_token_ids == _reference_drafts(
                    eng, r.all_token_ids, len(r.spec_token_ids)
                ), r
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda c: c.update(hidden_size=64, target_hidden_size=64), "hidden"),
        (lambda c: c.update(vocab_size=4096), "vocab"),
        (
            lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 9]),
            "layer ids",
        ),
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "EAGLE-3"),
        (lambda c: c.update(intermediate_size=100), "shape"),
    ],
)
def test_bad_draft_is_a_startup_error(tmp_path, target, edit, why):
    d = draft_dir(tmp_path, target, "llama", False, None, False)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=why):
        eagle_engine(target, d)


def test_draft_kv_is_counted_in_the_cache_budget(tmp_path, target):
    d = draft_dir(tmp_path, target, "mla", False, None, False)
    kw = dict(BASE, num_kv_pages=None, kv_cache_memory=4 * 2**20)
    plain = like(target, **kw)
    eng = like(target, speculative_config={"method": "eagle3", "model": d,
                                           "num_speculative_tokens": 2}, **kw)  # fmt: skip
    # one extra latent layer per page: (L + 1) / L of the target's bytes per page
    layers = target.model_config.num_hidden_layers
    assert eng.kv.num_pages == plain.kv.num_pages * layers // (layers + 1)
    budget = eng.kv.num_pages * (layers + 1) * eng.drafter.eagle.kv_cache[0].numel() * 4
    assert budget <= 4 * 2**20


def test_paged_gqa_equals_dense_causal_attention():
    from k2serve.model.eagle3 import paged_gqa

    g = torch.Generator().manual_seed(0)
    H, KVH, D, ps = 4, 2, 8, 4
    lens, news = [7, 3, 10], [2, 3, 1]  # sequence lengths and new tokens at their ends
    flat = torch.zeros(64, 2, KVH, D)
    pages = [[5, 1], [2], [7, 3, 9]]
    dense_k, dense_v = [], []
    for n, pg in zip(lens, pages, strict=True):
        k, v = torch.randn(n, KVH, D, generator=g), torch.randn(n, KVH, D, generator=g)
        pos = torch.arange(n)
        slots = torch.tensor(pg)[pos // ps] * ps + pos % ps
        flat[slots, 0], flat[slots, 1] = k, v
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(news), H, D, generator=g)
    table = torch.tensor([p + [0] * (3 - len(p)) for p in pages], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    md = AttentionMetadata(qsl, torch.tensor(lens, dtype=torch.int32),
                           torch.tensor([n - t for n, t in zip(lens, news, strict=True)],
                                        dtype=torch.int32),
                           table, torch.zeros(6, dtype=torch.long), 3, 10, ps)  # fmt: skip
    out = paged_gqa(q, flat, md)
    for b, (n, t) in enumerate(zip(lens, news, strict=True)):
        for i in range(t):
            qi = q[int(qsl[b]) + i]  # [H, D]
            seen = n - t + i + 1
            k = dense_k[b][:seen].repeat_interleave(H // KVH, 1)  # [seen, H, D]
            v = dense_v[b][:seen].repeat_interleave(H // KVH, 1)
            p = torch.softmax(torch.einsum("hd,shd->hs", qi, k) / D**0.5, dim=-1)
            torch.testing.assert_close(out[int(qsl[b]) + i], torch.einsum("hs,shd->hd", p, v))
