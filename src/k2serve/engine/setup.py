"""Engine setup: one rank's setup pipeline, which resolves the config into a `RuntimeSpec`.

Owns: `setup_rank` (place experts -> load and shard -> choose and install backends and kernels
-> size and allocate the KV cache, each exactly once, for the engine's rank 0 and every
tensor-parallel worker alike, returning the frozen `RuntimeSpec` that the runner, executor and
server read; CUDA graphs are captured last, by the runner), `expert_placement` (the routed
experts' devices, decided once from the config), `choose_backends` (the config's backend
names and `KernelPolicy` resolved for the device), and the helpers: device / dtype resolution,
tokenizer loading, the EOS set, and the KV cache size from the memory budget (with
`k2serve.memory`'s formulas, the planner's, so the engine and `k2serve plan` agree)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k2serve import envs
from k2serve.config import ModelConfig
from k2serve.engine.config import EngineConfig
from k2serve.engine.spec import ParallelLayout, RuntimeSpec
from k2serve.kernels.policy import KernelPolicy
from k2serve.memory import DeviceBudget, kv_cache_pages, kv_values_per_token
from k2serve.model.backends import BackendChoice, install_backends, resolve_backends
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


def step_token_budget(cfg: EngineConfig, device: torch.device) -> int:
    """--max-num-batched-tokens, or its default for `device`'s memory (8192 on a GPU of 70 GiB
    or more, as vLLM's server; memory.default_max_num_batched_tokens)."""
    from k2serve.memory import default_max_num_batched_tokens

    if cfg.max_num_batched_tokens is not None:
        return cfg.max_num_batched_tokens
    total = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    return default_max_num_batched_tokens(total)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA; on the CPU bfloat16 when it computes bf16 natively (AVX512_BF16
    or AMX-BF16 in /proc/cpuinfo: half the bytes of float32 per weight and activation, and the
    CPU expert kernel's bf16 dot products), else float32 (bf16 is emulated, slowly, there)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        from k2serve.kernels.cpu import cpu_has_bf16

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
    for p in model.parameters():
        if p.dtype in (torch.bfloat16, torch.float16, torch.float32):
            return p.dtype
    return resolve_dtype("auto", device)


def load_tokenizer(path: str):
    """The checkpoint's KimiTokenizer, or None (with a warning) when it has no tokenizer files."""
    from k2serve.tokenizer import KimiTokenizer

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
    float16 / float32): `k2serve.memory`'s values per token (the planner's formula) times the
    element size."""
    return kv_values_per_token(model_config) * torch.empty(0, dtype=cache_dtype).element_size()


def num_kv_pages(
    cfg: EngineConfig,
    model_config,
    cache_dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    may_shrink_max_model_len: bool,
    budget: DeviceBudget | None = None,
) -> tuple[int, int]:
    """(number of pages, max_model_len) for a cache of `cache_dtype`
    (`kv_cache_torch_dtype(cfg.kv_cache_dtype, model dtype)`), from, in this order: the
    config's page count or KV memory, the device `budget` (`profiling.device_budget`: a GPU's,
    measured, or a simulated one), the CPU rules. Logs how many tokens fit."""
    ps = cfg.page_size
    per_token = kv_bytes_per_token(model_config, cache_dtype)
    per_page = per_token * ps
    if cfg.num_kv_pages is not None:
        pages = cfg.num_kv_pages
        source = "num_kv_pages"
    else:
        if cfg.kv_cache_memory is not None:
            kv_bytes, source = cfg.kv_cache_memory, "kv_cache_memory"
        elif budget is not None:
            logger.info("KV cache budget: %s", budget.describe())
            kv_bytes, source = (
                budget.kv_cache,
                f"gpu_memory_utilization={cfg.gpu_memory_utilization}",
            )
        elif device.type == "cuda":
            raise ValueError("a CUDA device needs its measured budget to size the KV cache")
        elif not may_shrink_max_model_len:  # CPU, --max-model-len given: room for that context
            want = cfg.max_num_seqs * cdiv(max_model_len, ps) * per_page
            avail = available_memory_bytes()
            cap = int(avail * CPU_KV_MAX_RAM_FRACTION) if avail is not None else want
            kv_bytes = min(want, cap)
            source = f"max_model_len={max_model_len} x max_num_seqs={cfg.max_num_seqs}"
            if cap < want:
                source += f", bounded by {CPU_KV_MAX_RAM_FRACTION:.0%} of available RAM"
        else:
            kv_bytes, source = DEFAULT_CPU_KV_CACHE_MEMORY, "CPU default"
        pages = kv_cache_pages(kv_bytes, per_token, ps)
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


def choose_backends(
    cfg: EngineConfig, device: torch.device, kv_cache_dtype: torch.dtype, sharded: bool
) -> BackendChoice:
    """The backends the config asks for, resolved for `device` and a KV cache of
    `kv_cache_dtype` (`model.backends.resolve_backends`: Triton on CUDA, fp8 caches included
    where the Triton kernel reads them, NVIDIA sm_80+; torch references elsewhere), with the
    device's `KernelPolicy` (typed K2SERVE_* variables read there, once)."""
    return resolve_backends(
        device,
        attention=cfg.attention_backend,
        moe=cfg.moe_backend,
        kv_cache_dtype=kv_cache_dtype,
        policy=KernelPolicy.for_device(device, moe_prefill_precision=cfg.moe_prefill_precision),
        sharded=sharded,
    )


@dataclass
class RankSetup:
    model: Any  # DeepseekV3ForCausalLM (or an injected test double with its interface)
    kv_caches: list[torch.Tensor]
    spec: RuntimeSpec


def setup_rank(
    cfg: EngineConfig,
    device: torch.device,
    *,
    model_dir: str | None,
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
    3. resolve the dtypes and the backends (`choose_backends`) for the placement and the cache
       dtype, and install them; with experts on the CPU (one rank), the layer-wise prefill's
       device buffers are taken here, before the KV cache takes the free memory;
    4. size and allocate the KV cache (`num_kv_pages`, from the device budget that
       `profiling.device_budget` measures with a profiling pass of the largest steps;
       tensor-parallel workers get a config with rank 0's page count and max_model_len
       pinned);
    5. return the `RuntimeSpec` of all that, which everything downstream reads.
    CUDA graphs come last, captured by the runner (rank 0) on the finished model."""
    step_tokens = step_token_budget(cfg, device)
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
        placement = model.expert_placement
        if placement is None:
            placement = expert_placement(cfg, model.config)
    from k2serve.attention import allocate_kv_caches, kv_cache_torch_dtype

    dtype = activation_dtype(model, cfg, device)
    kv_dtype = kv_cache_torch_dtype(cfg.kv_cache_dtype, dtype)
    backends = choose_backends(cfg, device, kv_dtype, sharded=tp_size > 1)
    install_backends(model, backends, placement)
    if tp_size == 1 and placement is not None and not placement.all_on_gpu:
        from k2serve.moe.layerwise import setup_layerwise_prefill

        setup_layerwise_prefill(
            model, cfg.gpu_prefill_token_threshold, step_tokens,
            fused=backends.moe == "triton",
        )  # fmt: skip
    max_len = cfg.max_model_len or model.config.max_position_embeddings
    budget = None
    if cfg.num_kv_pages is None and cfg.kv_cache_memory is None:
        from k2serve.engine.profiling import device_budget

        budget = device_budget(
            model, model.config, kv_dtype, device,
            gpu_memory_utilization=cfg.gpu_memory_utilization, page_size=cfg.page_size,
            max_num_batched_tokens=step_tokens, max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_len, cuda_graphs=not cfg.enforce_eager, tp_size=tp_size,
            simulated_memory=envs.simulated_device_memory(),
        )  # fmt: skip
        if budget is not None and getattr(model.config, "vision", None) is not None:
            # K2.5: room for the vision encoder's working memory (the planner's row too)
            from k2serve.memory import encoder_activation_bytes

            extra = encoder_activation_bytes(model.config, step_tokens)
            budget = dataclasses.replace(budget, activations=budget.activations + extra)
    pages, max_len = num_kv_pages(
        cfg, model.config, kv_dtype, device, max_len, cfg.max_model_len is None, budget
    )
    draft = cfg.speculative_config
    if draft is not None and draft.method == "eagle3":  # spec decode: room for the draft
        from k2serve.engine.spec_decode.eagle import pages_with_draft

        pages, max_len = pages_with_draft(
            draft, cfg, model.config, kv_dtype, device, pages, max_len
        )
    if kv_cache_factory is None:
        kv_caches = allocate_kv_caches(model.config, pages, cfg.page_size, kv_dtype, device)
    else:
        kv_caches = kv_cache_factory(pages, cfg.page_size, kv_dtype, device)
    if kv_caches and kv_caches[0].dtype != kv_dtype:
        # NOTE: only an injected kv_cache_factory allocates another dtype than asked for; the
        # attention backend must match the cache it reads, so it is chosen for that one
        kv_dtype = kv_caches[0].dtype
        backends = choose_backends(cfg, device, kv_dtype, sharded=tp_size > 1)
        install_backends(model, backends, placement)
    from k2serve.engine.pipeline import resolve_async_scheduling

    overlap, why = resolve_async_scheduling(
        cfg.async_scheduling,
        tp_size=tp_size,
        model=model,
        speculative=cfg.speculative_config is not None,
        host_tier=bool(cfg.kv_offloading_size or cfg.swap_space),
        device_type=device.type,
        cpu_experts=placement is not None and not placement.all_on_gpu,
    )
    if tp_rank == 0:
        logger.info("async scheduling: %s", why)
    spec = RuntimeSpec(
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        max_model_len=max_len,
        num_kv_pages=pages,
        page_size=cfg.page_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=step_tokens,
        backends=backends,
        placement=placement,
        parallel=ParallelLayout(tp_size, cfg.enable_expert_parallel, cfg.nnodes),
        enforce_eager=cfg.enforce_eager,
        seed=cfg.seed,
        record_routing=cfg.record_routing,
        dynamic_expert_placement=cfg.dynamic_expert_placement,
        expert_placement_interval=cfg.expert_placement_interval,
        gpu_prefill_token_threshold=cfg.gpu_prefill_token_threshold,
        drafter=cfg.speculative_config,
        async_scheduling=overlap,
    )
    return RankSetup(model, kv_caches, spec)


def describe_weights(model, cfg) -> tuple[str, str]:
    """(weight formats, where experts live) for the start-up log."""
    by_dtype: dict[str, int] = {}
    devices: set[str] = set()
    expert_devices: set[str] = set()
    if isinstance(model, torch.nn.Module):
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            key = str(t.dtype).replace("torch.", "")
            by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
            devices.add(str(t.device))
            if ".experts." in name:
                expert_devices.add(str(t.device))
    quant = cfg.quant.method if cfg.quant else "bf16 (unquantized)"
    if cfg.quant and cfg.quant.method == "int4_group":
        quant = f"int4_group (group {cfg.quant.group_size})"
    elif cfg.quant and cfg.quant.method == "fp8_block":
        quant = f"fp8_block {cfg.quant.block_size[0]}x{cfg.quant.block_size[1]}"
    tensors = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_dtype.items()))
    formats = f"{quant}; tensors: {tensors or 'unknown'}"
    where = ", ".join(sorted(expert_devices or devices)) or "unknown"
    experts = f"{cfg.n_routed_experts} routed x {len(cfg.moe_layers)} MoE layers on {where}"
    return formats, experts
