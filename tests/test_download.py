"""`k2serve download`: offline and unreachable hubs fail fast and clearly; the right files only."""

from __future__ import annotations

import fnmatch
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from k2serve.plan import download as dl


def _cli(*args, env=None, timeout=60):
    e = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "k2serve.cli", "download", *args],
        capture_output=True, text=True, timeout=timeout, env=e,
    )  # fmt: skip


def test_offline_env_fails_fast(tmp_path):
    t = time.monotonic()
    r = _cli("kimi-k2-thinking", "--dir", str(tmp_path / "m"), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1
    assert "HF_HUB_OFFLINE" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t < 30


def test_refused_endpoint_fails_fast(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    r = _cli("kimi-k2-thinking", "--dir", str(tmp_path / "m"),
             "--endpoint", f"http://127.0.0.1:{port}", "--timeout", "2",
             env={"HF_HUB_OFFLINE": "0"})  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "cannot reach the Hugging Face hub" in r.stderr and "Traceback" not in r.stderr


def test_silent_endpoint_times_out(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    conns = []
    stop = threading.Event()

    def accept():  # accept and never answer
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        t = time.monotonic()
        r = _cli("moonshotai/Kimi-K2-Thinking", "--dir", str(tmp_path / "m"),
                 "--endpoint", f"http://127.0.0.1:{srv.getsockname()[1]}", "--timeout", "1",
                 env={"HF_HUB_OFFLINE": "0"})  # fmt: skip
        took = time.monotonic() - t
    finally:
        stop.set()
        th.join()
        for c in conns:
            c.close()
        srv.close()
    assert r.returncode == 1 and "cannot reach" in r.stderr
    assert took < 25  # bounded by --timeout (plus interpreter start and any retry)


def test_bad_name_is_usage_error(tmp_path):
    r = _cli("kimi-k9", "--dir", str(tmp_path))
    assert r.returncode == 2 and "kimi-k9" in r.stderr


def test_resolve_repo():
    repo, size = dl.resolve_repo("Kimi-K2-Thinking")
    assert repo == "moonshotai/Kimi-K2-Thinking" and size > 500 * 2**30
    assert dl.resolve_repo("someone/Kimi-K2-fork") == ("someone/Kimi-K2-fork", None)


def test_allow_patterns_select_what_the_loader_reads():
    def keep(name):
        return any(fnmatch.fnmatch(name, p) for p in dl.ALLOW_PATTERNS)

    for name in ["model-1-of-61.safetensors", "model.safetensors.index.json", "config.json",
                 "tiktoken.model", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json", "tokenization_kimi.py"]:  # fmt: skip
        assert keep(name), name
    for name in ["pytorch_model.bin", "model.gguf", "figures/arch.png", "README.md"]:
        assert not keep(name), name


def test_download_calls_hub_with_token_and_patterns(tmp_path, monkeypatch):
    calls = {}

    class FakeApi:
        def __init__(self, endpoint=None, token=None):
            self.endpoint, calls["api_token"] = endpoint or "https://hub", token

        def model_info(self, repo, revision=None, timeout=None):
            calls["timeout"] = timeout

    def fake_snapshot(repo, **kw):
        calls.update(repo=repo, **kw)
        d = kw["local_dir"]
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {"a": "model-1-of-2.safetensors",
                                      "b": "model-2-of-2.safetensors"}}, f)  # fmt: skip
        open(os.path.join(d, "model-1-of-2.safetensors"), "w").close()
        return d

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    with pytest.raises(RuntimeError, match="1 shards are missing"):
        dl.download("kimi-k2-thinking", str(tmp_path), timeout=3)
    assert calls["repo"] == "moonshotai/Kimi-K2-Thinking"
    assert calls["token"] == calls["api_token"] == "hf_secret"
    assert calls["allow_patterns"] == dl.ALLOW_PATTERNS and calls["timeout"] == 3
    open(tmp_path / "model-2-of-2.safetensors", "w").close()
    assert dl.missing_shards(str(tmp_path)) == []
