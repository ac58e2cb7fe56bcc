"""The memory and speed planner: what fits where, derived from tensor shapes and dtypes.

Owns: the latent KV bytes per token, the activation and runtime allowances, and `plan(...)`, the
one pure function that `k2serve plan` prints and `k2serve serve` uses to size its KV cache and
place experts. Weight bytes come from `k2serve.plan.weights`; what to change when a plan does not
fit, from `k2serve.plan.suggest`.

Invariants:
- No torch import: `k2serve plan` must answer in well under a second.
- Every byte figure is computed from a shape times a dtype size; the only constants are the
  dtype sizes and the allowances named in `RUNTIME_RESERVE_BYTES`. The KV cache, activation
  and graph formulas are `k2serve.memory`'s, which the engine sizes its cache with too.
- Pure: same inputs, same `Plan`; no I/O, no environment reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from k2serve.config import ModelConfig
from k2serve.memory import (  # the formulas the engine sizes its cache with
    RUNTIME_RESERVE_BYTES,
    STEP_TOKENS_DEFAULT,
    activation_bytes,
    default_max_num_batched_tokens,
    encoder_activation_bytes,
    graph_pool_bytes,
    kv_bytes_per_token,
    kv_cache_pages,
)
from k2serve.plan import commands as pc
from k2serve.plan.hardware import CPU_MEMORY_UTILIZATION, GpuSpec
from k2serve.plan.kv_tier import host_kv_tier
from k2serve.plan.suggest import suggestions
from k2serve.plan.weights import weight_breakdown

# --------------------------------------------------------------------------------------------
# Runtime memory (the KV, activation and graph formulas are k2serve.memory's)

# Usable DRAM bandwidth assumed when --cpu-bandwidth is not given (a 12-channel DDR5 socket reads
# ~250-300 GB/s in practice; field.md §0).
DEFAULT_CPU_BANDWIDTH = 250e9
# Defaults mirrored from k2serve.engine.config.EngineConfig.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = STEP_TOKENS_DEFAULT  # without a GPU of 70 GiB or more
DEFAULT_PAGE_SIZE = 16


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class DeviceMemory:
    """One GPU's budget: `capacity` = memory * gpu_memory_utilization; rows in bytes."""

    device: str
    capacity: int
    rows: dict[str, int]

    @property
    def used(self) -> int:
        return sum(self.rows.values())

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def to_dict(self) -> dict:
        return {"device": self.device, "capacity": self.capacity, "used": self.used, **self.rows}


@dataclass
class Plan:
    """What fits where. Sizes are bytes; per-GPU figures are for one GPU."""

    model: str
    quantization: str
    gpu: dict | None
    num_gpus: int
    tensor_parallel_size: int
    expert_parallel_size: int
    gpu_memory_utilization: float
    weights: dict[str, int]
    devices: list[DeviceMemory]
    num_routed_experts: int  # per MoE layer
    num_gpu_experts: int  # routed experts per MoE layer held by the GPUs
    num_cpu_experts: int  # routed experts per MoE layer held in host RAM
    num_moe_layers: int
    expert_bytes: int
    cpu_memory: int
    cpu_memory_needed: int
    cpu_bandwidth: float
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_cache_tokens: int  # tokens of latent cache (each TP rank holds all of them)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    full_length_seqs: int  # sequences of max_model_len tokens that fit at once
    gpu_bytes_per_token: int  # read by one GPU per decoded token at batch 1, empty context
    cpu_bytes_per_token: int
    decode_tokens_per_s: float  # bandwidth roofline at batch 1, context of 1 token
    decode_tokens_per_s_full_context: float  # same, with max_model_len tokens of context
    fits: bool
    reasons: list[str]
    suggestions: list[str]
    notes: list[str]
    serve_args: list[str]  # the flags of every node (node rank / address / --headless apart)
    # share of routed (token, expert) pairs that hit a GPU expert, from a routing-counts file
    # (serve --record-routing); None: no file, the estimates assume uniform routing
    gpu_expert_hit_rate: float | None = None
    nnodes: int = 1
    gpus_per_node: int = pc.DEFAULT_GPUS_PER_NODE
    master_port: int = pc.DEFAULT_MASTER_PORT
    node_commands: list[str] = field(default_factory=list)  # one full command per node
    # K2 host KV tier (issue 27, k2serve.plan.kv_tier): --kv-offloading-size, all ranks
    kv_offloading_bytes: int = 0
    host_kv_tokens: int = 0  # tokens each rank's host tier holds

    @property
    def command(self) -> str:
        """The command to run (one line per node for a multi-node plan)."""
        return "\n".join(self.node_commands) or "k2serve serve " + " ".join(self.serve_args)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "devices"}
        d["devices"] = [dev.to_dict() for dev in self.devices]
        d["command"] = self.command
        return d


def _valid_tp(config: ModelConfig, n: int) -> bool:
    return n >= 1 and config.num_attention_heads % n == 0


def plan(
    config: ModelConfig,
    *,
    model: str = "MODEL",
    gpu: GpuSpec | None = None,
    num_gpus: int = 0,
    cpu_memory: int = 0,
    cpu_bandwidth: float | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.9,
    num_gpu_experts: int | None = None,
    suggest: bool = True,
    routing_counts: dict[int, list[float]] | None = None,
    expert_placement_file: str | None = None,
    gpus_per_node: int = pc.DEFAULT_GPUS_PER_NODE,
    master_addr: str = pc.MASTER_ADDR_PLACEHOLDER,
    master_port: int = pc.DEFAULT_MASTER_PORT,
    kv_offloading_size: float | None = None,
) -> Plan:
    """Place weights, KV cache and experts on `num_gpus` x `gpu` plus `cpu_memory` bytes of RAM.

    Attention, dense MLP, shared experts, embeddings and lm_head are tensor-parallel over all
    GPUs; routed experts are expert-parallel (each GPU holds 1/N of each layer's GPU experts).
    The requested context (one `max_model_len` sequence) is reserved first; routed experts then
    fill the GPUs (all of them, or as many per layer as fit, the rest in RAM; `num_gpu_experts`
    forces the per-layer count); whatever remains is KV cache. `routing_counts` (layer ->
    count per expert, moe.placement.load_routing_counts of `expert_placement_file`): the GPU
    experts are each layer's most-routed ones and the decode estimate uses their hit rate.
    More GPUs than `gpus_per_node` span whole nodes (one command per node, TP over all of
    them). Every limit that fails is listed in `reasons`, with its numbers.
    `kv_offloading_size` (GiB over all ranks; None: sized from the RAM the CPU experts leave,
    0: none): the host KV tier (k2serve.plan.kv_tier).
    """
    kv_cache_dtype = "bf16" if kv_cache_dtype == "auto" else kv_cache_dtype
    ctx = config.max_position_embeddings if max_model_len is None else int(max_model_len)
    if not 0 < ctx <= config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={ctx} must be in 1..{config.max_position_embeddings} "
            "(the model's max_position_embeddings)"
        )
    if max_num_batched_tokens is None:  # serve's default on the planned GPU
        max_num_batched_tokens = default_max_num_batched_tokens(
            gpu.memory_bytes if gpu is not None and num_gpus else None
        )
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if num_gpus and gpu is None:
        raise ValueError("num_gpus > 0 needs a gpu preset")
    if num_gpus and not _valid_tp(config, num_gpus):
        ok = [n for n in range(1, 65) if _valid_tp(config, n)]
        raise ValueError(
            f"{num_gpus} GPUs: tensor parallelism needs a count dividing the "
            f"{config.num_attention_heads} attention heads ({', '.join(map(str, ok))})"
        )
    nnodes = pc.node_layout(num_gpus, gpus_per_node) if num_gpus else 1
    w = weight_breakdown(config)
    kvt = kv_bytes_per_token(config, kv_cache_dtype)
    cpu_bw = float(cpu_bandwidth) if cpu_bandwidth else DEFAULT_CPU_BANDWIDTH
    n_exp, layers, eb = config.n_routed_experts, w.num_moe_layers, w.expert_bytes
    g = num_gpus
    tp = max(g, 1)
    reasons: list[str] = []
    notes: list[str] = []
    kv_need = ctx * kvt
    devices: list[DeviceMemory] = []
    kv_tokens = 0
    if g:
        assert gpu is not None  # checked above: num_gpus > 0 needs a gpu preset
        cap = int(gpu.memory_bytes * gpu_memory_utilization)
        act = activation_bytes(config, max_num_batched_tokens, max_num_seqs, tp)
        rows = {
            "attention": w.attention_sharded // tp + w.attention_replicated,
            "dense_mlp": w.dense_mlp // tp,
            "shared_experts": w.shared_experts // tp,
            "router": w.router,
            "routed_experts": 0,
            "embeddings_lm_head": w.embeddings // tp,
            "vision": w.vision,
            "vision_activations": encoder_activation_bytes(config, max_num_batched_tokens),
            "activations": act,
            # decode graphs share one pool sized by the largest captured batch
            "cuda_graphs": graph_pool_bytes(config, max_num_seqs, tp),
            "runtime": RUNTIME_RESERVE_BYTES,
            # one GPU with CPU experts: serve's layer-wise prefill double buffer (two layers'
            # CPU experts), allocated before the KV cache (k2serve.moe.layerwise)
            "layerwise_prefill": 0,
            "kv_cache": 0,
        }
        fixed = sum(rows.values())
        room = cap - fixed - kv_need  # for experts, after one full-length sequence of cache
        slots = max(0, room // (layers * eb)) if layers else 0  # experts per layer per GPU
        if num_gpu_experts is None:
            gpu_exp = min(n_exp, slots * g)
            if g == 1 and gpu_exp < n_exp and layers > 2:  # room for the double buffer too
                fit = (room - 2 * n_exp * eb) // ((layers - 2) * eb)
                gpu_exp = min(gpu_exp, fit) if fit >= 0 else gpu_exp
        else:
            gpu_exp = min(n_exp, int(num_gpu_experts))
        rows["routed_experts"] = math.ceil(gpu_exp / g) * layers * eb
        if g == 1 and gpu_exp < n_exp:
            stream = 2 * (n_exp - gpu_exp) * eb
            if room - rows["routed_experts"] >= stream:
                rows["layerwise_prefill"] = stream
            else:
                notes.append(
                    f"no room for the layer-wise prefill buffers ({stream / 2**30:.1f} GiB): "
                    "long prompts' CPU experts are computed on the CPU"
                )
        left = cap - sum(rows.values())
        rows["kv_cache"] = max(0, left)
        kv_tokens = kv_cache_pages(rows["kv_cache"], kvt, DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE
        devices = [DeviceMemory(f"cuda:{i}", cap, dict(rows)) for i in range(g)]
        if fixed > cap:
            reasons.append(
                f"the non-expert weights, activations and runtime need "
                f"{fixed / 2**30:.1f} GiB per GPU; {g}x{gpu.name} at gpu_memory_utilization="
                f"{gpu_memory_utilization} give {cap / 2**30:.1f} GiB"
            )
        if kv_tokens < ctx:
            reasons.append(
                f"max_model_len={ctx} needs {kv_need / 2**30:.1f} GiB of KV cache per GPU "
                f"({kvt} bytes/token, replicated on every TP rank); "
                f"{max(0, left) / 2**30:.1f} GiB is left"
            )
    else:
        gpu_exp = 0
        # CPU only: everything lives in RAM
        kv_tokens = ctx
        notes.append("no GPU: every weight and the KV cache live in host RAM")
    cpu_exp = n_exp - gpu_exp
    cpu_need = cpu_exp * layers * eb
    if cpu_exp:
        cpu_need += (max_num_batched_tokens * config.num_experts_per_tok * 2) * (
            config.hidden_size * 2
        )  # pinned in/out buffers for the routed copies sent to the CPU
    if not g:
        cpu_need += w.non_expert + ctx * kvt
    usable_ram = int(cpu_memory * CPU_MEMORY_UTILIZATION)
    if not g and cpu_need > usable_ram:
        reasons.append(
            f"CPU only: the weights ({(w.non_expert + cpu_exp * layers * eb) / 2**30:.0f} GiB) "
            f"and a {ctx}-token KV cache ({ctx * kvt / 2**30:.1f} GiB) need "
            f"{cpu_need / 2**30:.0f} GiB of RAM; {CPU_MEMORY_UTILIZATION:.0%} of --cpu-memory "
            f"is {usable_ram / 2**30:.0f} GiB"
        )
    elif cpu_exp:
        if cpu_memory <= 0:
            reasons.append(
                f"{cpu_exp} routed experts per layer ({cpu_exp * layers * eb / 2**30:.0f} GiB) "
                f"do not fit on the GPUs and --cpu-memory is 0"
            )
        elif cpu_need > usable_ram:
            reasons.append(
                f"the {cpu_exp * layers} CPU experts need {cpu_need / 2**30:.0f} GiB of RAM; "
                f"{CPU_MEMORY_UTILIZATION:.0%} of --cpu-memory is {usable_ram / 2**30:.0f} GiB"
            )
    # ---- decode roofline at batch 1 ----
    k = config.num_experts_per_tok
    routed_tok = k * layers * eb  # bytes of routed experts one token reads
    dense_tok = (
        w.attention_sharded // tp
        + w.attention_replicated
        + w.dense_mlp // tp
        + w.shared_experts // tp
        + w.router
        + w.lm_head // tp
    )
    gpu_routed = routed_tok * gpu_exp // n_exp if n_exp else 0  # uniform routing
    hit_rate = None
    if routing_counts and n_exp:
        tot = top = 0.0
        for c in routing_counts.values():
            tot += sum(c)
            top += sum(sorted(c, reverse=True)[:gpu_exp])
        if tot > 0:
            hit_rate = top / tot
            gpu_routed = int(routed_tok * hit_rate)
    if g:
        assert gpu is not None  # num_gpus > 0 needs a gpu preset (checked above)
        gpu_tok = dense_tok + gpu_routed // g
        cpu_tok = routed_tok * cpu_exp // n_exp if hit_rate is None else routed_tok - gpu_routed
        t0 = gpu_tok / gpu.bandwidth + cpu_tok / cpu_bw
        t1 = t0 + ctx * kvt / gpu.bandwidth  # every TP rank reads the whole latent cache
    else:
        gpu_tok, cpu_tok = 0, dense_tok + routed_tok
        t0 = cpu_tok / cpu_bw
        t1 = t0 + ctx * kvt / cpu_bw
    # ---- notes ----
    if g > 1:
        notes.append(
            f"attention is tensor-parallel (TP={tp}); MLA's latent cache is shared by all heads, "
            f"so every TP rank holds the full cache of every sequence: capacity does not grow "
            f"with TP. DP attention would multiply it by {tp} at the cost of replicating the "
            f"attention weights ({w.attention / 2**30:.1f} GiB per GPU); k2serve uses TP"
        )
    if g and gpu_exp and cpu_exp and hit_rate is not None:
        notes.append(
            f"{gpu_exp} of {n_exp} experts per MoE layer on the GPUs, {cpu_exp} in RAM: the "
            f"most-routed ones by the routing counts, which put {hit_rate:.0%} of the routed "
            "(token, expert) pairs on the GPUs (the decode estimate uses that share)"
        )
    elif g and gpu_exp and cpu_exp:
        notes.append(
            f"{gpu_exp} of {n_exp} experts per MoE layer on the GPUs, {cpu_exp} in RAM; the "
            "GPU ones should be the most often routed (hot) experts; the decode estimate assumes "
            "uniform routing, so hot-expert placement can only do better"
        )
    if g and gpu and not gpu.nvlink and g > 1:
        notes.append(f"{gpu.name} GPUs talk over PCIe: TP all-reduces cost more than on NVLink")
    if g > 2 and gpu and gpu.name == "H100NVL":
        notes.append("H100 NVL: NVLink bridges join pairs; TP over more than 2 crosses PCIe")
    if g and gpu and not gpu.fp8 and config.quant and config.quant.method == "fp8_block":
        notes.append(f"{gpu.name} has no FP8 tensor cores: FP8 weights run through dequantization")
    # ---- K2 host KV tier (issue 27): sized by k2serve.plan.kv_tier ----
    tier = host_kv_tier(
        kv_offloading_size, num_gpus=g, nnodes=nnodes, cpu_memory=cpu_memory,
        usable_ram=usable_ram, cpu_need=cpu_need if g else 0, kv_bytes_per_token=kvt,
        gpu_kv_tokens=kv_tokens,
    )  # fmt: skip
    notes += [tier.note] if tier.note else []
    reasons += [tier.reason] if tier.reason else []
    fits = not reasons
    full = kv_tokens // ctx if ctx else 0
    cpu_kv = -(-ctx // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE * kvt  # whole pages
    args = pc.serve_args(
        model, g, ctx, max_num_seqs, kv_cache_dtype, gpu_memory_utilization,
        nnodes=nnodes, master_port=master_port, cpu_kv_cache_bytes=cpu_kv,
        max_num_batched_tokens=max_num_batched_tokens,
    )  # fmt: skip
    args += tier.serve_args()  # K2 host KV tier
    if config.vision is not None and g > 1:  # K2.5 recipe: split images over the ranks
        args += ["--mm-encoder-tp-mode", "data"]
    if g and cpu_exp:
        args += ["--num-gpu-experts", str(gpu_exp)]
        if expert_placement_file:
            args += ["--expert-placement-file", expert_placement_file]
    if nnodes > 1:
        notes.append(
            f"{g} GPUs = {nnodes} nodes of {gpus_per_node}: TP={g} over all of them (node 0 "
            f"serves HTTP, the others run --headless); every node needs the checkpoint at the "
            f"same path, and node 0's address in MASTER_ADDR (ports {master_port} and "
            f"{master_port + 1} open between the nodes)"
        )
    if gpu is not None and gpu.bandwidth_assumed:
        notes.append(
            f"GPU bandwidth unknown: {gpu.bandwidth / 1e12:.1f} TB/s assumed for the decode "
            "estimate; give --gpu-bandwidth"
        )
    p = Plan(
        model=model,
        quantization=config.quant.method if config.quant else config.torch_dtype,
        gpu=gpu.to_dict() if gpu else None,
        num_gpus=g,
        tensor_parallel_size=tp,
        expert_parallel_size=tp,
        gpu_memory_utilization=gpu_memory_utilization,
        weights={**{k: v for k, v in w.__dict__.items()}, "total": w.total},
        devices=devices,
        num_routed_experts=n_exp,
        num_gpu_experts=gpu_exp,
        num_cpu_experts=cpu_exp,
        num_moe_layers=layers,
        expert_bytes=eb,
        cpu_memory=cpu_memory,
        cpu_memory_needed=cpu_need,
        cpu_bandwidth=cpu_bw,
        kv_cache_dtype=kv_cache_dtype,
        kv_bytes_per_token=kvt,
        kv_cache_tokens=kv_tokens,
        max_model_len=ctx,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        full_length_seqs=full,
        gpu_bytes_per_token=gpu_tok,
        cpu_bytes_per_token=cpu_tok,
        decode_tokens_per_s=1 / t0,
        decode_tokens_per_s_full_context=1 / t1,
        fits=fits,
        reasons=reasons,
        suggestions=[],
        notes=notes,
        serve_args=args,
        gpu_expert_hit_rate=hit_rate,
        nnodes=nnodes,
        gpus_per_node=gpus_per_node,
        master_port=master_port,
        node_commands=pc.node_commands(args, nnodes, master_addr),
        kv_offloading_bytes=tier.total_bytes,
        host_kv_tokens=tier.tokens_per_rank,
    )
    if not fits and suggest:
        p.suggestions = suggestions(config, p, gpu, replan=plan)
    return p
