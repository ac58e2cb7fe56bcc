"""`k2serve deploy k8s|slurm|systemd --plan plan.json --out DIR`.

Owns: turning a plan (the JSON of `k2serve plan --json`) into deployment files through the
Jinja templates in `templates/`, and the sizes those files request (volume, RAM, /dev/shm).

Invariants:
- The serve command in every file is the plan's `serve_args` with only the model path (and
  host/port, and for a multi-node plan each node's rank and node 0's address, taken from the
  scheduler: LWS_LEADER_ADDRESS / LWS_WORKER_INDEX, scontrol / SLURM_PROCID) rewritten for the
  target; nothing about placement is re-decided here.
- The checkpoint is complete before a server reads it: an init container in the server's own pod
  (one node), or a download Job / SLURM job that the servers wait for (several nodes).
- A plan that does not fit is refused (exit 1) unless `--force`.
- Rendering is strict: a missing template value is an error, not an empty string.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shlex
import sys
from pathlib import Path

from k2serve import __version__

TEMPLATES = Path(__file__).parent / "templates"
FILES = {
    "k8s": [
        ("k8s-pvc.yaml.j2", "pvc.yaml"),
        ("k8s-deployment.yaml.j2", "deployment.yaml"),  # downloads in an init container
        ("k8s-service.yaml.j2", "service.yaml"),
    ],
    "slurm": [
        ("slurm-download.sbatch.j2", "download.sbatch"),
        ("slurm-serve.sbatch.j2", "serve.sbatch"),
        ("slurm-submit.sh.j2", "submit.sh"),
        ("slurm-bench.sbatch.j2", "bench.sbatch"),
    ],
    "systemd": [("k2serve.service.j2", "{name}.service")],
}
# several nodes (the plan's nnodes > 1): a LeaderWorkerSet on a ReadWriteMany volume filled by a
# download Job the pods wait for; SLURM without the one-node bench script; no systemd unit
MULTINODE_FILES = {
    "k8s": [
        ("k8s-pvc.yaml.j2", "pvc.yaml"),
        ("k8s-download-job.yaml.j2", "download-job.yaml"),
        ("k8s-dist-secret.yaml.j2", "dist-secret.yaml"),
        ("k8s-lws.yaml.j2", "leaderworkerset.yaml"),
        ("k8s-service.yaml.j2", "service.yaml"),
    ],
    "slurm": FILES["slurm"][:3],
}
DOWNLOAD_MARKER = ".k2serve-download-complete"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", choices=sorted(FILES), help="what to write")
    p.add_argument("--plan", required=True, help="JSON written by `k2serve plan --json`")
    p.add_argument("--out", required=True, help="directory for the files")
    p.add_argument("--name", default="k2serve", help="resource / job / unit name")
    p.add_argument(
        "--image",
        default=f"k2serve:{__version__}",
        help="container image (k8s); the repository's Dockerfile builds the default: "
        f"docker build -t k2serve:{__version__} .",
    )
    p.add_argument("--namespace", default="default", help="Kubernetes namespace")
    p.add_argument("--storage-class", default=None, help="PVC storage class (cluster default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--models-root", default=None, help="checkpoint parent dir (slurm, systemd)")
    p.add_argument("--partition", default=None, help="SLURM partition")
    p.add_argument(
        "--download-partition", default=None, help="SLURM partition of the download job (no GPU)"
    )
    p.add_argument("--account", default=None, help="SLURM account")
    p.add_argument("--qos", default=None, help="SLURM quality of service (--qos)")
    p.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="LINE",
        help="a shell line run before k2serve in the SLURM jobs, e.g. 'module load cuda/12.4', "
        "'source /opt/k2serve/.venv/bin/activate', 'conda activate k2' (repeatable)",
    )
    p.add_argument(
        "--module", action="append", default=[], metavar="NAME",
        help="SLURM: 'module load NAME' before k2serve (repeatable)",
    )  # fmt: skip
    p.add_argument("--conda-env", default=None, help="SLURM: 'conda activate ENV' before k2serve")
    p.add_argument("--venv", default=None, help="SLURM: 'source VENV/bin/activate' before k2serve")
    p.add_argument(
        "--hf-home",
        default=None,
        help="HF_HOME for the download job (SLURM, systemd; default: huggingface_hub's)",
    )
    p.add_argument("--time", default="24:00:00", help="SLURM time limit")
    p.add_argument("--user", default="k2serve", help="systemd User=")
    p.add_argument("--k2serve-bin", default="/usr/local/bin/k2serve", help="systemd ExecStart")
    p.add_argument("--force", action="store_true", help="write files for a plan that does not fit")
    # ---- issue 29: which layout the files launch ----
    p.add_argument(
        "--parallel", choices=("auto", "tp", "dp-ep"), default="tp",
        help="tp (default): the plan's tensor-parallel launch; dp-ep: its data-parallel + "
        "expert-parallel alternative (`plan --json` field dp_ep); auto: the plan's "
        "recommendation",
    )  # fmt: skip


def choose_layout(plan: dict, parallel: str) -> dict:
    """The plan with the serve flags of the chosen layout (issue 29)."""
    dp = plan.get("dp_ep")
    want = parallel if parallel != "auto" else ("dp-ep" if dp and dp["recommend"] == "dp+ep"
                                                else "tp")  # fmt: skip
    if want == "tp":
        return plan
    if not dp:
        raise ValueError("--parallel dp-ep: the plan has no dp_ep field (one GPU, or written "
                         "by an older `k2serve plan --json`)")  # fmt: skip
    return {**plan, "serve_args": dp["serve_args"], "fits": dp["fits"],
            "reasons": dp["reasons"] or plan.get("reasons", [])}  # fmt: skip
    # ---- end issue 29 ----


def _serve_args(plan: dict, model_path: str, port: str) -> list[str]:
    args = list(plan["serve_args"])
    if "--model" in args:
        args[args.index("--model") + 1] = model_path
    return args + ["--host", "0.0.0.0", "--port", port]


def _setup_lines(a: argparse.Namespace) -> list[str]:
    """The environment set-up lines of the SLURM jobs: modules, conda, venv, then --setup."""
    lines = [f"module load {shlex.quote(m)}" for m in getattr(a, "module", None) or []]
    if getattr(a, "conda_env", None):
        lines += ['eval "$(conda shell.bash hook)"', f"conda activate {shlex.quote(a.conda_env)}"]
    if getattr(a, "venv", None):
        venv = os.path.abspath(a.venv)
        lines.append(f"source {shlex.quote(os.path.join(venv, 'bin', 'activate'))}")
    return lines + list(getattr(a, "setup", None) or [])


def context(plan: dict, a: argparse.Namespace, target: str = "k8s") -> dict:
    """Template values from the plan and the flags."""
    for key in ("serve_args", "num_gpus", "weights", "fits", "cpu_memory_needed"):
        if key not in plan:
            raise ValueError(
                f"--plan: field {key!r} is missing; write it with `k2serve plan --json`"
            )
    src = plan.get("source") or {}
    name_dir = os.path.basename(str(src.get("model_dir") or "model").rstrip("/")) or "model"
    download_name = src.get("hf_repo") or src.get("name") or "MODEL"
    model_gib = math.ceil(plan["weights"]["total"] / 2**30)
    cpu_gib = math.ceil(plan["cpu_memory_needed"] / 2**30) if plan.get("num_cpu_experts") else 0
    port = str(a.port)
    k8s_dir = f"/models/{name_dir}"
    local_dir = os.path.join(a.models_root, name_dir) if a.models_root else src.get("model_dir")
    local_dir = local_dir or name_dir
    if target == "systemd" and not os.path.isabs(local_dir):
        local_dir = os.path.join("/var/lib/k2serve/models", name_dir)  # units need absolute paths
    # jobs run from another directory than `deploy`: the path the plan named, made absolute here
    local_dir = os.path.abspath(local_dir)
    serve_k8s = ["k2serve", "serve", *_serve_args(plan, k8s_dir, port)]
    serve_local = _serve_args(plan, "$MODEL_DIR", "$PORT")
    quoted = " ".join(f'"{x}"' if x.startswith("$") else shlex.quote(x) for x in serve_local)
    # RAM: CPU experts plus 10% and 32 GiB for the process (a CPU-only plan: all it counted)
    if not plan["num_gpus"]:
        cpu_gib = math.ceil(plan["cpu_memory_needed"] / 2**30)
    nnodes = int(plan.get("nnodes", 1))
    # K2 host KV tier (issue 27): its pinned RAM (per node) on top of the experts'
    tier_gib = math.ceil(int(plan.get("kv_offloading_bytes", 0)) / nnodes / 2**30)
    mem_gib = math.ceil(cpu_gib * 1.1) + 32 + tier_gib if cpu_gib else 0
    num_gpus = int(plan["num_gpus"])
    gpus_per_pod = num_gpus // nnodes
    # a pod's request: the CPU experts' RAM as above, else room to stream the weights in
    pod_mem_gib = mem_gib or 64 + tier_gib
    # CPU threads: the plan's (one per physical core), else the CPUs the job asks for
    host = src.get("host") or {}
    env = dict(src.get("env") or {})
    cpus = min(64, max(8, 8 * gpus_per_pod)) if not cpu_gib else int(host.get("cores") or 64)
    if cpu_gib and "K2SERVE_CPU_THREADS" not in env:
        env["K2SERVE_CPU_THREADS"] = str(cpus)
    node = _serve_args(plan, k8s_dir, port)
    master_port = int(plan.get("master_port", 29500))
    marker = f"{k8s_dir}/{DOWNLOAD_MARKER}"
    node_local = list(serve_local)
    if "--master-port" in node_local:  # the sbatch passes $MASTER_PORT itself
        i = node_local.index("--master-port")
        del node_local[i : i + 2]
    node_shell = " ".join(f'"{x}"' if x.startswith("$") else shlex.quote(x) for x in node_local)
    return {
        "nnodes": nnodes,
        "gpus_per_pod": gpus_per_pod,
        "master_port": master_port,
        "marker": marker,
        "download_and_mark": " ".join(
            shlex.quote(x) for x in ["k2serve", "download", download_name, "--dir", k8s_dir]
        )
        + f" && touch {shlex.quote(marker)}",
        "leader_command": [
            "k2serve",
            "serve",
            *node,
            "--node-rank",
            "0",
            "--master-addr",
            "$(LWS_LEADER_ADDRESS)",
        ],  # fmt: skip
        "worker_command": [
            "k2serve",
            "serve",
            *node,
            "--node-rank",
            "$(LWS_WORKER_INDEX)",
            "--master-addr",
            "$(LWS_LEADER_ADDRESS)",
            "--headless",
        ],  # fmt: skip
        "dist_secret": f"{a.name}-dist",
        "dist_secret_value": secrets.token_hex(16),
        # inside bash -c '...' in the sbatch: a single quote must close, escape, reopen
        "serve_node_shell": node_shell.replace("'", "'\\''"),
        "download_partition": getattr(a, "download_partition", None),
        "name": a.name,
        "namespace": a.namespace,
        "image": a.image,
        "storage_class": a.storage_class,
        "port": a.port,
        "hf_repo": download_name,
        "hf_secret": f"{a.name}-hf-token",
        "api_secret": f"{a.name}-api-key",
        "source_name": src.get("name", download_name),
        "download_name": download_name,
        "download_command": ["k2serve", "download", download_name, "--dir", k8s_dir],
        "serve_command": serve_k8s,
        "serve_shell": f"k2serve serve {quoted}",
        "serve_exec": f"{a.k2serve_bin} serve "
        + " ".join(
            "${MODEL_DIR}" if x == "$MODEL_DIR" else "${PORT}" if x == "$PORT" else x
            for x in serve_local
        ),  # fmt: skip
        "num_gpus": int(plan["num_gpus"]),
        "gpu_name": (plan.get("gpu") or {}).get("name", "CPU"),
        "model_gib": model_gib,
        "pvc_gib": math.ceil(model_gib * 1.1),
        "cpu_gib": cpu_gib,
        "memory_gib": pod_mem_gib,
        "slurm_mem": f"{pod_mem_gib}G",
        "shm_gib": 16 if num_gpus > 1 else 4,
        # ~1 GiB/s from local NVMe: allow load time of the weights plus 10 minutes, in 10 s steps
        "startup_failures": max(60, math.ceil((model_gib + 600) / 10)),
        "cpus": cpus,
        "env": env,
        "qos": getattr(a, "qos", None),
        "setup_lines": _setup_lines(a),
        "hf_home": os.path.abspath(a.hf_home) if getattr(a, "hf_home", None) else None,
        "time_limit": a.time,
        "partition": a.partition,
        "account": a.account,
        "model_dir": local_dir,
        "user": a.user,
        "bench_input_len": 1024,
        "bench_output_len": 256,
        "bench_num_prompts": 200,
        "bench_concurrency": min(int(plan.get("max_num_seqs", 16)), 16),
    }


def render(target: str, plan: dict, a: argparse.Namespace) -> dict[str, str]:
    """{file name: text} for `target`."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    ctx = context(plan, a, target)
    files = FILES[target]
    if ctx["nnodes"] > 1:
        if target not in MULTINODE_FILES:
            raise ValueError(
                f"the plan spans {ctx['nnodes']} nodes: `deploy {target}` writes one machine's "
                "files; use k8s (LeaderWorkerSet) or slurm"
            )
        files = MULTINODE_FILES[target]
    return {out.format(name=a.name): env.get_template(t).render(**ctx) for t, out in files}


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.plan) as f:
            plan = json.load(f)
        if not isinstance(plan, dict) or "fits" not in plan:
            raise ValueError(
                f"--plan {args.plan!r} is not a plan (no 'fits' field); "
                "write one with `k2serve plan --json`"
            )
        plan = choose_layout(plan, getattr(args, "parallel", "tp"))  # issue 29
        if not plan.get("fits") and not args.force:
            why = "; ".join(plan.get("reasons") or [])
            print(f"k2serve deploy: the plan does not fit ({why}); use --force", file=sys.stderr)
            return 1
        files = render(args.target, plan, args)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"k2serve deploy: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for name, text in files.items():
        path = os.path.join(args.out, name)
        with open(path, "w") as f:
            f.write(text)
        if name.endswith((".sbatch", ".sh")):
            os.chmod(path, 0o755)
        print(path)
    return 0
