"""`plan(...)` against hand arithmetic and the deployments people report (shared/spec/field.md)."""

from __future__ import annotations

import pytest

from k2serve.config import ModelConfig, known_model_config
from k2serve.plan import plan
from k2serve.plan.hardware import parse_gpus

GiB, TiB = 2**30, 2**40
# One INT4 K2 expert: 3 x 7168 x 2048 weights at 4 bits + a bf16 scale per 32 + int32 shapes.
INT4_EXPERT = 3 * 7168 * 2048 // 2 + 3 * 7168 * 2048 // 32 * 2 + 3 * 2 * 4
FP8_EXPERT = 3 * 7168 * 2048 + (16 * 56 * 2 + 56 * 16) * 4
KV_BF16 = 61 * 576 * 2


def run(name: str, gpus: str, **kw):
    n, gpu = parse_gpus(gpus)
    return plan(ModelConfig.from_hf(known_model_config(name)), gpu=gpu, num_gpus=n, **kw)


def test_k2_instruct_fp8_does_not_fit_128k_on_8xh100():
    p = run("kimi-k2-instruct", "8xH100", max_model_len=131072)
    assert not p.fits
    # the routed experts alone: 60 * 384 FP8 experts > 8 GPUs x 80 GiB
    assert 60 * 384 * FP8_EXPERT > 8 * 80 * GiB
    assert any("routed experts" in r for r in p.reasons)
    assert any("16xH100" in s for s in p.suggestions)


def test_k2_instruct_fp8_128k_needs_16_h200():
    # MoonshotAI deploy guidance: 16 GPUs is the smallest unit for 128k with FP8 on H200/H20;
    # MoonshotAI/Kimi-K2#76: 128k does not fit on 8xH200.
    assert not run("kimi-k2-instruct", "8xH200", max_model_len=131072).fits
    assert run("kimi-k2-instruct", "16xH200", max_model_len=131072).fits
    assert run("kimi-k2-instruct", "16xH20", max_model_len=131072).fits
    p = run("kimi-k2-instruct", "8xH200", max_model_len=131072)
    assert "more GPUs: --gpus 16xH200" in p.suggestions
    assert any("--kv-cache-dtype fp8" in s for s in p.suggestions)


def test_k2_thinking_fits_8xh200_tp8_at_256k():
    p = run("kimi-k2-thinking", "8xH200", max_model_len=262144)
    assert p.fits and p.tensor_parallel_size == 8 and p.num_cpu_experts == 0
    d = p.devices[0].rows
    assert d["routed_experts"] == 384 // 8 * 60 * INT4_EXPERT
    assert p.kv_cache_tokens >= 262144
    assert p.kv_cache_tokens * KV_BF16 <= d["kv_cache"]
    # vLLM reported a 715,072-token KV cache for this deployment (recipes Kimi-K2-Think.md);
    # the plan must land within 20% of it.
    assert 0.8 * 715072 <= p.kv_cache_tokens <= 1.2 * 715072
    # memory never exceeds the usable share
    assert p.devices[0].used <= int(143771 * 2**20 * 0.9)


def test_k2_thinking_fits_b200_tp4():
    # InferenceX: on B200 (180 GB) K2 INT4 fits TP=4 where H200 needs TP=8.
    assert run("kimi-k2-thinking", "4xB200").fits
    assert not run("kimi-k2-thinking", "4xH200").fits


def test_k2_thinking_8xh100_is_cut_short():
    p = run("kimi-k2-thinking", "8xH100")
    assert not p.fits
    short = [s for s in p.suggestions if "--max-model-len" in s]
    assert short, p.suggestions
    assert any("--cpu-memory" in s for s in p.suggestions)


def test_hybrid_1xh200_1tb():
    p = run("kimi-k2-thinking", "1xH200", cpu_memory=TiB, cpu_bandwidth=250e9)
    assert p.fits
    assert p.num_gpu_experts + p.num_cpu_experts == 384
    assert 0 < p.num_gpu_experts < 384
    assert p.cpu_memory_needed >= p.num_cpu_experts * 60 * INT4_EXPERT
    assert p.cpu_memory_needed <= 0.9 * TiB
    # batch-1 decode reads 8 experts per MoE layer; the CPU share at uniform routing
    assert p.cpu_bytes_per_token == 8 * 60 * INT4_EXPERT * p.num_cpu_experts // 384
    # ~11.9 GB/token of experts at 250 GB/s: field.md measures 20-28 tok/s on such machines
    assert 15 <= p.decode_tokens_per_s <= 30
    assert "--num-gpu-experts" in p.serve_args


def test_hybrid_needs_48gb_vram():
    # ktransformers: native-INT4 K2-Thinking needs >= 48 GB of VRAM next to the RAM.
    p = run("kimi-k2-thinking", "1xRTX4090", cpu_memory=TiB)
    assert not p.fits and "non-expert" in p.reasons[0]
    assert run("kimi-k2-thinking", "1xL20", cpu_memory=TiB, max_model_len=32768).fits


def test_more_ram_suggested():
    p = run("kimi-k2-thinking", "1xH200", cpu_memory=256 * GiB)
    assert not p.fits
    line = next(s for s in p.suggestions if "--cpu-memory" in s)
    need = int(line.split("--cpu-memory ")[1].split("GB")[0])
    assert run("kimi-k2-thinking", "1xH200", cpu_memory=need * GiB).fits


def test_cpu_only():
    p = run("kimi-k2-thinking", "none", cpu_memory=TiB, cpu_bandwidth=250e9)
    assert p.fits and p.num_gpu_experts == 0 and not p.devices
    assert p.cpu_memory_needed >= 553 * GiB  # every weight is in RAM
    assert not run("kimi-k2-thinking", "none", cpu_memory=512 * GiB).fits


def test_fp8_kv_doubles_tokens():
    a = run("kimi-k2-thinking", "8xH200")
    b = run("kimi-k2-thinking", "8xH200", kv_cache_dtype="fp8")
    assert b.kv_bytes_per_token * 2 == a.kv_bytes_per_token == KV_BF16
    assert b.kv_cache_tokens == pytest.approx(2 * a.kv_cache_tokens, rel=1e-3)


def test_decode_roofline_hand_arithmetic():
    p = run("kimi-k2-thinking", "8xH200", max_model_len=262144)
    attn = 61 * 2 * (64 * 192 * 1536 + 64 * 256 * 512 + 7168 * 64 * 128)  # TP-sharded
    attn_rep = 61 * 2 * (1536 * 7168 + 1536 + 576 * 7168 + 512 + 2 * 7168)
    dense = 3 * 18432 * 7168 * 2 // 8
    shared = 60 * 3 * 2048 * 7168 * 2 // 8
    router = 60 * (384 * 7168 * 2 + 384 * 4)
    lm_head = 163840 * 7168 * 2 // 8
    routed = 8 * 60 * INT4_EXPERT // 8
    expect = attn // 8 + attn_rep + dense + shared + router + lm_head + routed
    assert p.gpu_bytes_per_token == pytest.approx(expect, abs=64)
    assert p.decode_tokens_per_s == pytest.approx(4.8e12 / expect, rel=1e-4)
    full = expect + 262144 * KV_BF16
    assert p.decode_tokens_per_s_full_context == pytest.approx(4.8e12 / full, rel=1e-4)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="max_model_len"):
        run("kimi-k2-thinking", "8xH200", max_model_len=10**7)
    with pytest.raises(ValueError, match="divid"):
        run("kimi-k2-thinking", "6xH200")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        run("kimi-k2-thinking", "8xH200", gpu_memory_utilization=1.5)
