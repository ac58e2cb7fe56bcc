"""plan over nodes and any GPU (issue #17): the printed commands are what serve accepts and
runs, every failing limit is listed, suggestions stay within two nodes."""

import argparse
import re
import shlex

import pytest

from k2serve.cli import main
from k2serve.config import ModelConfig, known_model_config
from k2serve.plan import plan
from k2serve.plan.hardware import GPU_PRESETS, gpu_preset, parse_gpus


def run(name: str, gpus: str, **kw):
    n, gpu = parse_gpus(gpus)
    return plan(ModelConfig.from_hf(known_model_config(name)), gpu=gpu, num_gpus=n, **kw)


def serve_config(command: str, **env):
    """Parse a printed `k2serve serve ...` line with serve's own parser -> (args, EngineConfig)."""
    from k2serve.engine.config import EngineConfig
    from k2serve.server import cli as serve_cli

    words = [env.get(w[1:], w) if w.startswith("$") else w for w in shlex.split(command)]
    assert words[:2] == ["k2serve", "serve"]
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(words[2:])
    serve_cli._apply_dist_init_addr(args)
    return args, EngineConfig.from_cli_args(args)


def test_16_h200_prints_one_command_per_node_that_serve_accepts():
    p = run("kimi-k2-instruct", "16xH200", max_model_len=131072)
    assert p.fits and p.nnodes == 2 and len(p.node_commands) == 2
    for rank, cmd in enumerate(p.node_commands):
        args, cfg = serve_config(cmd, MASTER_ADDR="10.0.0.1")
        assert (cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank) == (16, 2, rank)
        assert cfg.master_addr == "10.0.0.1" and cfg.enable_expert_parallel
        assert args.headless == (rank == 1)
    assert p.command.splitlines() == p.node_commands


def test_gpus_per_node_and_whole_nodes():
    p = run("kimi-k2-instruct", "8xH200", max_model_len=65536, gpus_per_node=4)
    assert p.nnodes == 2 and "--nnodes 2" in p.node_commands[1]
    with pytest.raises(ValueError, match="whole nodes"):
        run("kimi-k2-instruct", "16xH200", max_model_len=65536, gpus_per_node=6)
    assert run("kimi-k2-thinking", "8xH200").nnodes == 1


def test_gpus_given_by_memory_and_new_presets():
    n, a = parse_gpus("2x94GB")
    m, b = parse_gpus("2", "94GB", "3.9TB/s")
    assert n == m == 2 and a.memory_bytes == b.memory_bytes == 94 * 2**30
    assert a.bandwidth_assumed and not b.bandwidth_assumed and b.bandwidth == 3.9e12
    p = plan(ModelConfig.from_hf(known_model_config("kimi-k2-thinking")), gpu=a, num_gpus=2,
             cpu_memory=2**40)  # fmt: skip
    assert any("bandwidth unknown" in note for note in p.notes)
    # datasheet figures (sources in hardware.py)
    want = {"H100 NVL": (93.6, 3.9e12), "H100 PCIe": (79.6, 2.0e12), "L40S": (45.0, 0.864e12),
            "RTX 5090": (31.8, 1.792e12), "GH200": (96, 4.0e12), "B300": (288, 8.0e12)}  # fmt: skip
    for name, (gib, bw) in want.items():
        g = gpu_preset(name)
        assert g.memory_bytes / 2**30 == pytest.approx(gib, abs=0.1) and g.bandwidth == bw
    with pytest.raises(ValueError, match="--gpu-bandwidth"):
        parse_gpus("8xV100")


def test_cpu_only_command_runs_in_serve(capsys):
    """The printed CPU command sets dtype and KV budget: serve builds the engine and the
    whole max_model_len fits (with serve's CPU defaults it would not)."""
    from k2serve.demo import demo_path
    from k2serve.engine.engine import LLMEngine

    assert main(["plan", "--model", str(demo_path()), "--gpus", "none", "--cpu-memory", "8GB"]) == 0
    cmd = capsys.readouterr().out.strip().splitlines()[-1]
    args, cfg = serve_config(cmd)
    assert (cfg.device, cfg.dtype) == ("cpu", "bfloat16") and cfg.kv_cache_memory
    eng = LLMEngine(cfg)
    try:
        assert eng.max_model_len == args.max_model_len == 4096
    finally:
        eng.shutdown()


def test_every_failing_limit_is_listed_with_numbers():
    p = run("kimi-k2-thinking", "1xRTX4090", max_model_len=32768, cpu_memory=64 * 2**30)
    assert not p.fits and len(p.reasons) == 3
    text = " | ".join(p.reasons)
    assert "23.2 GiB per GPU" in text and "KV cache" in text and "532 GiB of RAM" in text


@pytest.mark.parametrize("gpus", ["8xRTX4090", "1xH100", "2xL40S", "8xH100", "none"])
def test_suggestions_stay_within_two_nodes_of_real_gpus(gpus):
    p = run("kimi-k2-instruct", gpus, max_model_len=131072, cpu_memory=64 * 2**30)
    assert not p.fits and p.suggestions
    for s in p.suggestions:
        for count, name in re.findall(r"--gpus (\d+)x(\S+)", s):
            n = int(count)
            assert n <= 8 or (n % 8 == 0 and n <= 16), s
            assert gpu_preset(name).name in GPU_PRESETS


def test_default_gpus_is_said_and_documented(capsys):
    assert main(["plan", "--model", "kimi-k2-thinking"]) == 0
    assert "assumed: no --gpus given" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "-h"])
    assert "Default: 8xH200" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")
