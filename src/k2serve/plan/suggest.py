"""What would fit when a plan does not: each suggestion found by re-planning with one setting
changed (fp8 KV cache, a larger memory share, more GPUs, bigger GPUs, host RAM for experts)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k2serve.config import ModelConfig
from k2serve.plan import commands as pc
from k2serve.plan.hardware import CPU_MEMORY_UTILIZATION, GPU_PRESETS, GpuSpec

if TYPE_CHECKING:
    from k2serve.plan.planner import Plan

# Suggestions do not offer contexts shorter than this.
MIN_USEFUL_CONTEXT = 4096


def suggestions(
    config: ModelConfig, p: Plan, gpu: GpuSpec | None, replan: Callable[..., Plan]
) -> list[str]:
    """What would fit, each found by re-planning with settings changed (and the longest context
    that then fits, when the requested one still does not). `replan` is `planner.plan`."""
    plan = replan
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
    counts = pc.valid_counts(lambda n: config.num_attention_heads % n == 0, p.gpus_per_node)
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
    bigger = bigger_gpu(config, base, counts, gpu, p.max_model_len, replan)
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


def bigger_gpu(
    config, base: dict, counts: list[int], gpu, ctx: int, plan: Callable[..., Plan]
) -> str | None:
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
