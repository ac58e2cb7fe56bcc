"""`plan --expert-placement-file`: measured routing counts (serve --record-routing) give the
GPU experts' hit rate, the decode estimate and the serve command."""

from __future__ import annotations

import json

from k2serve.config import ModelConfig, known_model_config
from k2serve.plan import plan
from k2serve.plan.hardware import parse_gpus

TiB = 2**40


def _plan(**kw):
    n, gpu = parse_gpus("1xH200")
    cfg = ModelConfig.from_hf(known_model_config("kimi-k2-thinking"))
    return cfg, plan(cfg, gpu=gpu, num_gpus=n, cpu_memory=TiB, cpu_bandwidth=250e9,
                     num_gpu_experts=64, **kw)  # fmt: skip


def test_skewed_counts_raise_the_hit_rate_and_the_decode_estimate(tmp_path):
    cfg, uniform = _plan()
    # every layer: experts 0..63 get 3 pairs each, the other 320 get 1 each
    counts = {layer: [3.0] * 64 + [1.0] * 320 for layer in cfg.moe_layers}
    _, p = _plan(routing_counts=counts, expert_placement_file="routing.json")
    assert uniform.gpu_expert_hit_rate is None
    assert abs(p.gpu_expert_hit_rate - 192 / (192 + 320)) < 1e-12
    assert p.cpu_bytes_per_token < uniform.cpu_bytes_per_token
    assert p.decode_tokens_per_s > uniform.decode_tokens_per_s
    assert p.serve_args[-2:] == ["--expert-placement-file", "routing.json"]
    assert any("38%" in n for n in p.notes)  # 0.375


def test_plan_cli_reads_the_recorded_file(tmp_path, capsys):
    from k2serve.plan.cli import add_arguments, make_plan

    cfg = ModelConfig.from_hf(known_model_config("kimi-k2-thinking"))
    f = tmp_path / "routing.json"
    f.write_text(json.dumps({"layers": {str(i): [1] * 384 for i in cfg.moe_layers}}))
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--gpus", "1xH200", "--cpu-memory", "1TB", "--num-gpu-experts", "64",
                          "--expert-placement-file", str(f)])  # fmt: skip
    p, _ = make_plan(args)
    assert abs(p.gpu_expert_hit_rate - 64 / 384) < 1e-12
    assert str(f) in p.command


def test_one_gpu_hybrid_reserves_the_layerwise_prefill_double_buffer():
    """serve allocates two layers' CPU experts on the GPU before the KV cache: plan counts them
    (choosing fewer GPU experts to leave the room, the context still fitting); where they do
    not fit, plan says so and leaves them out."""
    n, gpu = parse_gpus("1xH200")
    cfg = ModelConfig.from_hf(known_model_config("kimi-k2-thinking"))
    p = plan(cfg, gpu=gpu, num_gpus=n, cpu_memory=TiB)
    assert p.fits and p.kv_cache_tokens >= p.max_model_len
    assert p.devices[0].rows["layerwise_prefill"] == 2 * p.num_cpu_experts * p.expert_bytes
    _, forced = _plan()  # 64 GPU experts at the full context leave no room for it
    assert forced.devices[0].rows["layerwise_prefill"] == 0
    assert any("layer-wise prefill" in note for note in forced.notes)
    n, gpu = parse_gpus("1xL20")
    small = plan(cfg, gpu=gpu, num_gpus=n, cpu_memory=TiB, max_model_len=32768)
    assert small.fits and small.devices[0].rows["layerwise_prefill"] == 0
    assert any("layer-wise prefill" in note for note in small.notes)
