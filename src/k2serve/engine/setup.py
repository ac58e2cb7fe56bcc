"""Engine setup: one rank's setup pipeline and its helpers.

Owns: `setup_rank` (load -> shard -> place experts -> size and allocate the KV cache -> choose
backends and kernels, each exactly once, for the engine's rank 0 and every tensor-parallel
worker alike; CUDA graphs are captured last, by the runner), `expert_placement` (the routed
experts' devices, decided once from the config), `choose_backends` (the model's attention /
expert / norm backends and its `KernelPolicy`), and the helpers: device / dtype resolution,
tokenizer loading, the EOS set, and the KV cache size from the memory budget (through
`k2serve.plan.kv_bytes_per_token`, so the engine and `k2serve plan` never disagree)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k2serve.config import ModelConfig
from k2serve.engine.config import EngineConfig
from k2serve.kernels.policy import KernelPolicy
from k2serve.moe.placement import ExpertPlacement

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB, when neither the memory nor the length is given
CPU_KV_MAX_RAM_FRACTION = 0.8  # of MemAvailable after the weights are loaded

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA; on the CPU bfloat16 when it computes bf16 natively (AVX512_BF16
    or AMX-BF16 in /proc/cpuinfo: half the bytes of float32 per weight and activation, and the
    CPU expert kernel's bf16 dot products), else float32 (bf16 is emulated, slowly, there)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        from k2serve.moe.cpu_kernel import cpu_has_bf16

        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return _DTYPES[dtype]


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def activation_dtype(model, cfg: EngineConfig, device: torch.device) -> torch.dtype:
    """The model's compute dtype (and so the KV cache's): the configured one, else that of the
    first bf16 / fp16 / fp32 parameter (quantized weights are int / fp8 and do not count)."""
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    for p in getattr(model, "parameters", lambda: [])():
        if p.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return p.dtype
    return resolve_dtype("auto", device)


def load_tokenizer(path: str):
    """The checkpoint's KimiTokenizer, or None (with a warning) when it has no tokenizer files."""
    try:
        from k2serve.tokenizer import KimiTokenizer
    except ImportError:
        logger.warning("k2serve.tokenizer is not available: no text output")
        return None
    try:
        return KimiTokenizer.from_dir(path)
    except (FileNotFoundError, OSError, ValueError) as e:
        # str(e): a record holding the exception would keep its frames (and the engine) alive
        logger.warning("no tokenizer in %s (%s): token ids only, no text", path, str(e))
        return None


def eos_token_ids(model_config, tokenizer, model_dir: str | None) -> frozenset[int]:
    """config.json eos + generation_config.json eos_token_id + `<|im_end|>` (Kimi chat turns end
    with it) + the tokenizer's eos."""
    ids = set(model_config.eos_token_ids)
    if model_dir:
        gen = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(gen):
            with open(gen) as f:
                e = json.load(f).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    if tokenizer is not None:
        for getter in (lambda: tokenizer.token_to_id("<|im_end|>"), lambda: tokenizer.eos_token_id):
            try:
                t = getter()
            except (KeyError, AttributeError, ValueError):
                t = None
            if isinstance(t, int):
                ids.add(t)
    return frozenset(int(i) for i in ids)


def kv_bytes_per_token(model_config, cache_dtype: torch.dtype) -> int:
    """Bytes one token takes in a KV cache of `cache_dtype` (float8_e4m3fn / bfloat16 /
    float16 / float32), from the planner's formula (`k2serve.plan.kv_bytes_per_token`), so the
    engine and `k2serve plan` never disagree. The planner names only the cache dtypes a
    checkpoint is served with (bf16, fp8); its fp8 figure is one byte per cached value, so the
    values per token times the element size sizes any cache (fp32 / fp16 ones on the CPU too)."""
    from k2serve.plan import kv_bytes_per_token as plan_kv_bytes

    values_per_token = int(plan_kv_bytes(model_config, "fp8"))  # 1 byte per value
    return values_per_token * torch.empty(0, dtype=cache_dtype).element_size()


def num_kv_pages(
    cfg: EngineConfig,
    model_config,
    cache_dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    may_shrink_max_model_len: bool,
) -> tuple[int, int]:
    """(number of pages, max_model_len) from the memory budget for a cache of `cache_dtype`
    (`kv_cache_torch_dtype(cfg.kv_cache_dtype, model dtype)`). Logs how many tokens fit."""
    ps = cfg.page_size
    per_token = kv_bytes_per_token(model_config, cache_dtype)
    per_page = per_token * ps
    if cfg.num_kv_pages is not None:
        pages = cfg.num_kv_pages
        source = "num_kv_pages"
    else:
        if cfg.kv_cache_memory is not None:
            budget, source = cfg.kv_cache_memory, "kv_cache_memory"
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free)
            # K2.5: room for the vision encoder's working memory (plan.encoder_activation_bytes)
            from k2serve.plan import encoder_activation_bytes

            budget -= encoder_activation_bytes(model_config, cfg.max_num_batched_tokens)
            source = f"gpu_memory_utilization={cfg.gpu_memory_utilization}"
        elif not may_shrink_max_model_len:  # CPU, --max-model-len given: room for that context
            want = cfg.max_num_seqs * cdiv(max_model_len, ps) * per_page
            avail = available_memory_bytes()
            cap = int(avail * CPU_KV_MAX_RAM_FRACTION) if avail is not None else want
            budget = min(want, cap)
            source = f"max_model_len={max_model_len} x max_num_seqs={cfg.max_num_seqs}"
            if cap < want:
                source += f", bounded by {CPU_KV_MAX_RAM_FRACTION:.0%} of available RAM"
        else:
            budget, source = DEFAULT_CPU_KV_CACHE_MEMORY, "CPU default"
        pages = max(0, budget) // per_page
        # never more than every sequence at full length needs
        pages = min(pages, cfg.max_num_seqs * cdiv(max_model_len, ps))
    if pages < 1:
        raise ValueError(
            f"the KV cache budget ({source}) holds no page of {ps} tokens ({per_page} bytes); "
            "raise --kv-cache-memory or --gpu-memory-utilization"
        )
    if pages * ps < max_model_len:
        if not may_shrink_max_model_len:
            raise ValueError(
                f"max_model_len={max_model_len} does not fit the KV cache: {pages} pages x {ps} "
                f"= {pages * ps} tokens ({source}); lower --max-model-len or give more memory"
            )
        logger.warning(
            "max_model_len lowered from %d to %d: the KV cache holds %d tokens",
            max_model_len,
            pages * ps,
            pages * ps,
        )
        max_model_len = pages * ps
    logger.info(
        "KV cache: %d pages x %d tokens = %d tokens (%.2f GiB, %s, %d bytes/token, %s); %.1f "
        "sequences of max_model_len=%d",
        pages,
        ps,
        pages * ps,
        pages * per_page / 2**30,
        str(cache_dtype).removeprefix("torch."),
        per_token,
        source,
        pages * ps / max_model_len,
        max_model_len,
    )
    return pages, max_model_len


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the setup pipeline of one rank --------------------------------------------------------------
def expert_placement(cfg: EngineConfig, model_config: ModelConfig) -> ExpertPlacement | None:
    """The expert placement of `--num-gpu-experts` / `--expert-placement-file` (None when
    neither is given: every expert on the model's device). Decided once per rank, before the
    load, so CPU-placed experts are never allocated on the GPU."""
    n, path = cfg.num_gpu_experts, cfg.expert_placement_file
    if n is None and path is None:
        return None
    if model_config.n_routed_experts == 0:
        raise ValueError("num_gpu_experts / expert_placement_file: the model has no routed experts")
    from k2serve.moe.placement import make_placement

    return make_placement(model_config, n, path)


def kernel_policy(cfg: EngineConfig, device: torch.device) -> KernelPolicy:
    """The kernels the engine runs on `device` (typed K2SERVE_* variables read here, once)."""
    return KernelPolicy.for_device(device)


def choose_backends(
    model,
    cfg: EngineConfig,
    placement: ExpertPlacement | None,
    kv_cache_dtype: torch.dtype | None,
) -> None:
    """Choose `model`'s attention / expert / RMSNorm backends and kernel policy for the engine
    config, the expert `placement` and the dtype the KV cache was allocated with (an fp8 cache
    takes the torch attention backend). Called once per rank by `setup_rank`."""
    if kv_cache_dtype != torch.float8_e4m3fn:
        if cfg.kv_cache_dtype == "fp8" and kv_cache_dtype is not None:
            logger.warning(
                "kv_cache_dtype fp8 was asked for but the KV cache was allocated as %s "
                "(allocate it with k2serve.attention.kv_cache_torch_dtype)",
                kv_cache_dtype,
            )
        kv_cache_dtype = None  # only an fp8 cache changes the choice
    model.setup_backends(
        cfg.attention_backend,
        cfg.moe_backend,
        "auto",
        placement,
        kv_cache_dtype,
        policy=kernel_policy(cfg, model.device),
    )


@dataclass
class RankSetup:
    model: Any  # DeepseekV3ForCausalLM (or an injected test double)
    kv_caches: list[torch.Tensor]
    placement: ExpertPlacement | None


def setup_rank(
    cfg: EngineConfig,
    device: torch.device,
    *,
    model_dir: str | None,
    num_pages: Callable[[object, torch.dtype], int],
    model=None,
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 0,
    progress: bool = True,
    kv_cache_factory: Callable | None = None,
) -> RankSetup:
    """One rank's setup pipeline, each step once, in this order:
    1. place experts: `expert_placement` from the config (an injected model keeps its own);
    2. load and shard: this rank's slice of every tensor (tensor parallel), CPU-placed experts
       straight into host memory, no backends chosen yet (`load_model(setup_backends=False)`);
    3. choose backends and kernels (`choose_backends`) for the placement and the cache dtype;
       with experts on the CPU (one rank), the layer-wise prefill's device buffers are taken
       here, before the KV cache takes the free memory;
    4. size and allocate the KV cache: `num_pages(model, kv_dtype)` pages (rank 0 measures the
       memory budget; workers take rank 0's count).
    CUDA graphs come last, captured by the runner (rank 0) on the finished model."""
    if model is None:
        if model_dir is None:
            raise ValueError("setup_rank needs a model directory or a model")
        from k2serve.weights.loader import load_model

        model_config = ModelConfig.from_hf(model_dir)
        placement = expert_placement(cfg, model_config)
        model = load_model(
            model_dir,
            dtype=resolve_dtype(cfg.dtype, device),
            device=device,
            load_format=cfg.load_format,
            seed=seed,
            progress=progress,
            expert_placement=placement,
            setup_backends=False,
            tp_rank=tp_rank,
            tp_size=tp_size,
            expert_parallel=cfg.enable_expert_parallel,
        )
    else:
        placement = getattr(model, "expert_placement", None)
        if placement is None:
            placement = expert_placement(cfg, model.config)
    from k2serve.attention import allocate_kv_caches, kv_cache_torch_dtype

    kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, activation_dtype(model, cfg, device))
    if hasattr(model, "setup_backends"):
        choose_backends(model, cfg, placement, kv_dtype)
        if tp_size == 1 and getattr(model, "has_cpu_experts", False):
            from k2serve.moe.layerwise import setup_layerwise_prefill

            setup_layerwise_prefill(
                model, cfg.gpu_prefill_token_threshold, cfg.max_num_batched_tokens
            )
    pages = num_pages(model, kv_dtype)
    if kv_cache_factory is None:

        def kv_cache_factory(n, ps, dt, dev):
            return allocate_kv_caches(model.config, n, ps, dt, dev)

    kv_caches = kv_cache_factory(pages, cfg.page_size, kv_dtype, device)
    fp8 = torch.float8_e4m3fn
    if kv_caches and (kv_caches[0].dtype == fp8) != (kv_dtype == fp8):
        # NOTE: only an injected kv_cache_factory allocates another dtype than asked for; the
        # attention backend must match the cache it reads, so it is chosen again for that one
        if hasattr(model, "setup_backends"):
            choose_backends(model, cfg, placement, kv_caches[0].dtype)
    return RankSetup(model, kv_caches, placement)
