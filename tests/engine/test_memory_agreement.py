"""`k2serve plan` and `k2serve serve` size the KV cache with the same formulas (k2serve.memory):
for the same machine they give the same number of pages. Checked on the CPU with a simulated
device (K2SERVE_SIMULATED_DEVICE_MEMORY: the engine measures its weights and takes the rest
from the formulas, as the planner does)."""

from __future__ import annotations

import pytest

from k2serve import LLM
from k2serve.config import ModelConfig
from k2serve.memory import RUNTIME_RESERVE_BYTES
from k2serve.plan import plan
from k2serve.plan.hardware import GpuSpec

MiB = 2**20


@pytest.mark.parametrize(
    "device_mib, util, seqs, budget",
    [(800, 1.0, 8, 256), (1200, 0.7, 4, 512), (900, 0.9, 16, 128)],
)
def test_plan_and_serve_agree_on_pages(ckpt, monkeypatch, device_mib, util, seqs, budget):
    mc = ModelConfig.from_hf(ckpt)
    total = device_mib * MiB
    assert total * util > RUNTIME_RESERVE_BYTES  # room left for weights and cache
    gpu = GpuSpec("simulated", total, 1e12, nvlink=False, fp8=False)
    ctx = 32768
    kw = dict(max_model_len=ctx, max_num_seqs=seqs,
              max_num_batched_tokens=budget, gpu_memory_utilization=util)  # fmt: skip
    p = plan(mc, gpu=gpu, num_gpus=1, kv_cache_dtype="auto", suggest=False, **kw)
    monkeypatch.setenv("K2SERVE_SIMULATED_DEVICE_MEMORY", str(total))
    llm = LLM(ckpt, device="cpu", dtype="bfloat16", page_size=16, **kw)
    spec = llm.llm_engine.spec
    cap = seqs * ctx // 16  # the engine's ceiling: every sequence at full length
    assert p.kv_cache_tokens >= ctx
    assert spec.num_kv_pages == min(p.kv_cache_tokens // 16, cap)
    assert spec.max_model_len == ctx


def test_simulated_budget_counts_activations_and_graphs(ckpt, monkeypatch):
    """A bigger step budget or more sequences leave fewer pages; --enforce-eager more."""
    monkeypatch.setenv("K2SERVE_SIMULATED_DEVICE_MEMORY", str(900 * MiB))

    def pages(**kw):
        args = dict(device="cpu", dtype="bfloat16", max_num_seqs=64, gpu_memory_utilization=1.0,
                    max_model_len=32768)  # fmt: skip
        args.update(kw)
        return LLM(ckpt, **args).llm_engine.spec.num_kv_pages

    small = pages(max_num_batched_tokens=256)
    assert pages(max_num_batched_tokens=4096) < small
    assert pages(max_num_batched_tokens=256, enforce_eager=True) > small
