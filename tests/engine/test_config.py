"""EngineConfig, CLI flags, KV cache sizing from a memory budget, and the EOS set."""

import argparse
import json

import pytest
import torch

from k2serve.config import ModelConfig, known_model_config
from k2serve.engine.config import EngineConfig, parse_bytes
from k2serve.engine.setup import eos_token_ids, kv_bytes_per_token, num_kv_pages


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes("lots")


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"page_size": -1}, "page_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "int3"}, "dtype"),
        ({"max_model_len": 0}, "max_model_len"),
    ],
)
def test_invalid_config_names_field(kw, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kw)


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--max-model-len",
            "1024",
            "--kv-cache-memory",
            "2GiB",
            "--no-enable-prefix-caching",
            "--block-size",
            "32",
            "--max-num-seqs",
            "8",
        ]
    )
    cfg = EngineConfig.from_cli_args(args)
    assert cfg.max_model_len == 1024 and cfg.kv_cache_memory == 2 * 2**30
    assert cfg.enable_prefix_caching is False and cfg.page_size == 32 and cfg.max_num_seqs == 8
    assert EngineConfig.from_cli_args(parser.parse_args([])) == EngineConfig()


def test_kv_sizing_from_memory_budget():
    kimi = ModelConfig.from_hf(known_model_config("kimi-k2-instruct"))
    per_token = kv_bytes_per_token(kimi, torch.bfloat16)
    assert per_token == 61 * 576 * 2  # design decision 5: ~68.6 KiB per token
    cfg = EngineConfig(kv_cache_memory="1GiB", page_size=16, max_num_seqs=1024)
    pages, mml = num_kv_pages(cfg, kimi, torch.bfloat16, torch.device("cpu"), 8192, False)
    assert pages == 2**30 // (per_token * 16) and mml == 8192
    # not even one max_model_len sequence fits: an explicit max_model_len is an error ...
    small = EngineConfig(kv_cache_memory="100MiB")
    with pytest.raises(ValueError, match=r"max_model_len=131072 does not fit"):
        num_kv_pages(small, kimi, torch.bfloat16, torch.device("cpu"), 131072, False)
    # ... the model's default is lowered to what fits
    pages, mml = num_kv_pages(small, kimi, torch.bfloat16, torch.device("cpu"), 131072, True)
    assert mml == pages * 16 < 131072
    # never more pages than max_num_seqs full-length sequences need
    cap = EngineConfig(kv_cache_memory="64GiB", max_num_seqs=2)
    pages, _ = num_kv_pages(cap, kimi, torch.bfloat16, torch.device("cpu"), 1000, False)
    assert pages == 2 * 63


def test_eos_set_from_checkpoint(tmp_path):
    cfg = ModelConfig.from_hf(known_model_config("kimi-k2-instruct"))  # eos 163585

    class Tok:
        eos_token_id = 163585

        def token_to_id(self, s):
            return {"<|im_end|>": 163586}.get(s)

    assert eos_token_ids(cfg, None, None) == {163585}
    assert eos_token_ids(cfg, Tok(), None) == {163585, 163586}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 163585]}))
    assert eos_token_ids(cfg, Tok(), str(tmp_path)) == {7, 163585, 163586}
