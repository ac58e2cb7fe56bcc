"""The noaux_tc router of DeepSeek-V3 / Kimi-K2 (spec §3.5).

Invariants:
- Logits in float32 (from float32 inputs and weight, as transformers); scores = sigmoid(logits).
  The weight is never re-converted per call (see `TopkRouter.router_logits`).
- `e_score_correction_bias` (float32) is added for SELECTION only; the weights are the
  unbiased scores of the chosen experts, normalised (norm_topk_prob) and times
  routed_scaling_factor.
- With n_group > 1, groups are ranked by the sum of their top-2 biased scores; only the best
  topk_group groups are eligible.
- Ids are always in [0, E) and distinct per token, whatever the input: a NaN selection score
  ranks below every real one (NAN_SCORE) and gets weight 0. A non-finite
  hidden state is reported: on the CPU (where the check costs no device sync) a warning naming
  the layer, the first time and then every 1000th time per layer; on CUDA the count of steps
  with one is kept on the device (`nonfinite_steps`, CUDA-graph safe, read without a sync
  when the caller chooses) since a per-layer host check would stall every decode step.
- On the CPU at decode (a bf16 gate, decode rows) the logits and the top-k are one call of the
  CPU kernel (kernels/cpu/router.py: the same ids and weights as grouped_topk_torch, bit for
  bit); elsewhere (prompts, float32 gates, no kernel) the torch ops below.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from k2serve import envs
from k2serve.kernels.cpu.router import cpu_router_topk
from k2serve.kernels.router_torch import grouped_topk_torch

logger = logging.getLogger(__name__)


class TopkRouter(nn.Module):
    """Checkpoint names: `mlp.gate.weight` [E, hidden], `mlp.gate.e_score_correction_bias` [E]."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        E, D = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, D, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(E, dtype=torch.float32), requires_grad=False
        )
        self._w32: torch.Tensor | None = None  # float32 copy of `weight` (non-CUDA path)
        self._w32_key: tuple | None = None
        self._mm_out_dtype_ok = True
        self.use_triton = False  # set by the kernel policy: fused top-k kernel on CUDA
        # CPU decode: logits + top-k in one CPU kernel call (False: the torch ops; benchmarks)
        self.cpu_kernel_topk = True
        # set by the kernel policy: the one-row GEMV's configs at batch 1 (None: off)
        self.gemv_table: Mapping | None = None
        self.layer_idx: int | None = None  # set by the decoder layer; named in warnings
        self.nonfinite_count = 0  # CPU: calls whose input had a NaN / inf
        self.nonfinite_steps: torch.Tensor | None = None  # CUDA: the same count, on the device
        self.count_nonfinite_on_device = envs.router_nonfinite_count()  # CUDA only; see envs

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] float32
        """float32 logits as transformers computes them (x and weight upcast), without
        converting the weight per call: on CUDA a bf16/fp16 GEMM with float32 output (products
        of bf16 values are exact in float32, accumulation is float32), on the CPU at decode the
        CPU kernel's GEMV (bf16 weight, float32 x, float32 sums), elsewhere a float32 copy of
        the weight made once (and remade if the weight is replaced or moved)."""
        w = self.weight
        if w.dtype == torch.float32:
            return F.linear(x.to(torch.float32), w)
        if self.gemv_table is not None:
            from k2serve.kernels.gemv import gemv, use_gemv

            if use_gemv(x, w, self.gemv_table):
                return gemv(x, w, torch.float32, self.gemv_table)
        if x.is_cuda and x.dtype == w.dtype and self._mm_out_dtype_ok:
            try:
                return torch.mm(x, w.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # torch without mm(out_dtype=) for this dtype
                self._mm_out_dtype_ok = False
        if x.device.type == "cpu" and w.device.type == "cpu":
            from k2serve.kernels.cpu import cpu_linear

            # decode rows: the CPU kernel's GEMV on its pool (bf16 x bf16: exact products,
            # float32 sums: the upcast computation's values up to summation order; float32 x
            # or weight: widened exactly). torch's float32 GEMV here woke its OpenMP team,
            # whose threads then spun for ms on the cores the experts kernel call right after
            # this needs (dev box: 0.8 ms of CPU in the 20 ms after one call)
            xk = x if x.dtype == w.dtype else x.to(torch.float32)
            y = cpu_linear(xk, w, torch.float32)  # [T, E] float32, or None (a prompt)
            if y is not None:
                return y
        key = (w.data_ptr(), w.device, tuple(w.shape))
        if self._w32 is None or self._w32_key != key:
            self._w32 = w.detach().to(torch.float32)  # [E, hidden], not a parameter
            self._w32_key = key
        return F.linear(x.to(torch.float32), self._w32)

    def _report_nonfinite(self, logits: torch.Tensor) -> None:
        if logits.is_cuda and not self.count_nonfinite_on_device:
            return  # ids stay in [0, E) regardless; the count costs launches in every step
        bad = ~torch.isfinite(logits).all()  # a NaN / inf in x reaches every logit of its row
        if logits.is_cuda:
            if self.nonfinite_steps is None or self.nonfinite_steps.device != logits.device:
                self.nonfinite_steps = torch.zeros((), dtype=torch.int64, device=logits.device)
            self.nonfinite_steps.add_(bad.to(torch.int64))  # no host sync
            return
        if bool(bad):
            self._count_nonfinite()

    def _count_nonfinite(self) -> None:  # CPU: count, warn the first and every 1000th time
        self.nonfinite_count += 1
        if self.nonfinite_count % 1000 == 1:
            logger.warning(
                "non-finite hidden state reaches the router of layer %s (%d time(s) so far); "
                "its tokens get valid expert ids and weight 0 for NaN scores, but the "
                "output is likely garbage (check the weights and the input)",
                self.layer_idx, self.nonfinite_count,
            )  # fmt: skip

    def selection(self) -> tuple[torch.Tensor, int, int, int, bool, float]:
        """The noaux_tc selection's arguments after the logits, in the order the three top-k
        implementations take them: (bias, top_k, n_group, topk_group, norm, scaling)."""
        return (self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
                self.norm_topk_prob, self.routed_scaling_factor)  # fmt: skip

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        sel = self.selection()
        if self.cpu_kernel_topk and x.device.type == "cpu" and self.gemv_table is None:
            got = cpu_router_topk(x, self.weight, *sel)
            if got is not None:  # None: not a decode step on a bf16 gate, or no kernel
                weights, ids, nonfinite = got
                if nonfinite:
                    self._count_nonfinite()
                return weights, ids
        logits = self.router_logits(x)
        self._report_nonfinite(logits)
        if self.use_triton and logits.is_cuda:
            from k2serve.kernels.router import fused_grouped_topk

            return fused_grouped_topk(logits, *sel, torch.int64)
        return grouped_topk_torch(logits, *sel)
