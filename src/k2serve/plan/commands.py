"""The commands a plan prints, and the node layout they imply: what `serve` must be given to
run the plan as computed, on one node, several nodes, or the CPU alone.

Invariants:
- Every flag printed exists in `k2serve serve` and means what the plan assumed: the CPU-only
  command sets --device cpu, --dtype bfloat16 (the plan counts 2-byte activations / cache) and
  --kv-cache-memory for the cache the plan reserved, so serve cannot fail "does not fit" where
  the plan said it fits.
- A GPU count above `gpus_per_node` spans whole nodes (`count % gpus_per_node == 0`): one
  command per node, node 0 serving HTTP and the others `--headless`.
- No torch import (plan must stay fast).
"""

from __future__ import annotations

import shlex

DEFAULT_GPUS_PER_NODE = 8
DEFAULT_MASTER_PORT = 29500
MASTER_ADDR_PLACEHOLDER = "$MASTER_ADDR"  # a shell variable: the printed commands run as-is
MAX_NODES_SUGGESTED = 2  # suggestions stay within hardware one can rent or buy as a unit


def node_layout(num_gpus: int, gpus_per_node: int) -> int:
    """-> number of nodes; ValueError for a count that does not fill whole nodes."""
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node={gpus_per_node} must be positive")
    if num_gpus <= gpus_per_node:
        return 1
    if num_gpus % gpus_per_node:
        raise ValueError(
            f"{num_gpus} GPUs with --gpus-per-node {gpus_per_node}: a plan over several nodes "
            f"uses whole nodes ({gpus_per_node}, {2 * gpus_per_node}, ... GPUs)"
        )
    return num_gpus // gpus_per_node


def valid_counts(valid_tp, gpus_per_node: int, max_nodes: int = MAX_NODES_SUGGESTED) -> list[int]:
    """GPU counts a suggestion may name: tensor-parallel-valid and within one node, or whole
    nodes up to `max_nodes`."""
    counts = [n for n in range(1, gpus_per_node + 1) if valid_tp(n)]
    counts += [k * gpus_per_node for k in range(2, max_nodes + 1) if valid_tp(k * gpus_per_node)]
    return counts


def serve_args(
    model: str,
    num_gpus: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_dtype: str,
    gpu_memory_utilization: float,
    *,
    nnodes: int = 1,
    master_port: int = DEFAULT_MASTER_PORT,
    cpu_kv_cache_bytes: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> list[str]:
    """The flags every node gets (node rank, node 0's address and --headless come on top)."""
    args = ["--model", model, "--max-model-len", str(max_model_len)]
    args += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:  # the step budget the activations were sized for
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if num_gpus:
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    else:
        # NOTE: serve's CPU defaults (float32, a small KV budget) are not what the plan counted
        args += ["--device", "cpu", "--dtype", "bfloat16"]
        if cpu_kv_cache_bytes:
            args += ["--kv-cache-memory", str(cpu_kv_cache_bytes)]
    if num_gpus > 1:
        args += ["--tensor-parallel-size", str(num_gpus), "--enable-expert-parallel"]
    if kv_cache_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if nnodes > 1:
        args += ["--nnodes", str(nnodes), "--master-port", str(master_port)]
    return args


def node_args(node_rank: int, master_addr: str) -> list[str]:
    """What one node adds to `serve_args` in a multi-node plan."""
    extra = ["--node-rank", str(node_rank), "--master-addr", master_addr]
    return extra + (["--headless"] if node_rank else [])


def _shell(args: list[str]) -> str:
    return " ".join(f'"{a}"' if a.startswith("$") else shlex.quote(a) for a in args)


def node_commands(args: list[str], nnodes: int, master_addr: str) -> list[str]:
    """One `k2serve serve` command line per node (just one without several nodes)."""
    if nnodes <= 1:
        return ["k2serve serve " + _shell(args)]
    return ["k2serve serve " + _shell(args + node_args(r, master_addr)) for r in range(nnodes)]
