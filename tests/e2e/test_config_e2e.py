"""Checkpoint config.json that k2serve cannot honour: the error names the file or the field, on
every public route that reads it (`k2serve generate`, `k2serve plan`, `LLM`)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from k2serve import LLM

from .conftest import K2SERVE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "tiny"
    r = subprocess.run(
        [K2SERVE, "make-checkpoint", str(out), "--preset", "tiny", "--format", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return out


def _broken(tiny, tmp_path, edit) -> str:
    d = tmp_path / "broken"
    shutil.copytree(tiny, d)
    cfg = d / "config.json"
    text = edit(json.loads(cfg.read_text()))
    cfg.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(d)


CASES = [
    (lambda c: {**c, "hidden_size": "big"}, "hidden_size"),
    (lambda c: {**c, "num_hidden_layers": 2.5}, "num_hidden_layers"),
    (lambda c: {**c, "n_routed_experts": None, "num_experts_per_tok": "x"}, "num_experts_per_tok"),
    (lambda c: "{not json", "config.json"),
]


@pytest.mark.parametrize("edit,name", CASES)
def test_bad_config_names_the_field(tiny, tmp_path, edit, name):
    d = _broken(tiny, tmp_path, edit)
    for args in (
        ["generate", "--model", d, "--prompt", "Hi", "--max-tokens", "1"],
        ["plan", "--model", d, "--gpus", "1xH100"],
    ):
        r = subprocess.run([K2SERVE, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, (args, r.stdout)
        assert "Traceback" not in r.stderr, r.stderr
        assert name in r.stderr, (args, r.stderr)
    with pytest.raises(ValueError, match=name):
        LLM(d)
