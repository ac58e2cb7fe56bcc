"""RuntimeSpec: what one engine runs, resolved once by `engine.setup` and read by every layer.

`EngineConfig` is what the user asked for ("auto", None = "from the model / the memory");
`RuntimeSpec` is what was decided: concrete device and dtypes, the context length and page
count the KV cache was sized for, one backend per family and the kernel policy, the expert
placement, the parallel layout. The runner, the tensor-parallel executor, the routing service
and the server read the spec; nothing downstream reads `EngineConfig` for a value the spec
holds, and nothing re-decides one.

Slots that the next features fill (None today): `encoder` (a vision tower and its projector),
`drafter` (a speculative-decoding proposer), `kv_tier` (the host tier of the KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from k2serve.kernels.policy import KernelPolicy
from k2serve.model.backends import BackendChoice
from k2serve.moe.placement import ExpertPlacement


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is spread over processes: tensor-parallel ranks (experts split by rows or,
    with expert parallelism, by expert) over `nnodes` nodes; data-parallel ranks are engines."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    nnodes: int = 1
    data_parallel_size: int = 1


@dataclass(frozen=True)
class RuntimeSpec:
    device: torch.device
    dtype: torch.dtype  # weights (unquantized) and activations
    kv_cache_dtype: torch.dtype  # the latent cache's tensors
    max_model_len: int  # longest prompt + output, within what the cache holds
    num_kv_pages: int
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    backends: BackendChoice
    placement: ExpertPlacement | None  # None: every routed expert on `device`
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    enforce_eager: bool = False
    seed: int = 0
    # routing measured while serving (moe.dynamic.RoutingService)
    record_routing: str | None = None
    dynamic_expert_placement: bool = False
    expert_placement_interval: int = 1000
    gpu_prefill_token_threshold: int | None = None
    # --async-scheduling, resolved (engine.pipeline.resolve_async_scheduling): schedule and
    # process outputs while the model computes the step before
    async_scheduling: bool = False
    # slots for the next features (decisions 15-17)
    encoder: Any = None
    drafter: Any = None  # --speculative-config (engine.spec_decode.SpeculativeConfig) or None
    kv_tier: Any = None

    @property
    def kernel_policy(self) -> KernelPolicy:
        return self.backends.policy

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_pages * self.page_size

    @property
    def max_pages_per_seq(self) -> int:
        """Pages one sequence of max_model_len holds (the width of a block table)."""
        return min(self.num_kv_pages, -(-self.max_model_len // self.page_size))

    def describe(self) -> str:
        return (
            f"{self.device}, {str(self.dtype).removeprefix('torch.')}, KV "
            f"{str(self.kv_cache_dtype).removeprefix('torch.')} {self.num_kv_pages} pages x "
            f"{self.page_size}, max_model_len={self.max_model_len}, "
            f"max_num_batched_tokens={self.max_num_batched_tokens}; {self.backends.describe()}"
        )


__all__ = ["ParallelLayout", "RuntimeSpec"]
