"""Sampling defaults from generation_config.json (vLLM's --generation-config) and the INFO
line every rejected request leaves in the log."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from k2serve.server.app import build_app
from k2serve.server.generation_config import defaults_from_dict, load_generation_defaults

from .fakes import FakeAsyncEngine
from .helpers import _msgs


def test_mapping_of_hf_keys():
    assert defaults_from_dict({"do_sample": False}) == {"temperature": 0.0}
    assert defaults_from_dict({"do_sample": True, "temperature": 0.6, "top_p": 0.95}) == {
        "temperature": 0.6,
        "top_p": 0.95,
    }
    got = defaults_from_dict(
        {"top_k": -1, "min_p": 0.1, "repetition_penalty": 1.1, "max_new_tokens": 64,
         "eos_token_id": [1, 2], "temperature": None, "bos_token_id": 5}
    )  # fmt: skip
    assert got == {"top_k": 0, "min_p": 0.1, "repetition_penalty": 1.1, "max_tokens": 64}


def test_sources(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert load_generation_defaults("auto", str(tmp_path)) == {"temperature": 0.0}
    assert load_generation_defaults("vllm", str(tmp_path)) == {}
    assert load_generation_defaults(str(tmp_path), None) == {"temperature": 0.0}
    assert load_generation_defaults("auto", str(tmp_path / "nothing")) == {}
    with pytest.raises(ValueError, match="generation_config.json"):
        load_generation_defaults(str(tmp_path / "nothing"), None)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_generation_defaults("auto", str(tmp_path))


def test_demo_checkpoint_is_greedy_by_default():
    try:
        from k2serve.demo import demo_path

        demo = demo_path()
    except (ImportError, FileNotFoundError):
        pytest.skip("no demo checkpoint")
    assert load_generation_defaults("auto", str(demo)).get("temperature") == 0.0


class _Recorder(FakeAsyncEngine):
    def __init__(self):
        super().__init__()
        self.params = []

    async def generate(self, prompt_token_ids, params, request_id):
        self.params.append(params)
        async for out in super().generate(prompt_token_ids, params, request_id):
            yield out


def test_defaults_apply_only_where_the_request_is_silent():
    eng = _Recorder()
    defaults = {"temperature": 0.0, "top_p": 0.5, "max_tokens": 5}
    client = TestClient(build_app(eng, default_sampling_params=defaults))
    r = client.post("/v1/chat/completions", json={"messages": _msgs()})
    assert r.status_code == 200, r.text
    p = eng.params[-1]
    assert (p.temperature, p.top_p, p.max_tokens) == (0.0, 0.5, 5)
    assert r.json()["usage"]["completion_tokens"] == 5
    r = client.post(
        "/v1/chat/completions",
        json={"messages": _msgs(), "temperature": 0.7, "top_p": 1.0, "max_tokens": 9},
    )
    p = eng.params[-1]
    assert (p.temperature, p.top_p, p.max_tokens) == (0.7, 1.0, 9)
    # without defaults: the engine's own (vLLM's) temperature 1.0
    eng2 = _Recorder()
    TestClient(build_app(eng2)).post("/v1/chat/completions", json={"messages": _msgs()})
    assert eng2.params[-1].temperature == 1.0


def test_rejected_requests_are_logged_once(caplog):
    client = TestClient(build_app(FakeAsyncEngine(), served_model_names=["fake-k2"]))
    with caplog.at_level(logging.INFO, logger="k2serve.server.app"):
        r = client.post("/v1/chat/completions", json={"messages": _msgs(), "temperature": 9})
        assert r.status_code == 400
        r = client.post("/v1/chat/completions", json={"model": "nope", "messages": _msgs()})
        assert r.status_code == 404
        r = client.get("/v1/nothing")
        assert r.status_code == 404
        r = client.post("/v1/chat/completions", json={"messages": _msgs()})
        assert r.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected")]
    assert len(lines) == 3, lines
    assert lines[0].startswith("rejected POST /v1/chat/completions: 400 temperature")
    assert lines[1].startswith("rejected POST /v1/chat/completions: 404 the model 'nope'")
    assert lines[2] == "rejected GET /v1/nothing: 404 no route GET /v1/nothing"
    assert all(r.levelno == logging.INFO for r in caplog.records if "rejected" in r.getMessage())
