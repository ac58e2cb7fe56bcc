"""The engine's host KV tier (issue 27): its size from the config and the host's RAM.

`--kv-offloading-size GiB` (vLLM's flag) is the host RAM summed over the tensor-parallel ranks;
`--swap-space GiB` (vLLM's older spelling) is per rank. Each rank keeps its own host copy of its
own cache (the latent cache is replicated over TP ranks), so a rank's tier holds
`bytes_per_rank // bytes_per_page` pages, and every rank's tier has the same page count.

On a CPU-only engine the KV cache is host memory already: the tier is off (one log line says
so) unless K2SERVE_KV_HOST_TIER_ON_CPU forces it, a test / debug knob that runs the copy path
between two host buffers. In the hybrid CPU-expert mode the experts share host RAM with the
tier: the log line says how much each holds, and a tier that would not fit in the RAM left
after the load is refused with the numbers.
"""

from __future__ import annotations

import logging

import torch

from k2serve import envs
from k2serve.cache.host_tier import HostTier
from k2serve.engine.config import EngineConfig
from k2serve.engine.setup import available_memory_bytes

logger = logging.getLogger(__name__)

HOST_TIER_MAX_RAM_FRACTION = 0.9  # of MemAvailable after the load (for every rank on this node)


def host_tier_bytes_per_rank(cfg: EngineConfig) -> tuple[int, str]:
    """(bytes of host RAM per rank, which flag said so); (0, "") when the tier is not asked."""
    tp = cfg.tensor_parallel_size
    if cfg.kv_offloading_size is not None:
        if cfg.swap_space is not None:
            logger.info("--swap-space %g ignored: --kv-offloading-size is given", cfg.swap_space)
        size = cfg.kv_offloading_size
        return int(size * 2**30) // tp, f"--kv-offloading-size {size:g} GiB over {tp} rank(s)"
    if cfg.swap_space is not None:
        return int(cfg.swap_space * 2**30), f"--swap-space {cfg.swap_space:g} GiB per rank"
    if cfg.kv_offloading_backend is not None:
        logger.info(
            "--kv-offloading-backend %s does nothing without --kv-offloading-size: no KV host tier",
            cfg.kv_offloading_backend,
        )
    return 0, ""


def host_bytes_of(model) -> int:
    """Bytes of the model's parameters and buffers in host memory (CPU-placed experts)."""
    tensors: list[torch.Tensor] = [*getattr(model, "parameters", list)()]
    tensors += getattr(model, "buffers", list)()
    return sum(t.nbytes for t in tensors if t.device.type == "cpu")


def num_host_pages(
    cfg: EngineConfig, device: torch.device, kv_caches: list[torch.Tensor], model=None
) -> int:
    """Host pages per rank for the tier (0: off), logged with the host RAM split."""
    want, source = host_tier_bytes_per_rank(cfg)
    if not want:
        return 0
    if device.type != "cuda" and not envs.kv_host_tier_on_cpu():
        logger.info(
            "KV host tier: off (%s ignored): the engine runs on the CPU, whose KV cache is host "
            "memory already",
            source,
        )
        return 0
    per_page = sum(c[0].numel() * c.element_size() for c in kv_caches)
    pages = want // per_page
    if pages < 1:
        raise ValueError(f"the KV host tier ({source}) holds no page of {per_page} bytes")
    ranks_here = cfg.tensor_parallel_size // max(cfg.nnodes, 1)
    need = pages * per_page * ranks_here
    avail = available_memory_bytes()
    experts = host_bytes_of(model) if device.type == "cuda" and model is not None else 0
    if avail is not None and need > HOST_TIER_MAX_RAM_FRACTION * avail:
        raise ValueError(
            f"the KV host tier ({source}) needs {need / 2**30:.1f} GiB of host RAM on this node "
            f"({ranks_here} rank(s)); {avail / 2**30:.1f} GiB is available after the load"
            + (f" (experts in host RAM: {experts / 2**30:.1f} GiB)" if experts else "")
            + f"; give at most {HOST_TIER_MAX_RAM_FRACTION:.0%} of it"
        )
    page_size = kv_caches[0].shape[1]
    logger.info(
        "KV host tier: %d pages x %d tokens = %d tokens per rank (%.2f GiB %s, %s)%s; host RAM "
        "%s GiB available before it%s",
        pages,
        page_size,
        pages * page_size,
        pages * per_page / 2**30,
        "pinned" if device.type == "cuda" else "plain (K2SERVE_KV_HOST_TIER_ON_CPU)",
        source,
        f" on each of {cfg.tensor_parallel_size} ranks" if cfg.tensor_parallel_size > 1 else "",
        f"{avail / 2**30:.1f}" if avail is not None else "?",
        f", experts in host RAM hold {experts / 2**30:.1f} GiB" if experts else "",
    )
    return pages


def make_host_tier(num_pages: int, kv_caches: list[torch.Tensor]) -> HostTier | None:
    """The engine's bookkeeping half of the tier (None when it is off). On the CPU (the test
    knob) every copy is synchronous, so every load goes with the step that needs it."""
    if not num_pages:
        return None
    per_page = sum(c[0].numel() * c.element_size() for c in kv_caches)
    tier = HostTier(num_pages, kv_caches[0].shape[1], per_page)
    if kv_caches[0].device.type != "cuda":
        tier.immediate_bytes = float("inf")
    return tier


def host_tier_stats(host: HostTier | None, runner) -> dict:
    """The tier's fields of `EngineStats` (none when it is off); rank 0's copier's counts."""
    if host is None:
        return {}
    copier = getattr(runner, "kv_copier", None)
    c = copier.stats() if copier is not None else {}
    return dict(
        kv_host_pages_used=round(host.usage * host.num_pages),
        kv_host_pages_total=host.num_pages,
        host_cache_hits=host.hit_tokens,
        kv_offload_bytes_d2h=c.get("bytes_d2h", 0),
        kv_offload_bytes_h2d=c.get("bytes_h2d", 0),
        kv_offload_seconds_d2h=c.get("seconds_d2h", 0.0),
        kv_offload_seconds_h2d=c.get("seconds_h2d", 0.0),
        num_swap_outs=host.num_swap_outs,
        num_swap_ins=host.num_swap_ins,
        num_swapped=len(host.swapped),
        kv_copy_stalls=c.get("stall_waits", 0),
    )
