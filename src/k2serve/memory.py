"""Memory formulas shared by the planner (`k2serve plan`) and the engine (`engine.setup`).

Owns: dtype sizes, the KV cache dtype names (`KV_CACHE_DTYPES`, validated here and nowhere
else), the latent KV bytes per token, the activation working set of one step, the allowance
for what lives outside the tensor allocator, and `kv_cache_pages`: what is left of a device's
budget once the weights, the step's activations, the decode graphs and the runtime are taken,
in pages. The planner fills these from shapes alone; the engine fills the same terms from
what it measured (the loaded weights, a profiling pass, the CUDA context) where it has a GPU,
and from these formulas where it has none (a simulated device budget on the CPU), so that for
the same machine `plan` and `serve` give the same number of pages.

Invariants: no torch import (`k2serve plan` must answer in well under a second); every byte
figure is a shape times a dtype size; pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from k2serve.config import ModelConfig

MiB = 2**20
# Allowance per GPU for what lives outside the tensor allocator: CUDA context, cuBLAS
# workspaces, NCCL buffers (measured CUDA contexts are 0.3-0.6 GiB; NCCL adds buffers per peer).
RUNTIME_RESERVE_BYTES = 768 * MiB

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "auto": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "float8_e4m3fn": 1,
    "int4": 0.5,
}
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")  # --kv-cache-dtype; "auto" = the model's dtype


# the step token budget when none is asked for: vLLM's OpenAI server default, 8192 on GPUs of
# 70 GiB or more, else 2048. On the H100 (k2-slice, `benchmarks/served.py`, RESULTS.md "Served
# throughput", wave 9) 8192 against 2048: C=256 5578 against 4325 out tok/s, C=16 TTFT p99 332
# against 466 ms (larger prompt chunks run nearer the matmul rate); ITL p99 at C=256 172 against
# 142 ms (an 8K chunk shares its step with the decodes)
LARGE_GPU_BYTES = 70 * 2**30
STEP_TOKENS_LARGE_GPU = 8192
STEP_TOKENS_DEFAULT = 2048


def default_max_num_batched_tokens(gpu_memory_bytes: int | None) -> int:
    """--max-num-batched-tokens when not given: by the GPU's total memory (None: no GPU)."""
    if gpu_memory_bytes is not None and gpu_memory_bytes >= LARGE_GPU_BYTES:
        return STEP_TOKENS_LARGE_GPU
    return STEP_TOKENS_DEFAULT


def dtype_bytes(name: str) -> float:
    """Bytes of one element of dtype `name` ("bf16", "torch.float32", ...)."""
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}")
    return kv_cache_dtype


def kv_values_per_token(config: ModelConfig) -> int:
    """Cached values per token, all layers: the normed latent and the roped key of each."""
    return config.num_hidden_layers * config.kv_cache_dim


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str = "bf16") -> int:
    """Bytes of latent MLA cache one token occupies across all layers (on one TP rank), for a
    KV_CACHE_DTYPES name ("auto" and "bf16" = the checkpoint's dtype size). The engine, which
    knows its cache tensors' element size, multiplies `kv_values_per_token` by it.

    Absorbed MLA caches the normed latent (kv_lora_rank) and the roped key (qk_rope_head_dim)
    per token per layer: 61 * (512 + 64) * 2 = 70,272 bytes for Kimi-K2 in bf16.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    elem = 1 if kv_cache_dtype == "fp8" else int(dtype_bytes(config.torch_dtype))
    return kv_values_per_token(config) * elem


def activation_bytes(config: ModelConfig, num_tokens: int, num_seqs: int, tp: int) -> int:
    """Peak activation bytes on one GPU for a step of `num_tokens` tokens and `num_seqs` logits.

    Residual stream (hidden, residual, normed) + the largest of attention / dense MLP / MoE
    working sets + float32 logits and probabilities. The MoE term counts every routed copy of
    every token on this GPU (the worst case of expert-parallel imbalance).
    """
    t, h, b = num_tokens, config.hidden_size, int(dtype_bytes(config.torch_dtype))
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


def graph_pool_bytes(config: ModelConfig, max_num_seqs: int, tp: int) -> int:
    """Decode CUDA graphs share one pool, sized by the largest captured batch."""
    return activation_bytes(config, max_num_seqs, max_num_seqs, tp)


@dataclass(frozen=True)
class DeviceBudget:
    """One device's memory as the KV cache sees it (bytes). `capacity` = total memory x
    --gpu-memory-utilization; the rest is what is taken before the cache."""

    capacity: int
    weights: int  # everything the tensor allocator holds before the cache (weights, buffers)
    activations: int  # the peak of the largest step above `weights`
    cuda_graphs: int  # the decode graphs' pool (0: no graphs)
    runtime: int  # outside the tensor allocator: CUDA context, workspaces, NCCL

    @property
    def kv_cache(self) -> int:
        return max(0, self.capacity - self.weights - self.activations - self.cuda_graphs
                   - self.runtime)  # fmt: skip

    def describe(self) -> str:
        g = 2**30
        return (
            f"capacity {self.capacity / g:.2f} GiB - weights {self.weights / g:.2f} - "
            f"activations {self.activations / g:.2f} - graphs {self.cuda_graphs / g:.2f} - "
            f"runtime {self.runtime / g:.2f} = KV {self.kv_cache / g:.2f} GiB"
        )


def kv_cache_pages(kv_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Whole pages of `page_size` tokens in `kv_bytes`."""
    return max(0, int(kv_bytes)) // (bytes_per_token * page_size)


__all__ = [
    "DTYPE_BYTES",
    "DeviceBudget",
    "KV_CACHE_DTYPES",
    "RUNTIME_RESERVE_BYTES",
    "activation_bytes",
    "check_kv_cache_dtype",
    "dtype_bytes",
    "graph_pool_bytes",
    "kv_bytes_per_token",
    "kv_cache_pages",
    "kv_values_per_token",
]


# ---- K2.5 vision encoder (the engine's EncoderCache and the planner's row) -----------------
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
