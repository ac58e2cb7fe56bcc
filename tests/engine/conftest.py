import pytest

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine

from .fakes import FakeModel, FakeTokenizer, fake_kv_caches


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
