"""The data-parallel + expert-parallel alternative to a tensor-parallel plan (issue 29), and which
of the two to run. Pure (no torch), computed from the same `plan` formulas.

Per GPU, DP+EP holds the whole attention, dense layers, shared experts, routers, embeddings and
lm_head, (E + R) / W routed-expert slots per MoE layer (R redundant slots for EPLB), and its own
latent KV cache of whole sequences; TP splits the attention but every rank keeps the whole
latent cache (MLA's latent is shared by the heads), so the cache holds the same tokens on every
GPU. With W GPUs, DP+EP caches W times the tokens of TP whenever its weights leave as much room
per GPU, and a token's hidden state only travels to the experts it chose.

Recommendation: DP+EP when it fits and the workload keeps every rank busy (max_num_seqs of at
least 2 sequences per GPU); TP otherwise (a few sequences: TP spreads each one over all GPUs,
which is what lowers per-token latency). Both launches are printed either way.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from k2serve.memory import RUNTIME_RESERVE_BYTES, activation_bytes
from k2serve.plan import commands as pc
from k2serve.plan.planner import DEFAULT_PAGE_SIZE, Plan
from k2serve.plan.weights import weight_breakdown

MIN_SEQS_PER_GPU = 2  # below this, ranks idle on dummy batches: TP is the better layout


@dataclass
class DPEPPlan:
    data_parallel_size: int
    num_redundant_experts: int
    fits: bool
    rows: dict[str, int]  # bytes on one GPU, as the TP plan's rows
    kv_cache_tokens_per_gpu: int
    kv_cache_tokens_total: int
    max_num_seqs_per_rank: int
    recommend: str  # "tp" or "dp+ep"
    reason: str
    serve_args: list[str]
    node_commands: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def redundant_slots(num_experts: int, num_gpus: int) -> int:
    """One extra slot per GPU when that keeps the slots even, else the fewest that do."""
    r = num_gpus
    while (num_experts + r) % num_gpus:
        r += 1
    return r


def dp_ep_plan(config, p: Plan) -> DPEPPlan | None:
    """The DP+EP layout for the GPUs of `p` (None with fewer than 2 GPUs)."""
    W = p.num_gpus
    if W < 2 or not p.gpu:
        return None
    w = weight_breakdown(config)
    E, layers, eb = config.n_routed_experts, w.num_moe_layers, w.expert_bytes
    R = redundant_slots(E, W)
    per_rank = math.ceil(p.max_num_seqs / W)
    tokens = p.max_num_batched_tokens
    rows = {
        "attention": w.attention_sharded + w.attention_replicated,
        "dense_mlp": w.dense_mlp,
        "shared_experts": w.shared_experts,
        "router": w.router,
        "routed_experts": (E + R) // W * layers * eb,
        "embeddings_lm_head": w.embeddings,
        "vision": w.vision,
        "activations": activation_bytes(config, tokens, per_rank, 1),
        # all-to-all send + receive buffers of one layer: every routed copy of every token
        "all_to_all": 2 * tokens * config.num_experts_per_tok * config.hidden_size * 2,
        "runtime": RUNTIME_RESERVE_BYTES,
        "kv_cache": 0,
    }
    cap = int(p.gpu["memory_bytes"] * p.gpu_memory_utilization)
    rows["kv_cache"] = max(0, cap - sum(rows.values()))
    kv_tokens = rows["kv_cache"] // p.kv_bytes_per_token // DEFAULT_PAGE_SIZE * DEFAULT_PAGE_SIZE
    reasons = []
    if sum(rows.values()) > cap:
        reasons.append(f"one GPU's weights need {(sum(rows.values())) / 2**30:.1f} GiB of "
                       f"{cap / 2**30:.1f} GiB")  # fmt: skip
    if kv_tokens < p.max_model_len:
        reasons.append(f"max_model_len={p.max_model_len} does not fit one GPU's cache "
                       f"({kv_tokens} tokens)")  # fmt: skip
    fits = not reasons
    if not fits:
        recommend, reason = "tp", "DP+EP does not fit: " + "; ".join(reasons)
    elif p.max_num_seqs < MIN_SEQS_PER_GPU * W:
        recommend = "tp"
        reason = (f"max_num_seqs={p.max_num_seqs} is under {MIN_SEQS_PER_GPU} sequences per GPU: "
                  "TP spreads each sequence over all GPUs (lower latency per token)")  # fmt: skip
    else:
        recommend = "dp+ep"
        reason = (f"throughput at {p.max_num_seqs} sequences: each GPU caches whole sequences "
                  f"({kv_tokens * W:,} tokens over {W} GPUs, TP {p.kv_cache_tokens:,}) and sends "
                  "tokens only to the experts they chose (no all-reduce per layer)")  # fmt: skip
    eplb = json.dumps({"window_size": 1000, "step_interval": 3000, "num_redundant_experts": R},
                      separators=(",", ":"))  # fmt: skip
    args = ["--model", p.serve_args[p.serve_args.index("--model") + 1],
            "--max-model-len", str(p.max_model_len), "--max-num-seqs", str(per_rank),
            "--gpu-memory-utilization", str(p.gpu_memory_utilization),
            "--data-parallel-size", str(W), "--enable-expert-parallel",
            "--enable-eplb", "--eplb-config", eplb]  # fmt: skip
    if p.kv_cache_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    local = p.gpus_per_node if p.nnodes > 1 else W
    if p.nnodes > 1:
        # the form deploy's templates use (node rank and address come per node)
        args += ["--nnodes", str(p.nnodes), "--master-port", str(p.master_port)]
    return DPEPPlan(
        data_parallel_size=W,
        num_redundant_experts=R,
        fits=fits,
        rows=rows,
        kv_cache_tokens_per_gpu=kv_tokens,
        kv_cache_tokens_total=kv_tokens * W,
        max_num_seqs_per_rank=per_rank,
        recommend=recommend,
        reason=reason,
        serve_args=args,
        node_commands=_vllm_style_commands(args, p.nnodes, local, p.master_port),
        reasons=reasons,
    )


def _vllm_style_commands(args: list[str], nnodes: int, local: int, port: int) -> list[str]:
    """One command per node in vLLM's spelling (Moonshot's DP+EP guide)."""
    if nnodes <= 1:
        return ["k2serve serve " + pc._shell(args)]
    base = args[: args.index("--nnodes")]
    out = []
    for r in range(nnodes):
        node = base + ["--data-parallel-size-local", str(local),
                       "--data-parallel-address", pc.MASTER_ADDR_PLACEHOLDER,
                       "--data-parallel-rpc-port", str(port)]  # fmt: skip
        if r:
            node += ["--headless", "--data-parallel-start-rank", str(r * local)]
        out.append("k2serve serve " + pc._shell(node))
    return out


def render(d: DPEPPlan, p: Plan) -> list[str]:
    """Lines `k2serve plan` prints after the TP plan."""
    gb = 2**30
    out = ["", f"recommended: {d.recommend.upper()} ({d.reason})", ""]
    out.append(
        f"# DP+EP alternative: {d.data_parallel_size} data-parallel ranks, "
        f"{d.num_redundant_experts} redundant expert slots (EPLB), {d.max_num_seqs_per_rank} "
        f"sequences per rank; per GPU {sum(d.rows.values()) / gb:.1f} GiB with "
        f"{d.rows['kv_cache'] / gb:.1f} GiB of cache = {d.kv_cache_tokens_per_gpu:,} tokens"
        + ("" if d.fits else " -- DOES NOT FIT: " + "; ".join(d.reasons))
    )
    if p.nnodes > 1:
        out.append("# on every node: export MASTER_ADDR=<address of node 0> "
                   "K2SERVE_DIST_SECRET=<one secret, the same on every node>")  # fmt: skip
        for r, cmd in enumerate(d.node_commands):
            role = "ranks 0.. serve HTTP" if r == 0 else "headless"
            out += [f"# node {r} of {p.nnodes} ({role}):", cmd]
    else:
        out += d.node_commands
    return out
