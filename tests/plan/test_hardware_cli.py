"""GPU presets, size parsers and the `k2serve plan` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from k2serve.cli import main
from k2serve.plan.hardware import gpu_preset, parse_bandwidth, parse_gpus, parse_size


def test_parse_gpus():
    n, g = parse_gpus("8xH100")
    assert n == 8 and g.name == "H100" and g.memory_bytes == 81559 * 2**20
    assert parse_gpus("H200")[0] == 1
    assert parse_gpus("2x rtx-4090")[1].name == "RTX4090"
    assert parse_gpus("1xRTX PRO 6000")[1].name == "RTX6000PRO"
    assert parse_gpus("none") == (0, None)
    with pytest.raises(ValueError, match="unknown GPU"):
        parse_gpus("8xV100")
    with pytest.raises(ValueError, match="positive"):
        parse_gpus("0xH100")


def test_presets_cover_the_issue_list():
    for name, gib in [
        ("H100", 80),
        ("H200", 141),
        ("H20", 96),
        ("B200", 180),
        ("A100", 80),
        ("L20", 48),
        ("RTX4090", 24),
        ("RTX6000PRO", 96),
    ]:
        g = gpu_preset(name)
        # nvidia-smi totals sit within 6% of the marketed size (GB or GiB)
        assert 0.9 * gib * 1e9 < g.memory_bytes < 1.06 * gib * 2**30, name
        assert g.bandwidth > 5e11


def test_parse_sizes():
    assert parse_size("1TB") == 2**40
    assert parse_size("768GB") == 768 * 2**30
    assert parse_size("0") == 0
    assert parse_bandwidth("300GB/s") == 300e9
    assert parse_bandwidth("1.2TB/s") == 1.2e12
    assert parse_bandwidth("300") == 300e9
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")


def test_cli_json(capsys):
    rc = main(["plan", "--model", "kimi-k2-thinking", "--gpus", "8xH200", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    assert out["kv_bytes_per_token"] == 61 * 576 * 2
    assert out["command"].startswith("k2serve serve --model models/Kimi-K2-Thinking")
    assert out["source"]["hf_repo"] == "moonshotai/Kimi-K2-Thinking"
    assert len(out["devices"]) == 8


def test_cli_text_not_fitting(capsys):
    rc = main(
        ["plan", "--model", "kimi-k2-instruct", "--gpus", "8xH100", "--max-model-len", "131072"]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "DOES NOT FIT" in out and "would fit" in out and "KV cache" in out


def test_cli_checkpoint_dir(tmp_path, capsys):
    from k2serve.config import known_model_config

    (tmp_path / "config.json").write_text(json.dumps(known_model_config("kimi-k2.5")))
    rc = main(["plan", "--model", str(tmp_path), "--gpus", "8xH200", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["weights"]["vision"] > 0


def test_cli_bad_input(capsys):
    assert main(["plan", "--model", "kimi-k3", "--gpus", "8xH200"]) == 2
    assert "kimi-k3" in capsys.readouterr().err
    assert main(["plan", "--gpus", "8xTPU"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


def test_plan_does_not_import_torch():
    code = (
        "import sys; from k2serve.cli import main; "
        "rc = main(['plan', '--gpus', '1xH200', '--cpu-memory', '1TB']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "k2serve serve --model" in r.stdout
