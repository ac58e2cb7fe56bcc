"""CPU-only serving set-up: dtype auto on the CPU, and the KV budget sized for the requested
context (engine/setup.py)."""

from __future__ import annotations

import pytest
import torch

from k2serve.config import ModelConfig
from k2serve.engine import setup
from k2serve.engine.config import EngineConfig
from k2serve.weights.presets import preset_config

CPU = torch.device("cpu")


@pytest.mark.parametrize("has_bf16", [True, False])
def test_dtype_auto_on_cpu_follows_bf16_support(monkeypatch, has_bf16):
    import k2serve.kernels.cpu as ck

    monkeypatch.setattr(ck, "cpu_has_bf16", lambda: has_bf16)
    want = torch.bfloat16 if has_bf16 else torch.float32
    assert setup.resolve_dtype("auto", CPU) == want
    assert setup.resolve_dtype("float32", CPU) == torch.float32  # explicit wins


def _mc():
    return ModelConfig.from_hf(preset_config("tiny", "bf16"))


def test_cpu_kv_budget_is_sized_for_max_model_len(monkeypatch):
    monkeypatch.setattr(setup, "available_memory_bytes", lambda: 1 << 40)
    cfg = EngineConfig(max_model_len=5000, max_num_seqs=3, page_size=16)
    pages, mml = setup.num_kv_pages(cfg, _mc(), torch.bfloat16, CPU, 5000, False)
    assert mml == 5000 and pages == 3 * -(-5000 // 16)  # every sequence at full length
    # the old fixed 1 GiB stays the default when no length is asked for
    per_page = setup.kv_bytes_per_token(_mc(), torch.bfloat16) * 16
    pages, _ = setup.num_kv_pages(EngineConfig(), _mc(), torch.bfloat16, CPU, 4096, True)
    assert pages == min(setup.DEFAULT_CPU_KV_CACHE_MEMORY // per_page, 64 * 4096 // 16)


def test_cpu_kv_budget_is_bounded_by_available_ram(monkeypatch):
    per_token = setup.kv_bytes_per_token(_mc(), torch.bfloat16)
    ram = per_token * 8000  # 80% of it holds 6400 tokens
    monkeypatch.setattr(setup, "available_memory_bytes", lambda: ram)
    cfg = EngineConfig(max_model_len=5000, max_num_seqs=4, page_size=16)
    pages, mml = setup.num_kv_pages(cfg, _mc(), torch.bfloat16, CPU, 5000, False)
    assert pages * 16 <= 0.8 * ram / per_token and mml == 5000
    with pytest.raises(ValueError, match="does not fit"):  # not even one sequence: clear error
        setup.num_kv_pages(
            EngineConfig(max_model_len=20000, page_size=16), _mc(), torch.bfloat16, CPU,
            20000, False,
        )  # fmt: skip


def test_step_token_budget_default_follows_gpu_memory(monkeypatch):
    """--max-num-batched-tokens unset: 8192 on a GPU of 70 GiB or more (vLLM's server default),
    2048 on smaller GPUs and the CPU; a value given is kept as is."""
    from k2serve.memory import default_max_num_batched_tokens

    assert default_max_num_batched_tokens(None) == 2048
    assert default_max_num_batched_tokens(24 * 2**30) == 2048
    assert default_max_num_batched_tokens(80 * 2**30) == 8192  # H100 80GB
    assert setup.step_token_budget(EngineConfig(), CPU) == 2048
    assert setup.step_token_budget(EngineConfig(max_num_batched_tokens=300), CPU) == 300

    class Props:
        total_memory = 141 * 2**30  # H200

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props())
    cuda = torch.device("cuda", 0)
    assert setup.step_token_budget(EngineConfig(), cuda) == 8192
    assert setup.step_token_budget(EngineConfig(max_num_batched_tokens=4096), cuda) == 4096
    Props.total_memory = 48 * 2**30
    assert setup.step_token_budget(EngineConfig(), cuda) == 2048
