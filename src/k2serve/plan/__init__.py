"""The planner: what fits on given hardware, how much context, what speed; `k2serve plan`,
`k2serve download` and the hardware table they share. No torch import anywhere in the package.

- `weights`: bytes of every weight group, from config shapes and dtypes.
- `planner`: `plan(...)`, from `k2serve.memory`'s KV, activation and graph formulas (shared
  with the engine).
- `suggest`: what to change when a plan does not fit.
- `hardware`: the GPU table and size / bandwidth parsing.
- `commands`: the `k2serve serve` command lines a plan prints (one per node).
- `cli`, `download`: the `k2serve plan` and `k2serve download` subcommands.
"""

from k2serve.memory import (
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    MAX_IMAGE_TOKENS,
    RUNTIME_RESERVE_BYTES,
    activation_bytes,
    encoder_activation_bytes,
    encoder_cache_tokens,
    encoder_max_patches,
    kv_bytes_per_token,
)
from k2serve.plan.hardware import CPU_MEMORY_UTILIZATION
from k2serve.plan.planner import (
    DEFAULT_CPU_BANDWIDTH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PAGE_SIZE,
    DeviceMemory,
    Plan,
    plan,
)
from k2serve.plan.weights import (
    WeightBreakdown,
    linear_bytes,
    vision_bytes,
    weight_breakdown,
    weight_bytes,
)

__all__ = [
    "CPU_MEMORY_UTILIZATION",
    "DEFAULT_CPU_BANDWIDTH",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DEFAULT_PAGE_SIZE",
    "DTYPE_BYTES",
    "MAX_IMAGE_TOKENS",
    "encoder_activation_bytes",
    "encoder_cache_tokens",
    "encoder_max_patches",
    "KV_CACHE_DTYPES",
    "RUNTIME_RESERVE_BYTES",
    "DeviceMemory",
    "Plan",
    "WeightBreakdown",
    "activation_bytes",
    "kv_bytes_per_token",
    "linear_bytes",
    "plan",
    "vision_bytes",
    "weight_breakdown",
    "weight_bytes",
]
