"""`k2serve plan`: print (or emit as JSON) what fits where, before anything is downloaded.

Owns: the flags, resolving `--model NAME|DIR` to a `ModelConfig`, and the text rendering of a
`k2serve.plan.Plan`. All arithmetic lives in `k2serve.plan`; nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from k2serve.config import KNOWN_MODELS, ConfigError, ModelConfig, known_model_config
from k2serve.plan.commands import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_MASTER_PORT,
    MASTER_ADDR_PLACEHOLDER,
)
from k2serve.plan.hardware import GPU_PRESETS, format_bytes, parse_bandwidth, parse_gpus, parse_size
from k2serve.plan.host import HostCpu, detect_host, measure_bandwidth
from k2serve.plan.planner import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    Plan,
    plan,
)

DEFAULT_GPUS = "8xH200"

ROW_NAMES = {
    "attention": "attention (MLA) + norms",
    "dense_mlp": "dense MLP (layer 0)",
    "shared_experts": "shared experts",
    "router": "routers",
    "routed_experts": "routed experts",
    "embeddings_lm_head": "embeddings + lm_head",
    "vision": "vision tower",
    "vision_activations": "vision encoder activations",
    "activations": "activations",
    "cuda_graphs": "CUDA graph pool",
    "runtime": "CUDA context + NCCL",
    "layerwise_prefill": "layer-wise prefill buffers",
    "kv_cache": "KV cache",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="kimi-k2-thinking",
        help=f"a built-in name ({', '.join(KNOWN_MODELS)}) or a checkpoint directory / config.json",
    )
    p.add_argument(
        "--gpus",
        default=None,
        help=f"COUNTxGPU (8xH100, 16xH200), COUNTxMEMORY for a GPU not in the table (2x94GB), "
        f"or none for CPU only. Known: {', '.join(GPU_PRESETS)}. Default: {DEFAULT_GPUS}, "
        "and the output says it was assumed",
    )
    p.add_argument("--gpu-memory", default=None, help="memory of one GPU, e.g. 94GB (overrides)")
    p.add_argument(
        "--gpu-bandwidth", default=None, help="memory bandwidth of one GPU, e.g. 3.9TB/s"
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=DEFAULT_GPUS_PER_NODE,
        help=f"GPUs in one node (default {DEFAULT_GPUS_PER_NODE}); more GPUs span whole nodes, "
        "with one serve command per node",
    )
    p.add_argument(
        "--master-addr",
        default=MASTER_ADDR_PLACEHOLDER,
        help="node 0's address in multi-node commands (default: the shell's $MASTER_ADDR)",
    )
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT)
    p.add_argument("--cpu-memory", default="0", help="host RAM for CPU experts, e.g. 1TB (0: none)")
    p.add_argument(
        "--cpu-bandwidth",
        "--memory-bandwidth",
        default=None,
        help="usable DRAM bandwidth, e.g. 300GB/s, or 'measure' (this machine; default 250GB/s)",
    )
    g = p.add_argument_group("host CPU (CPU-only and hybrid plans)")
    g.add_argument(
        "--cpu",
        default=None,
        metavar="this|MODEL",
        help="'this': read cores, sockets, NUMA nodes and RAM from this machine; else the CPU "
        "model's name, for the record",
    )
    g.add_argument("--cpu-model", dest="cpu", default=None, help=argparse.SUPPRESS)
    g.add_argument(
        "--cpu-cores", "--cores", type=int, default=None, help="physical cores, all sockets"
    )
    g.add_argument("--cpu-sockets", "--sockets", type=int, default=None)
    g.add_argument("--numa-nodes", "--cpu-numa-nodes", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's maximum")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="step token budget the activations are sized for (default: serve's on the GPU: "
        f"8192 from 70 GiB, else {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "bf16", "fp8", "fp8_e4m3"),
        default="bf16",
        help="fp8_e4m3 (vLLM / SGLang spelling) = fp8",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--num-gpu-experts", type=int, default=None, help="routed experts per layer on the GPUs"
    )
    p.add_argument(
        "--expert-placement-file", default=None,
        help="routing counts (serve --record-routing): the GPU experts' measured hit rate",
    )  # fmt: skip
    p.add_argument(
        "--kv-offloading-size", type=float, default=None,
        help="GiB of host RAM for the KV host tier, over all GPUs (default: half the RAM the "
        "CPU experts leave of --cpu-memory; 0: none)",
    )  # fmt: skip  # K2 host KV tier (issue 27)
    p.add_argument(
        "--swap-space", type=float, default=None,
        help="GiB of host RAM per GPU for the KV host tier (vLLM's older spelling)",
    )  # fmt: skip
    p.add_argument("--model-dir", default=None, help="checkpoint path used in the serve command")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def resolve_model(name_or_dir: str) -> tuple[ModelConfig, str, str | None]:
    """(config, display name, Hugging Face repo id or None)."""
    if name_or_dir.lower() in KNOWN_MODELS:
        key = name_or_dir.lower()
        return ModelConfig.from_hf(known_model_config(key)), key, KNOWN_MODELS[key][1]
    if os.path.exists(name_or_dir):
        return ModelConfig.from_hf(name_or_dir), name_or_dir, None
    leaf = os.path.basename(os.path.normpath(name_or_dir)).lower()
    for key, (_, repo) in KNOWN_MODELS.items():  # models/Kimi-K2.5, not downloaded yet
        if leaf == repo.split("/")[-1].lower():
            return ModelConfig.from_hf(known_model_config(key)), key, repo
    raise ConfigError(
        f"--model {name_or_dir!r} is neither a known model ({', '.join(KNOWN_MODELS)}) "
        "nor an existing checkpoint directory"
    )


def _routing(args: argparse.Namespace, config) -> dict:
    path = getattr(args, "expert_placement_file", None)
    if not path:
        return {}
    from k2serve.moe.placement import load_routing_counts

    return dict(routing_counts=load_routing_counts(path, config), expert_placement_file=path)


def _kv_offloading_size(args: argparse.Namespace, num_gpus: int) -> float | None:
    """GiB over all GPUs: --kv-offloading-size, else --swap-space x GPUs (None: the plan's)."""
    size = getattr(args, "kv_offloading_size", None)
    swap = getattr(args, "swap_space", None)
    return swap * max(num_gpus, 1) if size is None and swap is not None else size


def make_plan(args: argparse.Namespace) -> tuple[Plan, dict]:
    config, name, repo = resolve_model(args.model)
    gpus = args.gpus
    if gpus is None and (args.gpu_memory or args.gpu_bandwidth):
        raise ValueError("--gpu-memory / --gpu-bandwidth need --gpus COUNT (e.g. --gpus 2)")
    num_gpus, gpu = parse_gpus(gpus or DEFAULT_GPUS, args.gpu_memory, args.gpu_bandwidth)
    host = _host(args)
    if host.memory_bytes and args.cpu_memory == "0" and getattr(args, "cpu", None) == "this":
        args.cpu_memory = str(host.memory_bytes)
    model_dir = args.model_dir
    if model_dir is None and name != args.model and not os.path.exists(args.model):
        if args.model.lower() not in KNOWN_MODELS:
            model_dir = args.model  # a path naming a known checkpoint: it goes there
    if model_dir is None:
        model_dir = f"models/{repo.split('/')[-1]}" if repo else name
    p = plan(
        config,
        model=model_dir,
        gpu=gpu,
        num_gpus=num_gpus,
        cpu_memory=parse_size(args.cpu_memory),
        cpu_bandwidth=host.bandwidth,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype="fp8" if args.kv_cache_dtype == "fp8_e4m3" else args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_experts=args.num_gpu_experts,
        **_routing(args, config),
        gpus_per_node=args.gpus_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
        kv_offloading_size=_kv_offloading_size(args, num_gpus),  # K2 host KV tier
    )
    source = {"name": name, "hf_repo": repo, "model_dir": model_dir}
    source["gpus_assumed"] = gpus is None
    source["host"] = host.to_dict()
    if host.cores and (p.num_cpu_experts or not p.num_gpus):
        # the CPU kernel's threads: one per physical core (serve reads K2SERVE_CPU_THREADS)
        source["env"] = {"K2SERVE_CPU_THREADS": str(host.cores)}
    return p, source


def _host(args: argparse.Namespace) -> HostCpu:
    """The host CPU facts from --cpu / --cpu-cores / --cpu-sockets / --numa-nodes /
    --cpu-bandwidth (given values win over what --cpu this reads)."""
    cpu = getattr(args, "cpu", None)
    host = detect_host() if cpu == "this" else HostCpu(model=cpu)
    for key, flag in (("cores", "--cpu-cores"), ("sockets", "--cpu-sockets"),
                      ("numa_nodes", "--numa-nodes")):  # fmt: skip
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
            host = replace(host, **{key: value})
    bw = args.cpu_bandwidth
    if bw == "measure":
        host = replace(host, bandwidth=measure_bandwidth(), bandwidth_source="measured")
    elif bw:
        host = replace(host, bandwidth=parse_bandwidth(bw), bandwidth_source="given")
    return host


def render(p: Plan, source: dict) -> str:
    w, out = p.weights, []
    gb = format_bytes
    gpu = p.gpu or {}  # a dict whenever num_gpus > 0
    gpu = p.gpu or {}  # a dict whenever num_gpus > 0
    hw = (
        "no GPU"
        if not p.num_gpus
        else (
            f"{p.num_gpus}x {gpu['name']} ({gb(gpu['memory_bytes'])}, "
            f"{gpu['bandwidth'] / 1e12:.2f} TB/s each"
            + (", assumed" if gpu.get("bandwidth_assumed") else "")
            + ")"
            + (f" = {p.nnodes} nodes of {p.gpus_per_node}" if p.nnodes > 1 else "")
        )
    )
    if source.get("gpus_assumed"):
        hw += " (assumed: no --gpus given; --gpus none plans for the CPU alone)"
    out.append(f"model    {source['name']} ({p.quantization})")
    host = source.get("host") or {}
    bw_src = host.get("bandwidth_source", "assumed")
    out.append(
        f"hardware {hw}; host RAM {gb(p.cpu_memory)}, {p.cpu_bandwidth / 1e9:.0f} GB/s ({bw_src})"
    )
    cpu_plan = bool(p.num_cpu_experts or not p.num_gpus)
    if cpu_plan:
        facts = HostCpu(**host).describe() if host else "CPU model not given"
        out.append(f"host CPU {facts}")
        if not host.get("cores") or bw_src == "assumed":
            out.append(
                "         the CPU estimate needs the box's facts: --cpu this (this machine), or "
                "--cpu-cores / --cpu-sockets / --numa-nodes and --cpu-bandwidth GB/s|measure"
            )
    n_exp = p.num_routed_experts * p.num_moe_layers
    out.append(
        f"weights  {gb(w['total'])}: routed experts {gb(w['routed_experts'])} "
        f"({n_exp} x {gb(p.expert_bytes)}), everything else {gb(w['total'] - w['routed_experts'])}"
    )
    if p.devices:
        d = p.devices[0]
        same = all(x.rows == d.rows for x in p.devices)
        head = f"per GPU (all {len(p.devices)} alike)" if same and len(p.devices) > 1 else d.device
        out.append("")
        out.append(head)
        for key, val in d.rows.items():
            if key in ("vision", "vision_activations", "layerwise_prefill") and not val:
                continue
            out.append(f"  {ROW_NAMES.get(key, key):<32}{gb(val):>12}")
        out.append(
            f"  {'total / usable':<32}{gb(d.used):>12} of {gb(d.capacity)} "
            f"({p.gpu_memory_utilization:g} x {gb(gpu['memory_bytes'])})"
        )
    out.append("")
    per_gpu = p.num_gpu_experts // max(p.num_gpus, 1)
    if p.num_gpus:
        out.append(
            f"experts  {p.num_gpu_experts} of {p.num_routed_experts} per MoE layer on the GPUs "
            f"(EP={p.expert_parallel_size}, {per_gpu} per GPU per layer)"
        )
    ram = f"RAM needed {gb(p.cpu_memory_needed)}"
    if p.num_cpu_experts:
        out.append(
            f"         {p.num_cpu_experts} per layer in host RAM "
            f"({p.num_cpu_experts * p.num_moe_layers} experts); {ram}"
        )
    elif not p.num_gpus:
        out.append(f"CPU only: {ram}")
    out.append(
        f"KV cache {p.kv_bytes_per_token:,} bytes/token ({p.kv_cache_dtype} latent); "
        f"{p.kv_cache_tokens:,} tokens = {p.full_length_seqs} x {p.max_model_len:,}-token "
        f"sequences, or {p.max_num_seqs} sequences of "
        f"{p.kv_cache_tokens // p.max_num_seqs:,} tokens on average"
    )
    if p.devices:
        out.append(_kv_arithmetic(p))
    out.append(
        f"decode   roofline at batch 1: {p.decode_tokens_per_s:.0f} tok/s "
        f"({p.decode_tokens_per_s_full_context:.0f} at {p.max_model_len:,} tokens of context); "
        f"reads {gb(p.gpu_bytes_per_token)}/token per GPU + {gb(p.cpu_bytes_per_token)}/token "
        "from RAM (an upper bound: it leaves out kernel launches and all-reduce latency)"
    )
    if cpu_plan:
        out.append(
            f"         = {gb(p.cpu_bytes_per_token)} read from RAM per token / "
            f"{p.cpu_bandwidth / 1e9:.0f} GB/s ({bw_src}); CPU decode is usually slower than "
            "this roofline (compute, NUMA traffic), and measured CPU-only K2 serving is 2-4 tok/s"
            if not p.num_gpus
            else f"         the CPU experts' share: {gb(p.cpu_bytes_per_token)}/token at "
            f"{p.cpu_bandwidth / 1e9:.0f} GB/s ({bw_src})"
        )
    for note in p.notes:
        out.append(f"note     {note}")
    out.append("")
    if p.fits:
        if source.get("hf_repo"):
            where = " (on every node, or once on shared storage)" if p.nnodes > 1 else ""
            out.append(f"# download{where}:")
            out.append(f"k2serve download {source['name']} --dir {source['model_dir']}")
        if p.nnodes > 1:
            out.append(
                "# on every node: export MASTER_ADDR=<address of node 0> "
                "K2SERVE_DIST_SECRET=<one secret, the same on every node>"
            )
            for r, cmd in enumerate(p.node_commands):
                role = "serves HTTP" if r == 0 else "headless worker"
                out.append(f"# node {r} of {p.nnodes} ({role}):")
                out.append(cmd)
        else:
            env = " ".join(f"{k}={v}" for k, v in (source.get("env") or {}).items())
            out.append((env + " " if env else "") + p.command)
    else:
        out.append(f"DOES NOT FIT ({len(p.reasons)} limit{'s' if len(p.reasons) > 1 else ''}):")
        for reason in p.reasons:
            out.append(f"  - {reason}")
        for s in p.suggestions:
            out.append(f"  would fit: {s}")
    return "\n".join(out)


def _kv_arithmetic(p: Plan) -> str:
    """How the KV token count follows from one GPU's budget (every TP rank holds every token's
    latent, so this is also the whole server's capacity)."""
    gb = format_bytes
    d = p.devices[0]
    kv = d.rows.get("kv_cache", 0)
    other = d.used - kv
    return (
        f"KV math  per GPU: {p.gpu_memory_utilization:g} x memory = {gb(d.capacity)}, minus "
        f"weights + activations + graphs + runtime {gb(other)} = {gb(kv)} for the cache; "
        f"{gb(kv)} / {p.kv_bytes_per_token:,} bytes/token = {p.kv_cache_tokens:,} tokens "
        f"(whole pages of 16). Activations are sized for --max-num-batched-tokens "
        f"{p.max_num_batched_tokens} and --max-num-seqs {p.max_num_seqs}: larger budgets, or an "
        f"engine that profiles at its own, leave fewer tokens"
    )


def run(args: argparse.Namespace) -> int:
    try:
        p, source = make_plan(args)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"k2serve plan: {e}", file=sys.stderr)
        return 2
    # ---- issue 29: the DP+EP alternative and the recommendation (k2serve.plan.dp) ----
    from k2serve.plan.dp import dp_ep_plan
    from k2serve.plan.dp import render as render_dp

    dp = dp_ep_plan(resolve_model(args.model)[0], p) if p.num_gpus > 1 else None
    # ---- end issue 29 ----
    if args.json:
        d = {**p.to_dict(), "source": source}
        if dp is not None:
            d["dp_ep"] = dp.to_dict()
        env = " ".join(f"{k}={v}" for k, v in (source.get("env") or {}).items())
        if env and p.nnodes == 1:
            d["command"] = f"{env} {d['command']}"
        print(json.dumps(d, indent=2))
    else:
        print(render(p, source) + ("\n" + "\n".join(render_dp(dp, p)) if dp else ""))
    return 0 if p.fits else 1
