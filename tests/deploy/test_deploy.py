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
        "hybrid_cores": [
            "--model",
            "kimi-k2-thinking",
            "--gpus",
            "1xH200",
            "--cpu-memory",
            "1TB",
            "--cpu-cores",
            "96",
            "--max-num-batched-tokens",
            "8192",
        ],
        "cpu": [
            "--model",
            "kimi-k2-thinking",
            "--gpus",
            "none",
            "--cpu-memory",
            "1TB",
            "--max-model-len",
            "8192",
        ],
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
        assert "#SBATCH --partition=gpu" in script
    assert "#SBATCH --gpus-per-node=8" in serve and "--tensor-parallel-size 8" in serve
    assert "--max-num-batched-tokens 8192" in serve  # serve's default on an H200
    assert "--gpus" not in bench and "k2serve serve" not in bench  # targets the running server
    assert 'k2serve bench --base-url "$SERVER_URL"' in bench and "/health" in bench
    assert "head -n" not in serve + bench
    mem = next(x for x in serve.splitlines() if x.startswith("#SBATCH --mem="))
    assert mem == "#SBATCH --mem=64G"  # the plan's figure, not the whole node (--mem=0)


def test_slurm_site_options_and_absolute_paths(plans, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--qos", "high", "--setup", "module load cuda/12.4", "--setup",
            "source /opt/venv/bin/activate", "--hf-home", "hf-cache"]  # fmt: skip
    assert deploy("slurm", plans["hybrid_cores"], tmp_path / "out", *argv) == 0
    for name in ("serve.sbatch", "download.sbatch", "bench.sbatch"):
        text = (tmp_path / "out" / name).read_text()
        assert "#SBATCH --qos=high" in text
        assert "module load cuda/12.4\nsource /opt/venv/bin/activate\n" in text
        assert f"export HF_HOME=${{HF_HOME:-{tmp_path}/hf-cache}}" in text
        if name == "bench.sbatch":
            continue  # it targets the running server
        model_dir = next(x for x in text.splitlines() if x.startswith("MODEL_DIR="))
        assert model_dir == f"MODEL_DIR=${{MODEL_DIR:-{tmp_path}/models/Kimi-K2-Thinking}}"
    serve = (tmp_path / "out" / "serve.sbatch").read_text()
    assert deploy("slurm", plans["tp8"], tmp_path / "env", "--module", "cuda/12.4", "--conda-env",
                  "k2", "--venv", "venv") == 0  # fmt: skip
    text = (tmp_path / "env" / "serve.sbatch").read_text()
    assert (f"module load cuda/12.4\neval \"$(conda shell.bash hook)\"\nconda activate k2\n"
            f"source {tmp_path}/venv/bin/activate\n") in text  # fmt: skip
    assert "export K2SERVE_CPU_THREADS=${K2SERVE_CPU_THREADS:-96}" in serve
    assert "#SBATCH --cpus-per-task=96" in serve and "--max-num-batched-tokens 8192" in serve


def test_slurm_bench_targets_the_running_serve_job(plans, tmp_path):
    assert deploy("slurm", plans["tp8"], tmp_path) == 0
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {
        "squeue": "#!/bin/bash\necho 'gpu-[07-08]'\n",
        "scontrol": "#!/bin/bash\nprintf 'gpu-07\\ngpu-08\\n'\n",
        "curl": '#!/bin/bash\necho "$@" >> "$LOG"\n',
        "k2serve": '#!/bin/bash\necho k2serve "$@" >> "$LOG"\n',
    }
    for name, text in stubs.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "LOG": str(log)}
    r = subprocess.run(["bash", str(tmp_path / "bench.sbatch")], env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    calls = log.read_text()
    assert "http://gpu-07:8000/health" in calls
    assert "k2serve bench --base-url http://gpu-07:8000 --dataset-name random" in calls


def test_k8s_hybrid_sets_the_cpu_threads(plans, tmp_path):
    assert deploy("k8s", plans["hybrid_cores"], tmp_path) == 0
    docs = list(yaml.safe_load_all((tmp_path / "deployment.yaml").read_text()))
    c = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "K2SERVE_CPU_THREADS", "value": "96"} in c["env"]
    assert c["resources"]["requests"]["cpu"] == "96"
    assert deploy("k8s", plans["tp8"], tmp_path / "tp8") == 0
    text = (tmp_path / "tp8" / "deployment.yaml").read_text()
    assert "K2SERVE_CPU_THREADS" not in text  # all experts on the GPUs


def test_systemd_unit_of_a_cpu_plan_says_cpu(plans, tmp_path):
    assert deploy("systemd", plans["cpu"], tmp_path) == 0
    text = (tmp_path / "k2serve.service").read_text()
    assert "on the CPU." in text.splitlines()[0] and "0x" not in text


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
