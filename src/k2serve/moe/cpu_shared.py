"""The shared expert at CPU decode as one call of the CPU experts kernel, where that is faster.

Owns: `CpuSharedExpert` (called by model.deepseek_v3.MoE with its shared-expert MLP: the MLP's
output computed by moe.cpu_experts.CpuExpertBackend over that one bf16 expert, always selected
with weight 1, or None: then the MLP's own forward runs; `with_routed`: the same expert added
to the routed experts' CPU kernel call, one pool job for both) and `use_kernel()`, the rule.

The rule, from measured figures (benchmarks/cpu_e2e.py --full-k2, its "shared expert as" lines;
RESULTS.md): on the 16-core host (16 pool threads) one kernel call (gate/up, SiLU * up, down in
one pool job, no Python between) took 0.854 / 0.900 ms a layer against 1.021 / 1.058 ms for the
fused gate_up GEMV + SiLU * up + down GEMV the model runs otherwise (two runs); on 2 threads the
fused GEMV won on the host (2.853 vs 3.250 ms) and the two were within 3% on the 2-core dev box.
So the kernel runs it from KERNEL_MIN_THREADS pool threads (between the two measured counts).

Applies to: host bf16 activations [T, hidden] with T <= kernels.cpu.LINEAR_MAX_ROWS (decode),
an MLP of bf16 linears (scheme bf16), no forward hooks on it (they would be skipped), no
torch dispatch mode recording. The kernel reads the weights in place (no copy); it is rebuilt
when the module or its weights are replaced. Results: the kernel's float32 sums of the same
bf16 products (SiLU * up rounded to bf16 once, not g and u each first): within bf16 rounding of
the module's forward, not bit-identical to it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from k2serve import envs
from k2serve.kernels import cpu as ck

KERNEL_MIN_THREADS = 8


def use_kernel(threads: int | None = None) -> bool:
    """True when the shared expert runs as one experts-kernel call at `threads` pool threads
    (None: the pool's, K2SERVE_CPU_THREADS or torch's)."""
    n = threads or envs.cpu_threads() or torch.get_num_threads()
    return n >= KERNEL_MIN_THREADS


def _weights(mlp: nn.Module) -> tuple | None:
    """(gate, up, down) weights when all three are bf16 linears on the CPU (scheme "bf16" with
    bf16 weights: what the experts kernel reads as FMT_BF16), else None."""
    from k2serve.moe.cpu_experts import _expert_format

    lins = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(m is None or _expert_format(m) != ck.FMT_BF16 for m in lins):
        return None
    ws = tuple(m.weight for m in lins if m is not None)
    return ws if all(w.device.type == "cpu" for w in ws) else None


class CpuSharedExpert:
    def __init__(self) -> None:
        self._key: tuple | None = None
        self._backend: Any = None  # CpuExpertBackend over the one expert; None: not native

    def __getstate__(self) -> dict:  # the kernel's handles are per process: rebuilt on use
        return {}

    def __setstate__(self, state: dict) -> None:
        self._key, self._backend = None, None

    def _kernel_backend(self, mlp: nn.Module, x: torch.Tensor):
        """The CpuExpertBackend over `mlp`'s one expert when the kernel runs it for `x` (the
        rule and the cases in the module docstring), else None."""
        if not (
            x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and x.dim() == 2
            and 0 < x.shape[0] <= ck.LINEAR_MAX_ROWS
            and not x.requires_grad
            and not mlp._forward_hooks
            and not mlp._forward_pre_hooks
            and use_kernel()
            and not ck.dispatch_mode_active()
        ):
            return None
        ws = _weights(mlp)
        if ws is None:
            return None
        key = (id(mlp), *((w.data_ptr(), tuple(w.shape)) for w in ws))
        if key != self._key:
            from k2serve.moe.cpu_experts import CpuExpertBackend

            be = CpuExpertBackend([mlp], [0], 1)
            self._backend = be if be.impl == "native" else None
            self._key = key
        return self._backend

    def __call__(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        be = self._kernel_backend(mlp, x)
        if be is None:
            return None
        T = x.shape[0]
        ids = torch.zeros(T, 1, dtype=torch.int64)  # [T, 1]: the one expert
        return be(x, ids, torch.ones(T, 1))  # [T, hidden] bf16

    def with_routed(self, mlp: nn.Module, routed, x, topk_ids, topk_weights):
        """routed(x, topk_ids, topk_weights) + this shared expert, in ONE kernel call, where the
        shared expert runs on the kernel (as __call__) and `routed` is a native
        CpuExpertBackend on the same pool (K2SERVE_CPU_FUSED_SHARED, default on): one pool
        job instead of two (one wake-up, prologue and phase tails; the shared expert's gate/up
        items fill the routed experts' tail). The float32 sum of both is rounded to bf16 once
        (the two calls rounded each, then added in bf16: within bf16 rounding of that, not
        bit-identical). -> [T, hidden] bf16, or None: the caller runs the two."""
        from k2serve.moe.cpu_experts import CpuExpertBackend

        if not (
            isinstance(routed, CpuExpertBackend)
            and routed.impl == "native"
            and routed.hidden_size == x.shape[-1]
            and envs.cpu_fused_shared()
        ):
            return None
        be = self._kernel_backend(mlp, x)
        if be is None or be._pool_key != routed._pool_key:
            return None
        return routed.forward_with_shared(x, topk_ids, topk_weights, be)  # [T, hidden] bf16


__all__ = ["KERNEL_MIN_THREADS", "CpuSharedExpert", "use_kernel"]
