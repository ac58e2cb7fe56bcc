"""The planner's host KV tier (issue 27): how much host RAM `serve --kv-offloading-size` gets.

Pure and torch-free like the planner. The tier lives in host RAM beside the CPU experts (hybrid
mode), so it gets what the experts leave: asked for (`--kv-offloading-size GiB`, the total over
the tensor-parallel ranks as vLLM), it must fit in `CPU_MEMORY_UTILIZATION` of `--cpu-memory`
after the experts; left to the planner (None), it takes half of that remainder, at most
`AUTO_MAX_TIMES` the GPU cache per rank (an agent trace's working set of a few GPU pools; more
pinned RAM only slows start-up), rounded down to whole GiB. Off without a GPU (the KV cache is
host RAM already) and when no `--cpu-memory` is given for the planner to size it from.

NOTE: kept apart from plan.py (which is being split into a package) so that plan() only calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO_SHARE = 0.5  # of the RAM left after the CPU experts
AUTO_MAX_TIMES = 8  # the GPU KV cache's size, per rank


@dataclass(frozen=True)
class HostKVTier:
    total_bytes: int  # over all ranks (--kv-offloading-size)
    tokens_per_rank: int  # tokens each rank's host tier holds
    note: str
    reason: str | None  # why an asked-for size does not fit (None: it fits)

    @property
    def gib(self) -> float:
        return self.total_bytes / 2**30

    def serve_args(self) -> list[str]:
        return ["--kv-offloading-size", f"{self.gib:g}"] if self.total_bytes else []


def host_kv_tier(
    asked_gib: float | None,
    *,
    num_gpus: int,
    nnodes: int,
    cpu_memory: int,
    usable_ram: int,
    cpu_need: int,
    kv_bytes_per_token: int,
    gpu_kv_tokens: int,
) -> HostKVTier:
    """The tier's size for a plan; `cpu_memory` / `usable_ram` / `cpu_need` are per node."""
    if not num_gpus:
        return HostKVTier(0, 0, "", None)
    left = max(0, usable_ram - cpu_need) * nnodes  # RAM the experts leave, all nodes
    if asked_gib is None:
        if cpu_memory <= 0:
            return HostKVTier(0, 0, "no KV host tier: give --cpu-memory to size one", None)
        cap = AUTO_MAX_TIMES * gpu_kv_tokens * kv_bytes_per_token * num_gpus
        total = int(min(left * AUTO_SHARE, cap)) // 2**30 * 2**30
    else:
        total = int(asked_gib * 2**30)
    if not total:
        return HostKVTier(0, 0, "", None)
    per_rank = total // num_gpus
    tokens = per_rank // kv_bytes_per_token
    times = f" = {tokens / gpu_kv_tokens:.1f}x the GPU cache" if gpu_kv_tokens else ""
    experts = (
        f"; host RAM also holds the CPU experts ({cpu_need / 2**30:.0f} GiB)" if cpu_need else ""
    )
    note = (
        f"KV host tier (--kv-offloading-size {total / 2**30:g}): {per_rank / 2**30:.1f} GiB of "
        f"pinned host RAM per GPU, {tokens:,} tokens of prefix / swapped KV per rank{times}"
        f"{experts}"
    )
    reason = None
    if asked_gib is not None and cpu_memory <= 0:
        note += " (not checked against host RAM: give --cpu-memory)"
    elif asked_gib is not None and total > left:
        reason = (
            f"--kv-offloading-size {asked_gib:g} GiB does not fit in host RAM: "
            f"{left / 2**30:.0f} GiB is left of --cpu-memory after the CPU experts"
        )
    return HostKVTier(total, tokens, note, reason)
