"""`k2serve deploy`: every YAML parses; Kubernetes objects validate against the API schema
(kubernetes-validate, offline schemas); SLURM scripts pass `bash -n`; the unit has ExecStart."""

from __future__ import annotations

import json
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from k2serve.cli import main

K8S_VERSION = kubernetes_validate.latest_version()


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    out = {}
    for key, argv in {
        "hybrid": ["--model", "kimi-k2-thinking", "--gpus", "1xH200", "--cpu-memory", "1TB"],
        "tp8": ["--model", "kimi-k2-thinking", "--gpus", "8xH200"],
        "nofit": ["--model", "kimi-k2-instruct", "--gpus", "8xH100"],
    }.items():
        path = d / f"{key}.json"
        r = subprocess.run(
            [sys.executable, "-m", "k2serve.cli", "plan", *argv, "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        path.write_text(r.stdout)
        out[key] = path
    return out


def deploy(target, plan, out, *extra):
    return main(["deploy", target, "--plan", str(plan), "--out", str(out), *extra])


@pytest.mark.parametrize("plan_key", ["hybrid", "tp8"])
def test_k8s_objects_validate(plans, tmp_path, plan_key, capsys):
    assert deploy("k8s", plans[plan_key], tmp_path, "--namespace", "llm") == 0
    docs = {}
    for f in sorted(tmp_path.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            docs[doc["kind"]] = doc
    assert set(docs) == {"PersistentVolumeClaim", "Deployment", "Service"}
    plan = json.loads(plans[plan_key].read_text())
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == plan["num_gpus"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # the serve command is the plan's, with the model path moved to the volume
    cmd = c["command"]
    assert cmd[:2] == ["k2serve", "serve"] and cmd[cmd.index("--model") + 1].startswith("/models/")
    tail = plan["serve_args"][plan["serve_args"].index("--model") + 2 :]
    assert cmd[4 : 4 + len(tail)] == tail
    # the volume holds the weights
    size = docs["PersistentVolumeClaim"]["spec"]["resources"]["requests"]["storage"]
    assert int(size.removesuffix("Gi")) * 2**30 >= plan["weights"]["total"]
    # the download runs first, in the same pod (the RWO volume is mounted by nothing else)
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["k2serve", "download", "moonshotai/Kimi-K2-Thinking"]
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert {"cpu", "memory"} <= c["resources"]["requests"].keys()
    assert (
        docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    )
    if plan["num_cpu_experts"]:  # CPU experts: the pod asks for their RAM
        mem = c["resources"]["requests"]["memory"]
        assert int(mem.removesuffix("Gi")) * 2**30 >= plan["cpu_memory_needed"]


def test_validator_catches_a_broken_object():
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": "http-port"}]}}  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_slurm_scripts(plans, tmp_path):
    assert deploy("slurm", plans["tp8"], tmp_path, "--partition", "gpu") == 0
    serve = (tmp_path / "serve.sbatch").read_text()
    bench = (tmp_path / "bench.sbatch").read_text()
    for script in (serve, bench):
        r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --partition=gpu" in script
        assert "--tensor-parallel-size 8" in script
    assert "k2serve bench --base-url" in bench and "/health" in bench


def test_systemd_unit(plans, tmp_path):
    assert deploy("systemd", plans["hybrid"], tmp_path, "--name", "kimi") == 0
    text = (tmp_path / "kimi.service").read_text()
    sections = {line.strip() for line in text.splitlines() if line.startswith("[")}
    assert sections == {"[Unit]", "[Service]", "[Install]"}
    exec_start = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    assert exec_start.startswith("ExecStart=/") and "--num-gpu-experts" in exec_start
    env = next(x for x in text.splitlines() if x.startswith("Environment=MODEL_DIR="))
    assert env.split("=", 2)[2].startswith("/")


def test_refuses_plan_that_does_not_fit(plans, tmp_path, capsys):
    assert deploy("k8s", plans["nofit"], tmp_path) == 1
    assert "does not fit" in capsys.readouterr().err
    assert deploy("k8s", plans["nofit"], tmp_path, "--force") == 0


def test_bad_plan_file(tmp_path, capsys):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"fits": True}))
    assert deploy("k8s", p, tmp_path / "o") == 2
    assert "serve_args" in capsys.readouterr().err
