"""Speculative decoding on real (tiny, random-weight) Kimi-K2-architecture checkpoints and on the
bundled demo, float32 on the CPU: greedy output token for token the non-speculative output, with
prefix caching, chunked prefill and continuous batching; the drafts' KV slots are overwritten."""

import pytest

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine
from k2serve.engine.sampling_params import SamplingParams

from .test_spec_decode import generate

BASE = dict(dtype="float32", device="cpu", num_kv_pages=256, max_model_len=512, page_size=8)


def engine(model_dir, base=None, **kw):
    cfg = EngineConfig(model=model_dir, **dict(BASE, **kw))
    if base is None:
        return LLMEngine(cfg)
    from k2serve.attention import allocate_kv_caches

    return LLMEngine(
        cfg,
        model=base.model,
        tokenizer=base.tokenizer,
        kv_cache_factory=lambda n, ps, dt, dev: allocate_kv_caches(
            base.model_config, n, ps, dt, dev
        ),
    )


@pytest.fixture(scope="module")
def demo():
    return engine(None)


def agent_prompts(tok):
    code = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
    texts = [
        f"Here is the file:\n{code}\nNow repeat it:\n{code[:20]}",
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        "Hello",
        "user: list the files\ntool: a.py b.py c.py\nuser: list the files\ntool:",
        "abc abc abc abc abc abc",
    ]
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize(
    "spec",
    [
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 4,
        },  # fmt: skip
        {"method": "suffix", "num_speculative_tokens": 5},
    ],
)
@pytest.mark.parametrize(
    "overrides, stagger",
    [
        ({}, False),
        ({"max_num_batched_tokens": 16}, True),
        ({"enable_prefix_caching": False}, True),
        ({"flatten": True}, True),
    ],  # fmt: skip
)
def test_demo_greedy_identical(demo, spec, overrides, stagger):
    overrides = dict(overrides)
    flatten = overrides.pop("flatten", False)
    ps = agent_prompts(demo.tokenizer)
    ps = ps + ps[:2]  # prefix-cache hits on the repeats
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    ref = generate(engine(None, demo, **overrides), ps, params, stagger)
    spec_eng = engine(None, demo, speculative_config=spec, **overrides)
    spec_eng.runner.flatten_verify = flatten  # the layout of verify steps on CUDA
    got = generate(spec_eng, ps, params, stagger)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
    st = spec_eng.drafter.stats
    assert st.num_accepted_tokens > 0, st  # drafts were verified and some accepted


def test_tiny_checkpoint_greedy_identical(ckpt):
    base = engine(ckpt)
    import random

    rng = random.Random(5)
    ps = [[rng.randrange(10, 60) for _ in range(n)] for n in (3, 9, 17, 30, 45, 60)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = generate(base, ps, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    eng = engine(ckpt, base, speculative_config=spec, max_num_batched_tokens=20)
    got = generate(eng, ps, params, stagger=True)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert eng.drafter.stats.num_drafts > 0


def test_structured_outputs_with_drafts_identical(demo):
    """Drafts the grammar rejects are cut before verification, each verify row is masked with
    the matcher advanced through its drafts, and the grammar rolls back past rejected ones."""
    from k2serve.structured.params import StructuredOutputsParams as SO

    tok = demo.tokenizer
    ps = [tok.encode(t) for t in ("abc abc abc abc", "Say Paris. Paris Paris", "1 2 3 1 2 3")]
    constraints = [
        SO(regex=r"(abc ){3,6}(def )+end"),
        SO(
            json={
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            }
        ),  # fmt: skip
        SO(choice=["1 2 3 1 2 3 1 2 3", "4 5 6"]),
        SO(regex=r"[a-z ]{0,40}", after_reasoning=True),
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    spec_eng = engine(None, demo, speculative_config=spec)
    plain = engine(None, demo)
    for so in constraints:
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
        ref = generate(plain, ps, params)
        got = generate(spec_eng, ps, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref], so
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in ref
        ]
    assert spec_eng.drafter.stats.num_accepted_tokens > 0


def test_demo_eagle3_draft_is_accepted(demo):
    """The bundled demo draft (scripts/train_demo_eagle3.py) is a real draft: greedy output
    identical to no speculation, and most first drafts accepted on demo conversations."""
    import random

    from k2serve.demo import demo_eagle3_path
    from k2serve.demo.conversations import sample_example

    tok = demo.tokenizer
    rng = random.Random(7)
    ps = []
    for _ in range(8):
        msgs, tools, thinking, _ = sample_example(rng)
        text = tok.apply_chat_template(
            msgs, tools=tools, chat_template_kwargs={"thinking": thinking}
        )
        ps.append(tok.encode(text, allow_special=True))
    spec = {"method": "eagle3", "model": str(demo_eagle3_path()), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=48)
    ref = generate(engine(None, demo), ps, params)
    eng = engine(None, demo, speculative_config=spec)
    got = generate(eng, ps, params, stagger=True)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    st = eng.drafter.stats
    assert st.mean_acceptance_length > 1.5, st
    assert st.num_accepted_tokens_per_pos[0] > st.num_drafts / 2, st
