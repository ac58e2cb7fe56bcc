"""The memory and speed planner: what fits where, derived from tensor shapes and dtypes.

Owns: the byte count of every weight group of a DeepSeek-V3 / Kimi-K2 checkpoint (from
`ModelConfig` shapes and its quantization), the latent KV bytes per token, and `plan(...)`, the
one pure function that `k2serve plan` prints and `k2serve serve` uses to size its KV cache and
place experts.

Invariants:
- No torch import: `k2serve plan` must answer in well under a second.
- Every byte figure is computed from a shape times a dtype size; the only constants are the
  dtype sizes and the allowances named in `RUNTIME_RESERVE_BYTES`.
- Pure: same inputs, same `Plan`; no I/O, no environment reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from k2serve import plan_commands as pc
from k2serve.config import ModelConfig
from k2serve.hardware import GPU_PRESETS, GpuSpec

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "auto": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "float8_e4m3fn": 1,
    "int4": 0.5,
}
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")


def _dtype_bytes(name: str) -> float:
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


# --------------------------------------------------------------------------------------------
# KV cache


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str = "bf16") -> int:
    """Bytes of latent MLA cache one token occupies across all layers (on one TP rank).

    Absorbed MLA caches the normed latent (kv_lora_rank) and the roped key (qk_rope_head_dim)
    per token per layer: 61 * (512 + 64) * 2 = 70,272 bytes for Kimi-K2 in bf16.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}")
    elem = 1 if kv_cache_dtype == "fp8" else int(_dtype_bytes(config.torch_dtype))
    return config.num_hidden_layers * config.kv_cache_dim * elem


# --------------------------------------------------------------------------------------------
# Weights


def linear_bytes(
    config: ModelConfig, module: str, out_features: int, in_features: int, quantized: bool = True
) -> int:
    """Bytes of one Linear weight as stored in the checkpoint (weight plus its scales).

    `module` is the checkpoint module name (with the K2.5 "language_model." prefix) so the
    compressed-tensors ignore list applies as it does at load time. `quantized=False` marks
    modules the format never quantizes (router, embeddings; lm_head under fp8).
    """
    q = config.quant
    base = int(_dtype_bytes(config.torch_dtype))
    if q is None or not quantized:
        return out_features * in_features * base
    if q.method == "fp8_block":
        # float8_e4m3fn weight + float32 weight_scale_inv [ceil(out/b0), ceil(in/b1)]
        b0, b1 = q.block_size
        return out_features * in_features + 4 * math.ceil(out_features / b0) * math.ceil(
            in_features / b1
        )
    if q.method == "int4_group":
        if q.is_ignored(module):
            return out_features * in_features * base
        # int32 weight_packed [out, in/8] + bf16 weight_scale [out, in/group] + int32 shape [2]
        packed = out_features * math.ceil(in_features / 8) * 4
        scales = out_features * math.ceil(in_features / q.group_size) * 2
        return packed + scales + 2 * 4
    raise ValueError(f"unknown quantization method {q.method!r}")


def _mlp_bytes(config: ModelConfig, module: str, inter: int) -> int:
    h = config.hidden_size
    return (
        linear_bytes(config, f"{module}.gate_proj", inter, h)
        + linear_bytes(config, f"{module}.up_proj", inter, h)
        + linear_bytes(config, f"{module}.down_proj", h, inter)
    )


@dataclass(frozen=True)
class WeightBreakdown:
    """Bytes per weight group, whole model (all layers), as stored.

    Attention is split into what tensor parallelism shards (q_b_proj, kv_b_proj, o_proj; or
    q_proj without q-LoRA) and what every TP rank replicates (q_a_proj, kv_a_proj_with_mqa,
    their norms and the layer norms), as vLLM's DeepseekV2 attention does.
    """

    attention_sharded: int
    attention_replicated: int
    dense_mlp: int
    shared_experts: int
    router: int
    routed_experts: int
    embeddings: int  # embed_tokens + lm_head + final norm
    lm_head: int  # the part of `embeddings` read for every decoded token
    vision: int  # K2.5 vision tower + mm_projector (bf16)
    expert_bytes: int  # one routed expert (gate + up + down with scales)
    num_moe_layers: int

    @property
    def attention(self) -> int:
        return self.attention_sharded + self.attention_replicated

    @property
    def non_expert(self) -> int:
        return self.total - self.routed_experts

    @property
    def total(self) -> int:
        return (
            self.attention
            + self.dense_mlp
            + self.shared_experts
            + self.router
            + self.routed_experts
            + self.embeddings
            + self.vision
        )


def _attention_bytes(config: ModelConfig, layer: int) -> tuple[int, int]:
    """(TP-sharded, replicated) bytes of one decoder layer's attention and layer norms."""
    p = f"{config.weight_prefix}model.layers.{layer}.self_attn"
    h, nh = config.hidden_size, config.num_attention_heads
    base = int(_dtype_bytes(config.torch_dtype))
    lin = lambda name, o, i: linear_bytes(config, f"{p}.{name}", o, i)
    kv_b_out = nh * (config.qk_nope_head_dim + config.v_head_dim)
    sharded = lin("kv_b_proj", kv_b_out, config.kv_lora_rank)
    sharded += lin("o_proj", h, nh * config.v_head_dim)
    replicated = lin("kv_a_proj_with_mqa", config.kv_lora_rank + config.qk_rope_head_dim, h)
    replicated += config.kv_lora_rank * base  # kv_a_layernorm
    if config.q_lora_rank:
        replicated += lin("q_a_proj", config.q_lora_rank, h) + config.q_lora_rank * base
        sharded += lin("q_b_proj", nh * config.qk_head_dim, config.q_lora_rank)
    else:
        sharded += lin("q_proj", nh * config.qk_head_dim, h)
    replicated += 2 * h * base  # input_layernorm, post_attention_layernorm
    return sharded, replicated


def vision_bytes(config: ModelConfig) -> int:
    """K2.5 MoonViT tower + patch-merger projector, bf16, from `vision_config` shapes."""
    vc = config.vision if config.has_vision else None
    if vc is None:
        return 0
    d, inter, p = vc.hidden_size, vc.intermediate_size, vc.patch_size
    merged, text = vc.merged_hidden_size, vc.text_hidden_size
    params = d * 3 * p * p + d  # patch_embed.proj weight [d, 3, p, p] + bias
    params += vc.pos_emb_height * vc.pos_emb_width * d
    block = 4 * d  # norm0, norm1 weight + bias
    block += 3 * d * d + 3 * d  # wqkv
    block += d * d + d  # wo
    block += inter * d + inter + d * inter + d  # mlp fc0, fc1
    params += vc.num_hidden_layers * block + 2 * d  # + final_layernorm
    params += 2 * d + merged * merged + merged + text * merged + text  # mm_projector
    return params * 2


MAX_IMAGE_TOKENS = 4096  # in_patch_limit 16384 patches / (2 x 2): the largest image's tokens


def encoder_cache_tokens(max_num_batched_tokens: int) -> int:
    """Image tokens whose encoder outputs the runner keeps (engine.multimodal.EncoderCache)."""
    return max(2 * MAX_IMAGE_TOKENS, 2 * max_num_batched_tokens)


def encoder_max_patches(config: ModelConfig, max_num_batched_tokens: int) -> int:
    """Most patches the runner gives the tower in one call (a step's new images are encoded in
    calls of at most this many): the step's tokens plus two images cut by its ends."""
    vc = config.vision
    merge = vc.merge_kernel_size[0] * vc.merge_kernel_size[1] if vc is not None else 4
    return merge * (max_num_batched_tokens + 2 * MAX_IMAGE_TOKENS)


def encoder_activation_bytes(config: ModelConfig, max_num_batched_tokens: int) -> int:
    """Vision encoder memory beyond its weights (0 without a tower): the encoder cache
    (`encoder_cache_tokens` x hidden, bf16) plus the peak working memory of one step, whose new
    images hold at most the step's tokens plus two images cut by its ends; per patch, one
    block's live tensors (residual, norm, qkv, float32 complex q/k with RoPE, attention out,
    the MLP's two [., 4304] intermediates) in bf16."""
    vc = config.vision if config.has_vision else None
    if vc is None:
        return 0
    patches = encoder_max_patches(config, max_num_batched_tokens)
    d = vc.hidden_size
    per_patch = 2 * (6 * d + 2 * vc.intermediate_size) + 4 * 4 * d
    cache = encoder_cache_tokens(max_num_batched_tokens) * vc.text_hidden_size * 2
    return patches * per_patch + cache


def weight_breakdown(config: ModelConfig) -> WeightBreakdown:
    """Every weight of the checkpoint, grouped as the planner places them."""
    pre = config.weight_prefix
    h = config.hidden_size
    base = int(_dtype_bytes(config.torch_dtype))
    att_s = att_r = dense = shared = router = routed = 0
    expert = 0
    moe_layers = config.moe_layers
    for i in range(config.num_hidden_layers):
        s, r = _attention_bytes(config, i)
        att_s, att_r = att_s + s, att_r + r
        mlp = f"{pre}model.layers.{i}.mlp"
        if i in moe_layers:
            # router: gate.weight [E, hidden] bf16 + e_score_correction_bias [E] fp32
            router += config.n_routed_experts * h * base + config.n_routed_experts * 4
            if config.n_shared_experts:
                inter = config.n_shared_experts * config.moe_intermediate_size
                shared += _mlp_bytes(config, f"{mlp}.shared_experts", inter)
            expert = _mlp_bytes(config, f"{mlp}.experts.0", config.moe_intermediate_size)
            routed += config.n_routed_experts * expert
        else:
            dense += _mlp_bytes(config, mlp, config.intermediate_size)
    emb = config.vocab_size * h * base + h * base  # embed_tokens + final norm
    lm_head = config.vocab_size * h * base  # tied: the embedding matrix is read
    if not config.tie_word_embeddings:
        lm_q = config.quant is not None and config.quant.method == "int4_group"
        lm_head = linear_bytes(config, f"{pre}lm_head", config.vocab_size, h, quantized=lm_q)
        emb += lm_head
    return WeightBreakdown(
        attention_sharded=att_s,
        attention_replicated=att_r,
        dense_mlp=dense,
        shared_experts=shared,
        router=router,
        routed_experts=routed,
        embeddings=emb,
        lm_head=lm_head,
        vision=vision_bytes(config),
        expert_bytes=expert,
        num_moe_layers=len(moe_layers),
    )


def weight_bytes(config: ModelConfig, include_vision: bool = True) -> int:
    """Bytes of all weights as stored (= the checkpoint's tensor bytes)."""
    b = weight_breakdown(config)
    return b.total if include_vision else b.total - b.vision


# --------------------------------------------------------------------------------------------
# Runtime memory

MiB = 2**20
# Allowance per GPU for what lives outside the tensor allocator: CUDA context, cuBLAS
# workspaces, NCCL buffers (measured CUDA contexts are 0.3-0.6 GiB; NCCL adds buffers per peer).
RUNTIME_RESERVE_BYTES = 768 * MiB
# Usable DRAM bandwidth assumed when --cpu-bandwidth is not given (a 12-channel DDR5 socket reads
# ~250-300 GB/s in practice; field.md §0).
DEFAULT_CPU_BANDWIDTH = 250e9
# Share of host RAM the CPU experts may take; the rest is the OS, page cache and pinned buffers.
CPU_MEMORY_UTILIZATION = 0.9
# Defaults mirrored from k2serve.engine.config.EngineConfig.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_PAGE_SIZE = 16
# Suggestions do not offer contexts shorter than this.
MIN_USEFUL_CONTEXT = 4096


def activation_bytes(config: ModelConfig, num_tokens: int, num_seqs: int, tp: int) -> int:
    """Peak activation bytes on one GPU for a step of `num_tokens` tokens and `num_seqs` logits.

    Residual stream (hidden, residual, normed) + the largest of attention / dense MLP / MoE
    working sets + float32 logits and probabilities. The MoE term counts every routed copy of
    every token on this GPU (the worst case of expert-parallel imbalance).
    """
    t, h, b = num_tokens, config.hidden_size, int(_dtype_bytes(config.torch_dtype))
    heads = max(1, config.num_attention_heads // tp)
    residual = 3 * t * h * b
    attention = (
        t
        * (
            (config.q_lora_rank or 0)
            + config.kv_cache_dim
            + heads * config.qk_head_dim  # q
            + heads * (config.qk_head_dim + config.v_head_dim)  # k, v expanded for prefill
            + heads * max(config.v_head_dim, config.kv_cache_dim)  # attention output / absorbed q
            + h  # o_proj output
        )
        * b
    )
    dense = t * 3 * (config.intermediate_size // tp) * b if config.first_k_dense_replace else 0
    k = config.num_experts_per_tok
    moe = t * config.n_routed_experts * 4 + t * k * 8  # router logits, top-k ids and weights
    moe += t * k * (3 * config.moe_intermediate_size + h) * b  # gate_up, act, down per copy
    logits = 2 * num_seqs * config.vocab_size * 4
    return residual + max(attention, dense, moe) + logits


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
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    kv_cache_dtype: str = "bf16",
    gpu_memory_utilization: float = 0.9,
    num_gpu_experts: int | None = None,
    suggest: bool = True,
    routing_counts: dict[int, list[float]] | None = None,
    expert_placement_file: str | None = None,
    gpus_per_node: int = pc.DEFAULT_GPUS_PER_NODE,
    master_addr: str = pc.MASTER_ADDR_PLACEHOLDER,
    master_port: int = pc.DEFAULT_MASTER_PORT,
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
    """
    kv_cache_dtype = "bf16" if kv_cache_dtype == "auto" else kv_cache_dtype
    ctx = config.max_position_embeddings if max_model_len is None else int(max_model_len)
    if not 0 < ctx <= config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={ctx} must be in 1..{config.max_position_embeddings} "
            "(the model's max_position_embeddings)"
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
            "cuda_graphs": activation_bytes(config, max_num_seqs, max_num_seqs, tp),
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
        kv_tokens = rows["kv_cache"] // kvt // DEFAULT_PAGE_SIZE * DEFAULT_PAGE_SIZE
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
    if g and gpu and not gpu.fp8 and config.quant and config.quant.method == "fp8_block":
        notes.append(f"{gpu.name} has no FP8 tensor cores: FP8 weights run through dequantization")
    fits = not reasons
    full = kv_tokens // ctx if ctx else 0
    cpu_kv = -(-ctx // DEFAULT_PAGE_SIZE) * DEFAULT_PAGE_SIZE * kvt  # whole pages
    args = pc.serve_args(
        model, g, ctx, max_num_seqs, kv_cache_dtype, gpu_memory_utilization,
        nnodes=nnodes, master_port=master_port, cpu_kv_cache_bytes=cpu_kv,
    )  # fmt: skip
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
    )
    if not fits and suggest:
        p.suggestions = _suggestions(config, p, gpu)
    return p


def _suggestions(config: ModelConfig, p: Plan, gpu: GpuSpec | None) -> list[str]:
    """What would fit, each found by re-planning with settings changed (and the longest context
    that then fits, when the requested one still does not)."""
    base: dict[str, Any] = dict(
        model=p.model,
        gpu=gpu,
        num_gpus=p.num_gpus,
        cpu_memory=p.cpu_memory,
        cpu_bandwidth=p.cpu_bandwidth,
        max_model_len=p.max_model_len,
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        kv_cache_dtype=p.kv_cache_dtype,
        gpu_memory_utilization=p.gpu_memory_utilization,
        suggest=False,
        gpus_per_node=p.gpus_per_node,
    )

    def longest(**changes) -> int:
        """Largest max_model_len <= the requested one that fits (0 if none); fit is monotone."""
        lo, hi = 0, p.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = plan(config, **{**base, **changes, "max_model_len": mid}).fits
            lo, hi = (mid, hi) if ok else (lo, mid - 1)
        return lo

    def say(what: str, flags: str, **changes) -> int:
        n = longest(**changes)
        if n >= p.max_model_len:
            out.append(f"{what}: {flags}")
        elif n >= MIN_USEFUL_CONTEXT:
            out.append(f"{what}, shorter context: " + f"{flags} --max-model-len {n}".strip())
        return n

    out: list[str] = []
    say("this hardware", "")  # only ever the shorter-context line: the plan did not fit
    if p.kv_cache_dtype != "fp8":
        say(
            "an fp8 KV cache (half the bytes per token)",
            "--kv-cache-dtype fp8",
            kv_cache_dtype="fp8",
        )
    if gpu and p.gpu_memory_utilization < 0.95:
        say("larger memory share", "--gpu-memory-utilization 0.95", gpu_memory_utilization=0.95)
    counts = pc.valid_counts(lambda n: _valid_tp(config, n), p.gpus_per_node)
    if gpu:  # the fewest GPUs that fit some useful context, then the requested one
        for n in (n for n in counts if n > p.num_gpus):
            if say("more GPUs", f"--gpus {n}x{gpu.name}", num_gpus=n) >= p.max_model_len:
                break
            if out and out[-1].startswith("more GPUs"):
                more = [m for m in counts if m > n]
                full = next((m for m in more if longest(num_gpus=m) >= p.max_model_len), None)
                if full:
                    out.append(f"more GPUs: --gpus {full}x{gpu.name}")
                break
    bigger = _bigger_gpu(config, base, counts, gpu, p.max_model_len)
    if bigger:
        out.append(f"GPUs with more memory: --gpus {bigger}")
    q = plan(config, **{**base, "cpu_memory": 2**60})
    if q.fits and q.num_cpu_experts:
        need = math.ceil(q.cpu_memory_needed / CPU_MEMORY_UTILIZATION / 2**30)
        what = "routed experts in host RAM" if p.cpu_memory == 0 else "more host RAM"
        out.append(f"{what}: --cpu-memory {need}GB or more")
    if not out:
        out.append(
            f"nothing within {pc.MAX_NODES_SUGGESTED} nodes of {p.gpus_per_node} GPUs fits; "
            "lower --max-model-len or add --cpu-memory"
        )
    return out


def _bigger_gpu(config, base: dict, counts: list[int], gpu, ctx: int) -> str | None:
    """The fewest GPUs of a model in the table with more memory than `gpu` (any model when
    CPU only) that fit `ctx` within the suggested node counts: 'COUNTxNAME' or None."""
    have = gpu.memory_bytes if gpu else 0
    best = None
    for spec in sorted(GPU_PRESETS.values(), key=lambda s: (s.memory_bytes, s.bandwidth)):
        if spec.memory_bytes <= have:
            continue
        for n in counts:
            q = plan(config, **{**base, "gpu": spec, "num_gpus": n, "max_model_len": ctx})
            if q.fits and not q.num_cpu_experts:
                if best is None or n < best[0]:
                    best = (n, spec.name)
                break
    return f"{best[0]}x{best[1]}" if best else None
