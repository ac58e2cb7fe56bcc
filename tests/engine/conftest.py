import asyncio
import time

import pytest
from hypothesis import strategies as st

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine

from .fakes import VOCAB, FakeModel, FakeTokenizer, fake_kv_caches


def make_fake_engine(tokenizer=True, **overrides) -> LLMEngine:
    kw = dict(num_kv_pages=64, page_size=4, max_model_len=256, max_num_batched_tokens=64)
    kw.update(overrides)
    return LLMEngine(
        EngineConfig(**kw),
        model=FakeModel(),
        tokenizer=FakeTokenizer() if tokenizer else None,
        kv_cache_factory=fake_kv_caches,
    )


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until idle; returns request_id -> cumulative RequestOutput; checks integrity each
    step."""
    done: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id in done:
                done[out.request_id].merge(out)
            else:
                done[out.request_id] = out
        engine.check_integrity()
    else:
        raise AssertionError("engine did not finish")
    engine.check_integrity()
    assert engine.kv.pool.num_used_pages == 0
    return done


def drive(eng: LLMEngine, reqs, max_steps: int = 5000) -> dict:
    """reqs: (prompt, params, arrival step, abort step or None). Steps until idle, checking
    the cache after every step; -> request id -> merged RequestOutput."""
    outputs: dict = {}
    step = 0
    last = max([0] + [r[2] for r in reqs] + [r[3] or 0 for r in reqs])
    while step < max_steps:
        for i, (prompt, params, arrival, abort_at) in enumerate(reqs):
            if arrival == step:
                eng.add_request(str(i), prompt, params)
            if abort_at is not None and arrival <= abort_at == step:
                eng.abort_request(str(i))
        for out in eng.step():
            if out.request_id in outputs:
                outputs[out.request_id].merge(out)
            else:
                outputs[out.request_id] = out
        eng.check_integrity()
        step += 1
        if step > last and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert eng.kv.pool.num_used_pages == 0
    assert not eng.pipeline or not eng.pipeline.busy
    eng.check_integrity()
    return outputs


@pytest.fixture
def fake_engine():
    engines = []

    def make(**kw):
        e = make_fake_engine(**kw)
        engines.append(e)
        return e

    yield make
    for e in engines:  # every test ends with a consistent cache
        e.check_integrity()


@pytest.fixture(scope="session")
def ckpt(tiny_ckpt):
    """The tiny model made smaller still (CI time): 2 layers (1 dense + 1 MoE), 4 experts."""
    return tiny_ckpt("bf16", seed=3, num_hidden_layers=2, n_routed_experts=4)


@st.composite
def engine_configs(draw) -> dict:
    """EngineConfig settings for the random-workload property tests: page sizes 1-8, pools
    small enough to preempt, prefix caching and chunked prefill on or off, tight budgets."""
    ps = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(16, 48))
    min_pages = -(-max_model_len // ps)
    chunked = draw(st.booleans())
    return dict(
        page_size=ps,
        max_model_len=max_model_len,
        num_kv_pages=draw(st.integers(min_pages, min_pages * 3)),  # small pools: preemption
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=(
            draw(st.integers(1, 40)) if chunked else draw(st.integers(max_model_len, 80))
        ),
    )


def draw_prompt(draw, bases: list[list[int]], max_model_len: int) -> list[int]:
    """A prompt of one of `bases` (or none) and a random tail; an empty tail repeats a base
    prompt exactly (full-prompt prefix-cache hits)."""
    base = draw(st.sampled_from(bases + [[]]))
    tail = draw(st.lists(st.integers(1, VOCAB - 1), min_size=0 if base else 1, max_size=14))
    return (base + tail)[: max_model_len - 2]


async def wait_idle(a, timeout=5.0):
    """The AsyncLLMEngine's stats once nothing runs, waits or holds a page (or fail)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        s = a.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_pages_used == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {a.get_stats()}")
