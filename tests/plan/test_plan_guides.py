"""`k2serve plan` carries every serving choice into its command, takes the host CPU's facts for
CPU plans, shows its KV arithmetic, and reads the guides' hardware as the guides run it."""

from __future__ import annotations

import json
import shlex

import pytest

from k2serve.cli import main
from k2serve.config import ModelConfig, known_model_config
from k2serve.plan import plan
from k2serve.plan.hardware import gpu_preset
from k2serve.plan.host import detect_host, measure_bandwidth

K2T = ModelConfig.from_hf(known_model_config("kimi-k2-thinking"))


def _json(capsys, *argv) -> dict:
    main(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_max_num_batched_tokens_is_in_the_command(capsys):
    d = _json(capsys, "--model", "kimi-k2-thinking", "--gpus", "8xH200",
              "--max-num-batched-tokens", "32768")  # fmt: skip
    words = shlex.split(d["command"])
    assert words[words.index("--max-num-batched-tokens") + 1] == "32768"
    assert d["max_num_batched_tokens"] == 32768


def test_kv_arithmetic_is_shown_and_adds_up(capsys):
    main(["plan", "--model", "kimi-k2-thinking", "--gpus", "8xH100", "--max-model-len", "12288",
          "--cpu-memory", "1TB"])  # fmt: skip
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("KV math"))
    assert "0.9 x memory" in line and "70,272 bytes/token" in line
    assert "--max-num-batched-tokens 8192" in line  # serve's default on an 80 GB GPU
    p = plan(K2T, gpu=gpu_preset("H100"), num_gpus=8, cpu_memory=2**40, max_model_len=12288)
    d = p.devices[0]
    assert d.rows["kv_cache"] == d.capacity - (d.used - d.rows["kv_cache"])
    assert p.kv_cache_tokens == d.rows["kv_cache"] // 70272 // 16 * 16
    assert f"{p.kv_cache_tokens:,} tokens" in line


def test_cpu_plan_takes_the_host_facts(capsys):
    argv = ["--model", "kimi-k2-thinking", "--gpus", "none", "--cpu-memory", "1TB",
            "--max-model-len", "8192"]  # fmt: skip
    main(["plan", *argv])
    out = capsys.readouterr().out
    assert "250 GB/s (assumed)" in out and "--cpu this" in out  # says what it lacks
    d = _json(capsys, *argv, "--cpu", "AMD EPYC 9654", "--cpu-cores", "192", "--cpu-sockets",
              "2", "--numa-nodes", "2", "--cpu-bandwidth", "600GB/s")  # fmt: skip
    host = d["source"]["host"]
    assert (host["model"], host["cores"], host["sockets"], host["numa_nodes"]) == (
        "AMD EPYC 9654", 192, 2, 2)  # fmt: skip
    assert host["bandwidth_source"] == "given" and d["cpu_bandwidth"] == 600e9
    assert d["command"].startswith("K2SERVE_CPU_THREADS=192 k2serve serve")
    assert d["decode_tokens_per_s"] == pytest.approx(600e9 / d["cpu_bytes_per_token"], rel=0.01)
    main(["plan", *argv, "--cpu-cores", "192", "--cpu-sockets", "2", "--cpu-bandwidth", "600"])
    out = capsys.readouterr().out
    assert "host CPU CPU model not given, 2 sockets, 192 cores" in out
    assert "read from RAM per token / 600 GB/s (given)" in out
    with pytest.raises(SystemExit):
        main(["plan", *argv, "--cpu-cores", "many"])
    assert main(["plan", *argv, "--cpu-cores", "0"]) == 2
    assert "--cpu-cores must be >= 1" in capsys.readouterr().err


def test_this_machine_is_read_and_measured(tmp_path):
    (tmp_path / "cpuinfo").write_text(
        "".join(
            f"processor\t: {i}\nmodel name\t: Test CPU\nphysical id\t: {i // 4}\n"
            f"core id\t\t: {i % 4}\n\n"
            for i in range(8)
        )  # fmt: skip
    )
    (tmp_path / "meminfo").write_text("MemTotal:       16384 kB\n")
    nodes = tmp_path / "node"
    for n in ("node0", "node1", "possible"):
        (nodes / n).mkdir(parents=True)
    h = detect_host(str(tmp_path), str(nodes))
    assert (h.model, h.cores, h.sockets, h.numa_nodes, h.memory_bytes) == (
        "Test CPU", 8, 2, 2, 16 * 2**20)  # fmt: skip
    assert measure_bandwidth(8 * 2**20, repeats=1) > 1e8  # any machine copies 100 MB/s


def test_h100_nvl_pairs_are_nvlink():
    assert gpu_preset("H100 NVL").nvlink
    p = plan(K2T, gpu=gpu_preset("H100NVL"), num_gpus=2, cpu_memory=2**40, max_model_len=8192)
    assert not any("PCIe" in n for n in p.notes)


def test_a_path_naming_a_known_checkpoint_plans_it_there(capsys):
    assert main(["plan", "--model", "models/Kimi-K2.5", "--gpus", "8xH200"]) == 0
    out = capsys.readouterr().out
    assert "k2serve download kimi-k2.5 --dir models/Kimi-K2.5" in out
    assert "k2serve serve --model models/Kimi-K2.5" in out


def test_max_num_batched_tokens_default_is_serves_on_the_gpu(capsys):
    """Unset, the plan sizes activations for what `serve` picks on that GPU (8192 from 70 GiB,
    as vLLM's server) and writes it into the command."""
    for gpus, want in (("8xH200", 8192), ("8xH100", 8192), ("8xL40S", 2048)):
        d = _json(capsys, "--model", "kimi-k2-thinking", "--gpus", gpus, "--cpu-memory", "2TB")
        words = shlex.split(d["command"])
        assert d["max_num_batched_tokens"] == want, gpus
        assert words[words.index("--max-num-batched-tokens") + 1] == str(want)
