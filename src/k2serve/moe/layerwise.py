"""Layer-wise GPU prefill of CPU-resident experts (KT's --kt-gpu-prefill-token-threshold).

A step of at least `threshold` tokens does not compute the CPU experts on the CPU: each hybrid
layer's CPU experts are copied over PCIe into one of two device slots (a double buffer) and
run with the GPU expert backend, while the copy of the next hybrid layer's experts into the
other slot runs on a side stream under this layer's compute. Below the threshold the CPU
computes them (moe.cpu_experts). A 30K-token prompt then costs about one PCIe transfer of the
CPU experts per chunk instead of the CPU's compute on 30K tokens.

Owns: `LayerwisePrefill` (host stacks, device slots, streams/events, the per-layer run) and
`setup_layerwise_prefill(model, threshold)` with the threshold's calibration.

Invariants:
- Each hybrid layer's CPU experts are stacked once into host tensors in the fused-MoE layout
  (moe.fused_moe.stack_experts: the experts' parameters become views of the stack, so the
  CPU backend, the state_dict and dynamic re-placement all see the same memory); on CUDA the
  stacks are page-locked (cudaHostRegister) so copies are asynchronous DMA at the PCIe rate.
- Slot s holds hybrid layer i with i % 2 == s. A copy into a slot waits for the slot's
  previous layer's compute (`free` event); a layer's compute waits for its copy (`ready`).
- Weight changes (dynamic re-placement) call `invalidate()`.
- On a CPU device ("GPU" = the CPU, for tests) the copies are plain and synchronous and the
  streamed experts run through the torch reference of the fused MoE: same numerics as the
  CPU backend (float32), so placements can be compared on a CPU-only machine.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import weakref

import torch
from torch import nn

from k2serve.kernels.fused_moe import ExpertWeights, fused_moe_ref
from k2serve.moe.base import ExpertBackend

logger = logging.getLogger(__name__)

MIN_THRESHOLD = 128  # never take decode-sized steps off the CPU


class _RefStackedBackend(ExpertBackend):
    name = "stacked_ref"

    def __init__(self, weights: ExpertWeights) -> None:
        self.weights = weights

    def __call__(self, hidden, topk_ids, topk_weights):
        return fused_moe_ref(hidden, self.weights, topk_weights, topk_ids)


def _backend_for(weights: ExpertWeights, fused: bool) -> ExpertBackend:
    if fused:
        from k2serve.moe.fused_moe import FusedMoEBackend

        return FusedMoEBackend(weights)
    return _RefStackedBackend(weights)


def _fields(w: ExpertWeights) -> list[str]:
    return [n for n in ("w13", "w2", "w13_scale", "w2_scale") if getattr(w, n) is not None]


def _pin(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory in place (no copy, no power-of-two rounding)."""
    if t.is_pinned():
        return True
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return int(getattr(err, "value", err)) == 0


def _unpin(ptrs: list[int]) -> None:
    for p in ptrs:
        torch.cuda.cudart().cudaHostUnregister(p)


class LayerwisePrefill:
    def __init__(
        self, backends: list, device: torch.device | str, threshold: int, fused: bool = False
    ) -> None:
        """`backends`: the model's HybridExpertBackends in layer order; `fused`: the streamed
        experts run the fused Triton MoE (else the torch reference over the stacked weights)."""
        from k2serve.moe.cpu_experts import _local_map
        from k2serve.moe.fused_moe import stack_experts

        self.device = torch.device(device)
        self.threshold = int(threshold)
        self.fused = fused
        self.backends = list(backends)
        self.host: list[ExpertWeights] = []
        cuda = self.device.type == "cuda"
        pinned = True
        for i, be in enumerate(self.backends):
            cpu = be.cpu_backend
            w = stack_experts(nn.ModuleList(cpu.experts))  # host tensors; params now views
            be.refresh_cpu_backend()  # it may hold the old tensors' addresses
            if cuda:
                pinned = all([_pin(getattr(w, n)) for n in _fields(w)]) and pinned
            self.host.append(w)
            be.layerwise, be.layerwise_index = self, i
            be.cpu_local_of = _local_map(be.num_experts, cpu.expert_ids, self.device)  # [E]
        if cuda:  # unregister when this object goes (the stacks may outlive it as views)
            ptrs = [getattr(w, n).data_ptr() for w in self.host for n in _fields(w)]
            weakref.finalize(self, _unpin, ptrs)
        if cuda and not pinned:
            logger.warning("layer-wise prefill: host memory could not be page-locked; the "
                           "weight copies will be slower")  # fmt: skip
        big = max(self.host, key=lambda w: w.w13.shape[0])
        self.slots = [
            {n: torch.empty_like(getattr(big, n), device=self.device) for n in _fields(big)}
            for _ in range(2)
        ]
        self.loaded: list[int | None] = [None, None]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        # slot s: its copy is done (`ready`), its last layer's compute is done (`free`); CUDA
        # only (empty on a CPU device, where the copies are synchronous)
        self.ready = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self.free = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self.copies = 0  # layers copied (for tests and logs)

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots[0].values())

    def use_for(self, num_tokens: int) -> bool:
        """Stream for this step? Never inside a CUDA graph capture (decode buckets keep the
        CPU round trip; streams and events of the double buffer are not captured)."""
        if self.threshold <= 0 or num_tokens < self.threshold:
            return False
        return self.stream is None or not torch.cuda.is_current_stream_capturing()

    def invalidate(self) -> None:
        self.loaded = [None, None]

    def _view(self, i: int) -> ExpertWeights:
        h = self.host[i]
        n = h.w13.shape[0]
        slot = self.slots[i % 2]
        s13, s2 = slot.get("w13_scale"), slot.get("w2_scale")
        return ExpertWeights(
            h.quant,
            slot["w13"][:n],
            slot["w2"][:n],
            None if s13 is None else s13[:n],
            None if s2 is None else s2[:n],
            group_size=h.group_size,
        )

    def _load(self, i: int) -> None:
        s, h = i % 2, self.host[i]
        self.copies += 1
        if self.stream is None:
            for f in _fields(h):
                self.slots[s][f][: h.w13.shape[0]].copy_(getattr(h, f))
        else:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.free[s])  # the slot's previous layer is done
                for f in _fields(h):
                    self.slots[s][f][: h.w13.shape[0]].copy_(getattr(h, f), non_blocking=True)
                self.ready[s].record(self.stream)
        self.loaded[s] = i

    def acquire(self, i: int) -> ExpertWeights:
        """Layer i's CPU experts on the device (waits for their copy on the current stream)
        and start the copy of the next hybrid layer into the other slot."""
        if self.loaded[i % 2] != i:
            self._load(i)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[i % 2])
        nxt = (i + 1) % len(self.host)  # after the last layer: the next step's first one
        # NOTE: with an odd number of layers the wrap-around lands in this layer's own slot:
        # no prefetch then (it would overwrite the weights this layer is about to read)
        if nxt % 2 != i % 2 and self.loaded[nxt % 2] != nxt:
            self._load(nxt)
        return self._view(i)

    def release(self, i: int) -> None:
        if self.stream is not None:
            self.free[i % 2].record(torch.cuda.current_stream(self.device))

    def run(self, i: int, hidden, topk_ids, topk_weights, local_of) -> torch.Tensor:
        """Layer i's CPU experts computed on the device: [T, hidden]."""
        w = self.acquire(i)
        local = local_of[topk_ids.long()]  # [T, k], -1 = not a CPU expert
        on = local >= 0
        ids = torch.where(on, local, torch.zeros_like(local))
        wts = torch.where(on, topk_weights, torch.zeros_like(topk_weights))
        out = _backend_for(w, self.fused)(hidden, ids, wts)
        self.release(i)
        return out


def calibrate_threshold(lw: LayerwisePrefill, hidden_size: int, k: int, dtype) -> int:
    """Tokens from which streaming a layer's CPU experts (bytes / measured PCIe rate) is
    faster than the CPU computing them (measured at 32 random tokens, taken as linear in
    tokens: the CPU's per-token cost only falls with more tokens, so the estimate errs towards
    streaming early; MIN_THRESHOLD bounds that)."""
    be = lw.backends[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2):
        lw._load(0)
    torch.cuda.synchronize()
    copy_s = (time.perf_counter() - t0) / 2
    lw.invalidate()
    n = 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, hidden_size, generator=g).to(dtype)
    ids = torch.randint(0, be.num_experts, (n, k), generator=g)
    w = torch.full((n, k), 1.0 / k)
    be.cpu_backend(x[:4], ids[:4], w[:4])  # warm-up (thread pools, first-touch)
    t0 = time.perf_counter()
    be.cpu_backend(x, ids, w)
    cpu_per_token = (time.perf_counter() - t0) / n
    thr = max(MIN_THRESHOLD, math.ceil(copy_s / max(cpu_per_token, 1e-9)))
    rate = lw.slot_bytes / max(copy_s, 1e-9) / 1e9
    logger.info(
        "layer-wise GPU prefill: a layer's CPU experts copy in %.1f ms (%.1f GB/s); the CPU "
        "takes %.2f ms per token: threshold %d tokens", copy_s * 1e3, rate,
        cpu_per_token * 1e3, thr,
    )  # fmt: skip
    return thr


def double_buffer_bytes(model, placement) -> int:
    """Device bytes the layer-wise prefill's two slots take for `placement` (0 without CPU
    experts): for a setup that sizes the KV cache before the backends exist."""
    if placement is None or placement.all_on_gpu:
        return 0
    worst = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        if layer.layer_idx not in placement.gpu_experts or not hasattr(mlp, "experts"):
            continue
        n_cpu = len(placement.cpu_experts(layer.layer_idx))
        one = sum(p.numel() * p.element_size() for p in mlp.experts[0].parameters())
        worst = max(worst, n_cpu * one)
    return 2 * worst


def _cpu_expert_bytes(be) -> int:
    return sum(p.numel() * p.element_size() for e in be.cpu_backend.experts for p in e.parameters())


def setup_layerwise_prefill(
    model, threshold: int | None, max_num_batched_tokens: int | None = None, fused: bool = False
) -> LayerwisePrefill | None:
    """Attach layer-wise GPU prefill to `model`'s hybrid layers (`fused`: the streamed experts
    run the fused Triton MoE, as the engine's backend choice says). threshold None = calibrated
    (CUDA only; CPU devices: off), 0 = off. Off, too, when the two slots do not fit in free
    device memory (a warning says so). Called again on the same layers, it keeps the stacks
    and the slots and only sets the threshold."""
    backends = [getattr(ly.mlp, "expert_backend", None) for ly in model.model.layers]
    layers = [be for be in backends if getattr(be, "name", None) == "hybrid"]
    dev = model.device
    old = getattr(model, "layerwise_prefill", None)
    if old is not None and old.backends == layers:
        if threshold is None and dev.type == "cuda":
            return old  # keeps its calibrated threshold
        old.threshold = threshold or 0
        return old if old.threshold else None
    if old is not None:  # the backends were rebuilt: free the old slots before new ones
        old.threshold = 0
        model.layerwise_prefill = None
        del old
        gc.collect()  # the old backends and their LayerwisePrefill reference each other
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if threshold == 0 or not layers or (threshold is None and dev.type != "cuda"):
        return None
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        need = 2 * max(_cpu_expert_bytes(be) for be in layers)
        if need > free - (1 << 30):
            logger.warning(
                "layer-wise GPU prefill off: its two slots need %.1f GiB, %.1f GiB is free "
                "(lower --gpu-memory-utilization to leave room)", need / 2**30, free / 2**30,
            )  # fmt: skip
            return None
    lw = LayerwisePrefill(layers, dev, threshold or 1, fused)
    if threshold is None:
        c = model.config
        lw.threshold = calibrate_threshold(lw, c.hidden_size, c.num_experts_per_tok, model.dtype)
    model.layerwise_prefill = lw
    budget = max_num_batched_tokens
    if budget is not None and budget < 4 * lw.threshold:
        logger.warning(
            "layer-wise GPU prefill from %d tokens, but a step holds at most %d "
            "(--max-num-batched-tokens): every prefill chunk streams each layer's CPU experts "
            "once, so a long prompt pays that per chunk; a budget of 16K-32K tokens makes a "
            "30K-token prompt one or two transfers", lw.threshold, budget,
        )  # fmt: skip
    return lw


__all__ = [
    "LayerwisePrefill",
    "calibrate_threshold",
    "double_buffer_bytes",
    "setup_layerwise_prefill",
]
