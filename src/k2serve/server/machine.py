"""`k2serve serve`'s machine check: the hardware the flags ask for exists, and the start-up log
says what was chosen (device, CPU threads, NUMA placement, where the experts go).

Owns: `check_machine(cfg, given, guide_numa_nodes)` -> the EngineConfig to run (ValueError when
the machine cannot do what the flags ask), and `Machine` (what this host has, injectable for
tests).

Invariants: GPU-only flags (tensor / expert parallelism, GPU experts, layer-wise GPU prefill)
without a visible GPU are errors unless `--device cpu` says the CPU is meant; GPU memory and
CUDA-graph flags on the CPU log one line saying they do nothing; CPU thread counts and NUMA
topologies naming more CPUs than this process may use are errors.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from k2serve import envs

logger = logging.getLogger("k2serve.server")


@dataclass(frozen=True)
class Machine:
    """What this host offers to this process."""

    num_gpus: int  # CUDA devices visible
    cpus: tuple[int, ...]  # CPU ids this process may run on
    numa_nodes: tuple[tuple[int, ...], ...]  # CPU ids per NUMA node (usable ones)

    @staticmethod
    def detect() -> Machine:
        import torch

        from k2serve.kernels.cpu import numa_topology

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        nodes = tuple(tuple(n) for n in numa_topology())
        return Machine(gpus, cpus, nodes)


def _cpulist(cpus) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _gpu_flags(cfg, given: set[str]) -> list[str]:
    """The flags given that only mean something with GPUs."""
    out = []
    if cfg.tensor_parallel_size > 1:
        out.append(f"--tensor-parallel-size {cfg.tensor_parallel_size}")
    if cfg.data_parallel_size > 1:
        out.append(f"--data-parallel-size {cfg.data_parallel_size}")
    if cfg.enable_expert_parallel and "enable_expert_parallel" in given:
        out.append("--enable-expert-parallel")
    if cfg.num_gpu_experts is not None:
        out.append(f"--num-gpu-experts {cfg.num_gpu_experts}")
    if cfg.gpu_prefill_token_threshold is not None:
        out.append(f"--gpu-prefill-token-threshold {cfg.gpu_prefill_token_threshold}")
    if cfg.dynamic_expert_placement:
        out.append("--dynamic-expert-placement")
    if cfg.distributed_backend == "nccl":
        out.append("--distributed-backend nccl")
    if cfg.device.startswith("cuda"):
        out.append(f"--device {cfg.device}")
    return out


def check_threads(machine: Machine, guide_numa_nodes: int | None = None) -> str:
    """Check K2SERVE_CPU_THREADS / --kt-cpuinfer and the NUMA topology against the machine;
    -> the log line describing the CPU experts' threads and NUMA placement."""
    threads = envs.cpu_threads()
    have = len(machine.cpus)
    if threads is not None and threads > have:
        raise ValueError(
            f"{threads} CPU threads asked (--kt-cpuinfer / K2SERVE_CPU_THREADS); this process "
            f"may use {have} CPUs ({_cpulist(machine.cpus)})"
        )
    injected = envs.numa_topology()
    nodes = machine.numa_nodes
    if injected:
        from k2serve.kernels.cpu import numa_topology

        topo = numa_topology(injected)
        extra = sorted({c for n in topo for c in n} - set(machine.cpus))
        if extra:
            raise ValueError(
                f"K2SERVE_NUMA_TOPOLOGY={injected!r} names CPUs {_cpulist(extra)} this process "
                f"cannot use (it may use {_cpulist(machine.cpus)})"
            )
        nodes = tuple(tuple(n) for n in topo)
    if guide_numa_nodes is not None and not 1 <= guide_numa_nodes <= len(nodes):
        raise ValueError(
            f"--kt-threadpool-count {guide_numa_nodes}: this machine has {len(nodes)} NUMA "
            f"node(s) with usable CPUs"
        )
    where = "; ".join(f"node {i}: CPUs {_cpulist(n)}" for i, n in enumerate(nodes))
    used = threads if threads is not None else "all usable"
    src = "K2SERVE_CPU_THREADS" if threads is not None else "default"
    return (
        f"CPU kernel (CPU experts, CPU GEMVs): {used} threads ({src}) of {have} CPUs, grouped "
        f"by {len(nodes)} NUMA node(s) ({where})"
    )


def check_machine(cfg, given: set[str], guide_numa_nodes: int | None = None, machine=None):
    """-> the EngineConfig to run on this machine, or ValueError naming what is missing.

    `given`: the EngineConfig fields set on the command line (defaults are not warned about).
    """
    machine = machine or Machine.detect()
    device = cfg.device
    on_cpu = device == "cpu" or (device == "auto" and machine.num_gpus == 0)
    if machine.num_gpus == 0 and device != "cpu":
        flags = _gpu_flags(cfg, given)
        if flags:
            raise ValueError(
                f"{' '.join(flags)} asks for GPUs, and this machine has none (no CUDA device "
                "visible); add --device cpu to run it on the CPU"
                + (
                    f" ({ranks} ranks over gloo, for testing)"
                    if (ranks := cfg.tensor_parallel_size * cfg.data_parallel_size) > 1
                    else ""
                )
            )
    ranks_here = cfg.tensor_parallel_size // max(cfg.nnodes, 1)
    if not on_cpu and machine.num_gpus < ranks_here:
        raise ValueError(
            f"--tensor-parallel-size {cfg.tensor_parallel_size} over {cfg.nnodes} node(s) needs "
            f"{ranks_here} GPUs on this node; {machine.num_gpus} visible "
            "(CUDA_VISIBLE_DEVICES?)"
        )
    dp_here = cfg.data_parallel_size_local or cfg.data_parallel_size
    if not on_cpu and machine.num_gpus < dp_here:
        raise ValueError(
            f"--data-parallel-size {cfg.data_parallel_size} needs {dp_here} GPUs on this node; "
            f"{machine.num_gpus} visible (CUDA_VISIBLE_DEVICES? --data-parallel-size-local?)"
        )
    if cfg.enable_expert_parallel and cfg.tensor_parallel_size == cfg.data_parallel_size == 1:
        logger.warning(
            "--enable-expert-parallel changes nothing with one rank: experts are split over "
            "the tensor-parallel ranks (give --tensor-parallel-size N)"
        )
    if on_cpu:
        if "gpu_memory_utilization" in given:
            logger.warning(
                "--gpu-memory-utilization does nothing on the CPU: the KV cache takes "
                "--kv-cache-memory (default 1GiB) or --num-kv-pages"
            )
        if cfg.enforce_eager:
            logger.warning("--enforce-eager does nothing on the CPU: there are no CUDA graphs")
        if cfg.num_gpu_experts is not None or cfg.dynamic_expert_placement:
            logger.warning(
                "--num-gpu-experts / --dynamic-expert-placement do nothing on the CPU: every "
                "expert is computed on the CPU"
            )
            cfg = cfg.replace(
                num_gpu_experts=None,
                dynamic_expert_placement=False,
                gpu_prefill_token_threshold=None,
            )
    cpu_line = check_threads(machine, guide_numa_nodes)
    if on_cpu:
        logger.info("device: cpu (%d CPUs usable; no GPU%s)", len(machine.cpus),
                    "" if device == "cpu" else " visible")  # fmt: skip
        logger.info("%s", cpu_line)
    else:
        logger.info("device: %d of %d GPU(s) on this node", ranks_here, machine.num_gpus)
        if cfg.num_gpu_experts is not None:
            logger.info("%s", cpu_line)
    return cfg
