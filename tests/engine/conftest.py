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


# the tiny preset made smaller still (CI time): 2 layers (1 dense + 1 MoE), 4 experts top-2
SMALLER = dict(
    num_hidden_layers=2,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    from k2serve.weights.make_checkpoint import make_checkpoint
    from k2serve.weights.presets import preset_config

    out = tmp_path_factory.mktemp("tiny-bf16")
    cfg = preset_config("tiny", "bf16")
    cfg.update(SMALLER)
    make_checkpoint(out, cfg, progress=False, seed=3)
    return str(out)
