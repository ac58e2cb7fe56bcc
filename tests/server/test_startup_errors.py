"""Issue #16: `k2serve serve` start-up failures are one clean line and exit 2, found early.

A truncated shard, NaN weights and a busy port each used to cost a traceback or a whole model
load; here each fails before serving, naming the file / tensor / address.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k2serve.cli import main
from k2serve.weights.make_checkpoint import make_checkpoint
from k2serve.weights.presets import preset_config


def _tiny() -> dict:
    cfg = preset_config("tiny", "bf16", layers=2)
    cfg.update(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
        num_experts_per_tok=2, vocab_size=1024 + 256, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    return cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny")
    make_checkpoint(d, _tiny(), seed=0, max_shard_bytes=400_000, tokenizer=True, progress=False)
    return str(d)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _shards(d: str) -> list[str]:
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def _lines(err: str) -> list[str]:
    """stderr without the progress bar."""
    err = re.sub(r"\rLoading weights:[^\]]*\]", "", err)
    return [ln for ln in err.strip().splitlines() if ln.strip()]


def _serve(d: str, *extra: str) -> list[str]:
    # --port 0: a free port (never the default 8000, which a running server may hold)
    return ["serve", "--model", d, "--device", "cpu", "--num-kv-pages", "16",
            "--host", "127.0.0.1", "--port", "0", *extra]  # fmt: skip


@pytest.mark.parametrize("keep", [0.5, 0.0001])  # cut in the tensor data / in the header
def test_truncated_shard_is_one_line_and_exit_2(ckpt, tmp_path, capsys, keep):
    d = _copy(ckpt, tmp_path / "ck")
    shard = os.path.join(d, _shards(d)[-1])
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(max(4, int(size * keep)))
    assert main(_serve(d)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(_lines(err)) == 1, err
    assert os.path.basename(shard) in err and "truncated" in err


def test_truncated_index_is_one_line_and_exit_2(ckpt, tmp_path, capsys):
    d = _copy(ckpt, tmp_path / "ck")
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) // 2)
    assert main(_serve(d)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(_lines(err)) == 1, err
    assert "model.safetensors.index.json" in err and "truncated" in err


def test_nan_weight_is_refused_naming_the_tensor(ckpt, tmp_path, capsys):
    d = _copy(ckpt, tmp_path / "ck")
    shard = os.path.join(d, _shards(d)[0])
    with safe_open(shard, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    name = next(k for k, t in tensors.items() if t.dtype == torch.bfloat16 and t.numel() > 1)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[1] = float("nan")
    save_file(tensors, shard, metadata=meta)
    assert main(_serve(d)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and name in err and "NaN" in err, err
    assert len(_lines(err)) == 1, err


def test_busy_port_fails_before_loading(ckpt, capsys, caplog, monkeypatch):
    import k2serve.engine.async_engine as ae

    def no_load(*a, **k):
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(ae, "AsyncLLMEngine", no_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(_serve(ckpt, "--host", "127.0.0.1", "--port", str(port)))
    assert rc == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "in use" in err and "Traceback" not in err
    assert not any("serving on" in r.getMessage() for r in caplog.records)


def test_security_flags_parse():
    import argparse

    from k2serve.server.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert a.request_read_timeout == 60.0 and a.allow_special_tokens_in_chat is False
    a = p.parse_args(["--request-read-timeout", "5", "--allow-special-tokens-in-chat"])
    assert a.request_read_timeout == 5.0 and a.allow_special_tokens_in_chat is True
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["--request-read-timeout", bad])
