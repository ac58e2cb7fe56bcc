"""`k2serve serve` flag parsing and start-up failures (no model is loaded here)."""

from __future__ import annotations

import json

from k2serve.cli import main


def test_bad_model_dirs_fail_cleanly(tmp_path, capsys):
    free = ["--host", "127.0.0.1", "--port", "0"]  # never the default 8000 (issue 31)
    assert main(["serve", "--model", str(tmp_path / "missing"), *free]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["serve", "--model", str(tmp_path), *free]) == 2
    err = capsys.readouterr().err
    assert "LlamaForCausalLM" in err and "Traceback" not in err


def test_a_bad_model_dir_is_reported_before_a_busy_port(tmp_path, capsys):
    import socket

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        assert main(["serve", "--model", str(tmp_path), "--host", "127.0.0.1", "--port", port]) == 2
    err = capsys.readouterr().err
    assert "LlamaForCausalLM" in err and "in use" not in err, err


def test_flags_parse_with_vllm_names(monkeypatch):
    import argparse

    from k2serve.server.cli import add_arguments

    monkeypatch.setenv("K2SERVE_API_KEY", "from-env")
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert (a.port, a.api_key, a.tool_call_parser, a.reasoning_parser) == (
        8000,
        ["from-env"],
        "kimi_k2",
        "kimi_k2",
    )
    a = p.parse_args(
        [
            "--model",
            "/m",
            "--port",
            "9001",
            "--served-model-name",
            "a",
            "b",
            "--api-key",
            "k",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--gpu-memory-utilization",
            "0.8",
            "--kv-cache-memory",
            "2GiB",
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--max-waiting",
            "5",
            "--no-enable-prefix-caching",
            "--tool-call-parser",
            "kimi_k2",
            "--reasoning-parser",
            "kimi_k2",
            "--drain-timeout",
            "3",
            "--uvicorn-log-level",
            "info",
            "--default-chat-template-kwargs",
            '{"thinking": false}',
        ]
    )
    assert a.allowed_origins == ["*"] and a.max_request_body_bytes == 32 * 1024 * 1024
    assert a.served_model_name == ["a", "b"] and a.api_key == ["k"] and a.max_waiting == 5
    assert a.enable_prefix_caching is False and a.default_chat_template_kwargs == {
        "thinking": False
    }


def test_serve_hub_id_says_how_to_download(capsys):
    assert main(["serve", "moonshotai/Kimi-K2-Instruct"]) == 2
    err = capsys.readouterr().err
    assert "k2serve download moonshotai/Kimi-K2-Instruct --dir ./Kimi-K2-Instruct" in err
    assert "k2serve serve ./Kimi-K2-Instruct" in err
    assert main(["serve", "--model", "kimi-k2-thinking"]) == 2
    assert "k2serve download kimi-k2-thinking --dir ./Kimi-K2-Thinking" in capsys.readouterr().err
    # a path naming a known checkpoint: download by name into that path (not the path as a repo)
    assert main(["serve", "models/Kimi-K2.5"]) == 2
    err = capsys.readouterr().err
    assert "k2serve download kimi-k2.5 --dir models/Kimi-K2.5" in err
    assert "k2serve serve models/Kimi-K2.5" in err


def test_generation_config_flag(tmp_path, capsys):
    import argparse

    from k2serve.server.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).generation_config == "auto"
    assert p.parse_args(["--generation-config", "vllm"]).generation_config == "vllm"
    # a directory without generation_config.json is refused before anything loads
    (tmp_path / "m").mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["serve", "--model", str(tmp_path / "m"), "--generation-config", str(empty)])
    assert code == 2
    assert "generation_config.json" in capsys.readouterr().err
