"""EngineConfig: the frozen engine settings, and the CLI flags derived from them (vLLM names).

`EngineConfig.add_cli_args(parser)` adds one flag per field (`max_num_seqs` -> `--max-num-seqs`)
and `EngineConfig.from_cli_args(args)` reads them back, so `serve`, `generate` and `chat` share
flags and defaults. Invariant: a constructed EngineConfig has valid values (ValueError naming the
field otherwise); values that depend on the model (max_model_len, number of pages) stay None
until the engine resolves them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from k2serve.kernels.policy import check_moe_prefill_precision
from k2serve.memory import check_kv_cache_dtype

_HELP = {
    "model": "checkpoint directory (default: the bundled demo checkpoint)",
    "tokenizer": "tokenizer directory (default: the model directory)",
    "dtype": "weights and activations: auto, bfloat16, float16, float32",
    "device": "auto (cuda if available), cuda, cuda:N, cpu",
    "load_format": "auto, safetensors, dummy (random weights)",
    "max_model_len": "longest prompt + output in tokens (default: the model's maximum)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes); default "
    "8192 on a GPU of 70 GiB or more (as vLLM's server), else 2048",
    "page_size": "tokens per KV cache page",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts over steps, mixed with decodes",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (CUDA): weights, the "
    "largest step's activations (measured by a profiling pass at start-up), the decode graphs, "
    "and the KV cache, which gets the rest",
    "kv_cache_memory": "KV cache size in bytes or like '4GiB' (CPU default 1GiB; overrides the "
    "GPU fraction)",
    "num_kv_pages": "exact number of KV pages (overrides the memory budget)",
    "kv_cache_dtype": "auto (= model dtype), bf16, fp8 (float8_e4m3fn latent cache: twice the "
    "tokens; read by the Triton attention kernel on NVIDIA sm_80+, else the torch backend)",
    "attention_backend": "auto (Triton on CUDA, torch on CPU), torch, triton",
    "moe_backend": "auto (fused Triton MoE on CUDA, torch on CPU), torch, triton",
    "moe_prefill_precision": "activations of the routed-expert GEMMs of prompts: bf16, fp8 "
    "(FP8 tensor cores, activations quantized per token and 128 columns as DeepSeek-V3 / vLLM "
    "W8A8 block; FP8-block and INT4 checkpoints, CUDA), auto (fp8 only where this device's "
    "kernel table says it is faster and within the fidelity budget, else bf16)",
    "async_scheduling": "overlap the engine's host work (scheduling, batch preparation, output "
    "processing) with the model's step before, as vLLM; steps of requests with penalties, "
    "min_tokens, logits processors or structured outputs, and engines with tensor / data "
    "parallel, speculative decoding, the KV host tier or images, run synchronously (default: "
    "on for a CUDA device with every expert on it, off on the CPU and with CPU experts)",
    "stream_interval": "a streamed request gets its new tokens every N tokens (its first token "
    "and its end at once), as vLLM's and SGLang's --stream-interval: larger values cut the "
    "server's host work per token at high concurrency (default 1: every token)",
    "enforce_eager": "never capture CUDA graphs (decode steps run eagerly), as vLLM",
    "num_gpu_experts": "routed experts per MoE layer kept on the GPU, the rest in host memory "
    "computed on the CPU (default: all on the GPU; `k2serve plan` prints a value)",
    "expert_placement_file": 'JSON of per-layer routing counts {"layers": {"3": [count per '
    "expert]}}: the most-routed experts go on the GPU",
    "record_routing": "FILE: count per (MoE layer, expert) how often the router picks it, on the "
    "device, and write the counts to FILE (the --expert-placement-file format) every minute and "
    "at shutdown",
    "gpu_prefill_token_threshold": "steps of at least this many tokens compute the CPU experts "
    "on the GPU, streaming each layer's weights over PCIe (layer-wise GPU prefill); default: "
    "measured at start-up from the PCIe and CPU rates; 0: never",
    "dynamic_expert_placement": "while serving, move each MoE layer's most-routed experts to "
    "the GPU every --expert-placement-interval steps (needs --num-gpu-experts)",
    "expert_placement_interval": "steps between two dynamic expert re-placements",
    "max_waiting": "most requests waiting before new ones get EngineQueueFull (None: no limit)",
    "kv_offloading_size": "GiB of host RAM for a second tier of the KV cache (summed over the "
    "tensor-parallel ranks, as vLLM): prefix pages evicted from the GPU and preempted requests "
    "are kept there and copied back instead of recomputed (pinned memory; off on a CPU-only "
    "engine, whose cache is host memory already)",
    "kv_offloading_backend": "native (k2serve's host tier; the default when a size is given); "
    "lmcache is not supported",
    "swap_space": "GiB of host RAM per GPU for the KV host tier (vLLM's older spelling; "
    "--kv-offloading-size wins when both are given)",
    "seed": "seed of unseeded sampling",
    "tensor_parallel_size": "number of GPUs (processes) the model is sharded over (-tp)",
    "enable_expert_parallel": "with -tp N, give each rank 1/N of the routed experts instead of "
    "1/N of every expert",
    "distributed_backend": "auto (nccl on CUDA, gloo on CPU), nccl, gloo",
    # multi-node (k2serve.distributed.nodes): torchrun's names, as vLLM
    "nnodes": "nodes the tensor-parallel group spans (tensor_parallel_size / nnodes GPUs each)",
    "node_rank": "this node's rank: 0 serves HTTP, the others run `serve --headless`",
    "master_addr": "address of node 0, reachable from every node",
    "master_port": "torch.distributed port on node 0; node 0 also listens on master_port + 1",
    # speculative decoding (k2serve.engine.spec_decode)
    "speculative_config": 'JSON, as vLLM: {"method": "ngram" | "suffix" | "eagle3", '
    '"num_speculative_tokens": K, "model": DRAFT_DIR (eagle3), "prompt_lookup_min": a, '
    '"prompt_lookup_max": b, "disable_by_batch_size": N}',
    "limit_mm_per_prompt": "most multimodal items per prompt, JSON like '{\"image\": 4}' (K2.5; "
    "default 16 images, video 0: video is not supported)",
    "mm_encoder_tp_mode": "with -tp N, how the K2.5 vision tower runs: data (a step's new images "
    "are split over the ranks, each encodes its share, then all-gather) or weights (every rank "
    "encodes them all; NOTE: the tower's weights are replicated, not sharded, in both modes)",
    "dist_join_timeout": "seconds node 0 waits for every node to join; a worker node waits as "
    "long for node 0 (which listens once it has loaded its own shard)",
    # ---- data parallel + expert parallel (issue 29, k2serve.engine.dp); vLLM's names ----
    "data_parallel_size": "data-parallel ranks (GPUs), each a whole engine with its own scheduler "
    "and latent cache; the MoE experts are spread over them (expert parallel, all-to-all) (-dp, "
    "SGLang --dp-size)",
    "data_parallel_size_local": "data-parallel ranks on this node (default: all of them)",
    "data_parallel_address": "address of the node with data-parallel rank 0 (default: "
    "--master-addr)",
    "data_parallel_rpc_port": "port on that node for joining the data-parallel group (it also "
    "listens on port + 1)",
    "data_parallel_start_rank": "first data-parallel rank on this node (a --headless node)",
    "enable_dp_attention": "SGLang's spelling: with --tp N --dp-size N, N data-parallel "
    "attention ranks with expert-parallel MoE (the same as --data-parallel-size N)",
    "enable_eplb": "expert-parallel load balancing: replicate and move hot experts between the "
    "data-parallel ranks while serving",
    "eplb_config": 'JSON: {"window_size": steps of load kept, "step_interval": steps between '
    'rebalances, "num_redundant_experts": extra expert slots, "log_balancedness": bool}',
    "skip_non_local_expert_weights": "each data-parallel rank reads only its own experts from "
    "disk (always the case here; accepted for vLLM compatibility)",
}


def parse_bytes(value: str | int | None) -> int | None:
    """'4GiB' / '512MB' / '1e9' / 123 -> bytes."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", str(value), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"kv_cache_memory={value!r} is not a size (examples: 4GiB, 512MB, 1e9)")
    num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary else 1000
    return int(num * base ** " KMGT".index(unit or " "))


MM_MODALITIES = ("image", "video")
DEFAULT_IMAGE_LIMIT = 16


def parse_mm_limits(value: str | dict | None) -> dict[str, int]:
    """--limit-mm-per-prompt: '{"image": 4}' (JSON) or 'image=4,video=0' -> {modality: n}."""
    if value is None:
        return {"image": DEFAULT_IMAGE_LIMIT, "video": 0}
    if isinstance(value, str):
        import json

        text: str = value
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            try:
                value = {k.strip(): int(v) for k, v in (p.split("=") for p in text.split(","))}
            except ValueError:
                raise ValueError(
                    f'limit_mm_per_prompt={text!r} is not JSON like {{"image": 4}}'
                ) from None
    if not isinstance(value, dict):
        raise ValueError(f'limit_mm_per_prompt={value!r} must be an object like {{"image": 4}}')
    out = {"image": DEFAULT_IMAGE_LIMIT, "video": 0}
    for k, v in value.items():
        if k not in MM_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r} (image, video)")
        if isinstance(v, dict):  # vLLM's {"image": {"count": 4, ...}}
            v = v.get("count")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}]={v!r} must be a non-negative integer")
        out[k] = v
    return out


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: memory.default_max_num_batched_tokens
    page_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_kv_pages: int | None = None
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    moe_prefill_precision: str = "auto"
    enforce_eager: bool = False
    stream_interval: int = 1
    async_scheduling: bool | None = None  # None: on for CUDA (engine.pipeline's default)
    num_gpu_experts: int | None = None
    expert_placement_file: str | None = None
    record_routing: str | None = None
    gpu_prefill_token_threshold: int | None = None
    dynamic_expert_placement: bool = False
    expert_placement_interval: int = 1000
    max_waiting: int | None = None
    # K2 host KV tier (issue 27): k2serve.engine.kv_tier
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    swap_space: float | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_backend: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    dist_join_timeout: int = 600
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 29550
    data_parallel_start_rank: int = 0
    enable_dp_attention: bool = False
    enable_eplb: bool = False
    eplb_config: str | None = None
    skip_non_local_expert_weights: bool = False
    speculative_config: Any = None  # spec_decode.SpeculativeConfig (a dict or JSON is parsed)
    limit_mm_per_prompt: dict | None = None  # {"image": N}; None: 16 images
    mm_encoder_tp_mode: str = "weights"

    def __post_init__(self) -> None:
        from k2serve.engine.spec_decode.config import SpeculativeConfig

        spec = SpeculativeConfig.parse(self.speculative_config)  # ValueError if bad
        object.__setattr__(self, "speculative_config", spec)
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        if isinstance(self.limit_mm_per_prompt, str):
            object.__setattr__(
                self, "limit_mm_per_prompt", parse_mm_limits(self.limit_mm_per_prompt)
            )
        parse_mm_limits(self.limit_mm_per_prompt)  # ValueError when malformed
        if self.mm_encoder_tp_mode not in ("weights", "data"):
            raise ValueError(
                f"mm_encoder_tp_mode={self.mm_encoder_tp_mode!r} is not weights or data"
            )

        def positive(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")

        for name in ("max_num_seqs", "page_size", "tensor_parallel_size", "stream_interval"):
            positive(name)
        positive("max_num_batched_tokens", allow_none=True)
        if self.distributed_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(
                f"distributed_backend={self.distributed_backend!r} is not auto, nccl or gloo"
            )
        from k2serve.distributed.dp_layout import check_data_parallel
        from k2serve.distributed.nodes import check_nodes

        check_data_parallel(self)  # may rewrite SGLang's / torchrun's spellings (issue 29)
        check_nodes(self.nnodes, self.node_rank, self.tensor_parallel_size, self.master_port)
        positive("dist_join_timeout")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} must be a bool or None")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_pages", "max_waiting"):
            positive(name, allow_none=True)
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
            raise ValueError(f"seed={seed!r} must be an integer in [-2**63, 2**63 - 1] (int64)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.dtype not in (
            "auto",
            "bfloat16",
            "bf16",
            "float16",
            "fp16",
            "half",
            "float32",
            "fp32",
            "float",
        ):
            raise ValueError(f"dtype={self.dtype!r} is not one of auto, bfloat16, float16, float32")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} is not auto, safetensors or dummy")
        if self.kv_cache_dtype in ("fp8_e4m3", "float8_e4m3fn"):  # vLLM / SGLang spellings
            object.__setattr__(self, "kv_cache_dtype", "fp8")
        check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("attention_backend", "moe_backend"):
            if getattr(self, name) not in ("auto", "torch", "triton"):
                raise ValueError(f"{name}={getattr(self, name)!r} is not auto, torch or triton")
        check_moe_prefill_precision(self.moe_prefill_precision)
        positive("expert_placement_interval")
        for name in ("kv_offloading_size", "swap_space"):  # K2 host KV tier
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
                raise ValueError(f"{name}={v!r} must be a non-negative number of GiB")
        if self.kv_offloading_backend not in (None, "native"):
            raise ValueError(
                f"kv_offloading_backend={self.kv_offloading_backend!r}: only 'native' (k2serve's "
                "own host tier) is available; LMCache is not integrated, use --kv-offloading-"
                "backend native or leave it out"
            )
        t = self.gpu_prefill_token_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"gpu_prefill_token_threshold={t!r} must be a non-negative integer")
        if self.dynamic_expert_placement and self.num_gpu_experts is None:
            raise ValueError("dynamic_expert_placement needs num_gpu_experts (experts per MoE "
                             "layer kept on the GPU)")  # fmt: skip
        if (self.record_routing or self.dynamic_expert_placement) and (
            self.tensor_parallel_size > 1
        ):
            raise ValueError("record_routing / dynamic_expert_placement need -tp 1")
        n = self.num_gpu_experts
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"num_gpu_experts={n!r} must be a non-negative integer")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    # ---- CLI ---------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        defaults = EngineConfig()
        for f in fields(EngineConfig):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = getattr(defaults, f.name)
            help_ = _HELP.get(f.name, "")
            if isinstance(default, bool) or f.name == "async_scheduling":
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, help=help_
                )
                continue
            typ: Callable[[str], Any] | None = {
                "max_model_len": int, "num_kv_pages": int, "max_waiting": int,
                "max_num_batched_tokens": int, "num_gpu_experts": int,
                "data_parallel_size_local": int,
                "gpu_prefill_token_threshold": int, "limit_mm_per_prompt": str,
                "kv_offloading_size": float, "swap_space": float}.get(f.name)  # fmt: skip
            if typ is None:
                typ = type(default) if default is not None else str
            parser.add_argument(flag, type=typ, default=default, help=help_)
        if "page_size" not in skip:
            parser.add_argument("--block-size", dest="page_size", type=int, help=argparse.SUPPRESS)
        if "tensor_parallel_size" not in skip:
            parser.add_argument(
                "-tp", dest="tensor_parallel_size", type=int, help=argparse.SUPPRESS
            )
        # data parallel: vLLM's short forms and SGLang's --dp-size
        for short, dest in (("-dp", "data_parallel_size"), ("--dp-size", "data_parallel_size"),
                            ("-dpl", "data_parallel_size_local"),
                            ("-dpa", "data_parallel_address"), ("-dpp", "data_parallel_rpc_port"),
                            ("-dpr", "data_parallel_start_rank")):  # fmt: skip
            if dest not in skip:
                typ = str if dest == "data_parallel_address" else int
                parser.add_argument(short, dest=dest, type=typ, help=argparse.SUPPRESS)

    @staticmethod
    def from_cli_args(args: argparse.Namespace, **overrides) -> EngineConfig:
        kw = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
        kw.update(overrides)
        return EngineConfig(**kw)
