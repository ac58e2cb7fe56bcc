"""The planner sizes the host KV tier (issue 27) from the RAM the CPU experts leave, passes it
to serve as --kv-offloading-size, refuses one that does not fit; deploy requests its RAM."""

from __future__ import annotations

import json

from k2serve.cli import main
from k2serve.config import ModelConfig, known_model_config
from k2serve.plan import CPU_MEMORY_UTILIZATION, plan
from k2serve.plan.hardware import parse_gpus
from k2serve.plan.kv_tier import AUTO_MAX_TIMES

GiB, TiB = 2**30, 2**40


def run(gpus: str, **kw):
    n, gpu = parse_gpus(gpus)
    cfg = ModelConfig.from_hf(known_model_config("kimi-k2-thinking"))
    return plan(cfg, gpu=gpu, num_gpus=n, **kw)


def flag(p) -> float | None:
    a = p.serve_args
    return float(a[a.index("--kv-offloading-size") + 1]) if "--kv-offloading-size" in a else None


def test_auto_size_is_what_the_experts_leave_capped_by_the_gpu_cache():
    p = run("1xH200", cpu_memory=1 * TiB, max_model_len=65536)
    assert p.fits and p.num_cpu_experts
    left = int(TiB * CPU_MEMORY_UTILIZATION) - p.cpu_memory_needed
    cap = AUTO_MAX_TIMES * p.kv_cache_tokens * p.kv_bytes_per_token
    assert p.kv_offloading_bytes == int(min(left / 2, cap)) // GiB * GiB > 0
    assert flag(p) == p.kv_offloading_bytes / GiB
    assert p.host_kv_tokens == p.kv_offloading_bytes // p.kv_bytes_per_token
    assert any("KV host tier" in n and "CPU experts" in n for n in p.notes)


def test_asked_size_over_gpus_and_refused_when_it_does_not_fit():
    p = run("8xH200", cpu_memory=2 * TiB, kv_offloading_size=256)
    assert p.fits and flag(p) == 256 and p.host_kv_tokens == 32 * GiB // p.kv_bytes_per_token
    p = run("1xH200", cpu_memory=1 * TiB, kv_offloading_size=900)
    assert not p.fits and any("--kv-offloading-size 900" in r for r in p.reasons)


def test_off_without_gpu_or_ram_or_when_zero():
    assert flag(run("8xH200")) is None  # no --cpu-memory: nothing to size from
    assert flag(run("8xH200", cpu_memory=2 * TiB, kv_offloading_size=0)) is None
    cfg = ModelConfig.from_hf(known_model_config("kimi-k2-thinking"))
    assert plan(cfg, cpu_memory=4 * TiB).kv_offloading_bytes == 0  # CPU only


def test_deploy_passes_the_tier_and_requests_its_ram(tmp_path, capsys):
    assert main(["plan", "--model", "kimi-k2-thinking", "--gpus", "8xH200", "--cpu-memory", "2TB",
                 "--kv-offloading-size", "256", "--json"]) == 0  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(capsys.readouterr().out)
    assert main(["deploy", "slurm", "--plan", str(path), "--out", str(tmp_path / "o")]) == 0
    text = "".join(f.read_text() for f in (tmp_path / "o").iterdir() if f.is_file())
    assert "--kv-offloading-size 256" in text
    assert json.loads(path.read_text())["kv_offloading_bytes"] == 256 * GiB
    assert main(["deploy", "k8s", "--plan", str(path), "--out", str(tmp_path / "k")]) == 0
    k8s = "".join(f.read_text() for f in (tmp_path / "k").rglob("*") if f.is_file())
    assert "--kv-offloading-size" in k8s and "320Gi" in k8s  # 64 GiB + the tier's 256


def test_swap_space_is_per_gpu(capsys):
    assert main(["plan", "--model", "kimi-k2-thinking", "--gpus", "8xH200", "--cpu-memory", "2TB",
                 "--swap-space", "32", "--json"]) == 0  # fmt: skip
    p = json.loads(capsys.readouterr().out)
    assert p["kv_offloading_bytes"] == 8 * 32 * GiB
    assert "--kv-offloading-size 256" in p["command"]
