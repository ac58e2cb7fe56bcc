"""`k2serve plan`: print (or emit as JSON) what fits where, before anything is downloaded.

Owns: the flags, resolving `--model NAME|DIR` to a `ModelConfig`, and the text rendering of a
`k2serve.plan.Plan`. All arithmetic lives in `k2serve.plan`; nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from k2serve.config import KNOWN_MODELS, ConfigError, ModelConfig, known_model_config
from k2serve.hardware import GPU_PRESETS, format_bytes, parse_bandwidth, parse_gpus, parse_size
from k2serve.plan import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    Plan,
    plan,
)
from k2serve.plan_commands import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_MASTER_PORT,
    MASTER_ADDR_PLACEHOLDER,
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
        "--cpu-bandwidth", default=None, help="usable DRAM bandwidth, e.g. 300GB/s (default 250)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's maximum")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--kv-cache-dtype", choices=("auto", "bf16", "fp8"), default="bf16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--num-gpu-experts", type=int, default=None, help="routed experts per layer on the GPUs"
    )
    p.add_argument(
        "--expert-placement-file", default=None,
        help="routing counts (serve --record-routing): the GPU experts' measured hit rate",
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


def make_plan(args: argparse.Namespace) -> tuple[Plan, dict]:
    config, name, repo = resolve_model(args.model)
    gpus = args.gpus
    if gpus is None and (args.gpu_memory or args.gpu_bandwidth):
        raise ValueError("--gpu-memory / --gpu-bandwidth need --gpus COUNT (e.g. --gpus 2)")
    num_gpus, gpu = parse_gpus(gpus or DEFAULT_GPUS, args.gpu_memory, args.gpu_bandwidth)
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = f"models/{repo.split('/')[-1]}" if repo else name
    p = plan(
        config,
        model=model_dir,
        gpu=gpu,
        num_gpus=num_gpus,
        cpu_memory=parse_size(args.cpu_memory),
        cpu_bandwidth=parse_bandwidth(args.cpu_bandwidth) if args.cpu_bandwidth else None,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_experts=args.num_gpu_experts,
        **_routing(args, config),
        gpus_per_node=args.gpus_per_node,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    source = {"name": name, "hf_repo": repo, "model_dir": model_dir}
    source["gpus_assumed"] = gpus is None
    return p, source


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
    out.append(f"hardware {hw}; host RAM {gb(p.cpu_memory)}, {p.cpu_bandwidth / 1e9:.0f} GB/s")
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
    out.append(
        f"decode   roofline at batch 1: {p.decode_tokens_per_s:.0f} tok/s "
        f"({p.decode_tokens_per_s_full_context:.0f} at {p.max_model_len:,} tokens of context); "
        f"reads {gb(p.gpu_bytes_per_token)}/token per GPU + {gb(p.cpu_bytes_per_token)}/token "
        "from RAM (an upper bound: it leaves out kernel launches and all-reduce latency)"
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
            out.append(p.command)
    else:
        out.append(f"DOES NOT FIT ({len(p.reasons)} limit{'s' if len(p.reasons) > 1 else ''}):")
        for reason in p.reasons:
            out.append(f"  - {reason}")
        for s in p.suggestions:
            out.append(f"  would fit: {s}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    try:
        p, source = make_plan(args)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"k2serve plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**p.to_dict(), "source": source}, indent=2))
    else:
        print(render(p, source))
    return 0 if p.fits else 1
