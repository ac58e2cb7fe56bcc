"""Black-box CLI checks: bad input gives a one-line error naming the problem, never a traceback;
files written by `k2serve deploy` drive `k2serve serve` the way they claim to."""

from __future__ import annotations

import json
import subprocess

import httpx
import yaml

from .conftest import K2SERVE, ServeProcess


def k2(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [K2SERVE, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def test_generate_missing_model_dir_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    r = k2("generate", "--model", str(missing), "--prompt", "Hi")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert str(missing) in r.stderr


def _plan_json(tmp_path) -> str:
    path = tmp_path / "plan.json"
    r = k2("plan", "--model", "kimi-k2-thinking", "--gpus", "8xH200", "--json")
    assert r.returncode == 0, r.stderr
    path.write_text(r.stdout)
    return str(path)


def test_deploy_rejects_plans_that_are_not_plans(tmp_path):
    for i, body in enumerate(["{}", "[]", '"x"']):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(body)
        r = k2("deploy", "k8s", "--plan", str(bad), "--out", str(tmp_path / f"out{i}"))
        assert r.returncode != 0
        assert "Traceback" not in r.stderr, r.stderr
        # a file that is no plan at all must not be reported as a plan that "does not fit"
        assert "does not fit" not in r.stderr, r.stderr
        assert "plan" in r.stderr


def test_k8s_api_key_secret_reaches_the_server(tmp_path):
    """The Deployment feeds the API-key secret through an env var: `k2serve serve` must honour
    that very variable, or the deployed server runs without authentication."""
    out = tmp_path / "k8s"
    r = k2("deploy", "k8s", "--plan", _plan_json(tmp_path), "--out", str(out))
    assert r.returncode == 0, r.stderr
    dep = yaml.safe_load((out / "deployment.yaml").read_text())
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    secret_vars = [e["name"] for e in env if "secretKeyRef" in e.get("valueFrom", {})]
    assert secret_vars, "the Deployment passes no secret to the server"
    srv = ServeProcess("--max-model-len", "256", env={v: "sk-from-secret" for v in secret_vars})
    try:
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401
        ok = httpx.get(
            srv.url + "/v1/models",
            headers={"Authorization": "Bearer sk-from-secret"},
            timeout=10,
        )
        assert ok.status_code == 200
        assert json.loads(ok.text)["object"] == "list"
    finally:
        srv.stop()


def test_chat_shows_the_answer_without_raw_thinking_markers():
    r = subprocess.run(
        [K2SERVE, "chat", "--temperature", "0"],
        input="Hello\nHello\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "</think>" not in r.stdout and "<think>" not in r.stdout, r.stdout
    # the demo greets back on both turns: the answer reaches the terminal
    assert r.stdout.count("How can I help") == 2, r.stdout


def test_make_checkpoint_onto_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    r = k2("make-checkpoint", str(f), "--preset", "tiny")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert str(f) in r.stderr
    assert f.read_text() == "x"


def test_engine_seed_out_of_int64_is_named():
    big = str(2**70)
    for args in (
        ["serve", "--port", "1", "--seed", big],
        ["generate", "--prompt", "Hi", "--seed", big],
    ):
        r = k2(*args)
        assert r.returncode != 0
        assert "Traceback" not in r.stderr, r.stderr
        assert "seed" in r.stderr, r.stderr
