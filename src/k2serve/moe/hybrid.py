"""The GPU + CPU split of one MoE layer: `HybridExpertBackend` routes each (token, expert)
pair to the GPU backend or the CPU backend (moe.cpu_experts.CpuExpertBackend) by placement and
sums the two outputs; `pieces` is its overlapped, graph-friendly form.

Invariants:
- A pair whose expert is not on a backend contributes nothing there: the CPU backend skips
  it; the GPU backend gets it as local expert 0 with weight 0 (so its kernels keep a fixed
  [T, k] shape and no host sync: CUDA-graph safe), which adds exactly 0.
- Overlap (`HybridExpertBackend.pieces`, moe.host_round_trip.HostJob): the layer's tokens,
  ids and weights are copied to the host BEFORE the GPU part (GPU experts + shared expert) is
  enqueued; the CPU computes while the GPU part runs; the CPU result is then copied back and
  added. The host actions are yielded between GPU pieces, so the runner can replay those
  pieces as CUDA graphs (k2serve.model.cuda_graph); with `device_wait` the GPU waits for the
  CPU's result on a flag inside the graph instead of between two pieces (host_round_trip
  says both ways).
- Zero-copy (`reserve(..., zero_copy)`, K2SERVE_HYBRID_ZERO_COPY, on by default where the
  probe passes): the staging is one kernel storing the tokens, ids and weights into the
  pinned buffers through their host-mapped addresses, and the result one kernel reading `out`
  there fused with the add (kernels.zero_copy), instead of three D2H memcpys, an H2D memcpy
  and an add; the same bits. Only for the reserved buffers (the graphs' static ones).
- Fused waits (`graph_handshake`, set by a one-graph runner while it captures; K2SERVE_HYBRID_
  FUSED_WAIT): the staging kernel writes the layer's ready word itself and, with spinning
  waits, the result kernel spins on the host's flag itself (kernels.zero_copy, "Fused
  waits"); a layer whose staging is not zero-copy keeps the separate nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k2serve import envs
from k2serve.kernels.stream_wait import host_mapped
from k2serve.kernels.zero_copy import can_stage, stage_to_host, zero_copy_supported
from k2serve.moe.base import ExpertBackend
from k2serve.moe.cpu_experts import CpuExpertBackend, _local_map
from k2serve.moe.host_round_trip import HostJob, drive


def use_zero_copy(device: torch.device, zero_copy: bool | None = None) -> bool:
    """Whether a hybrid layer on `device` stages zero-copy (kernels.zero_copy): asked for
    (`zero_copy`, None: K2SERVE_HYBRID_ZERO_COPY, on by default) and the device's probe
    passed; never on a CPU device (no staging there)."""
    if device.type != "cuda" or not (envs.hybrid_zero_copy() if zero_copy is None else zero_copy):
        return False
    return zero_copy_supported(
        torch.cuda.current_device() if device.index is None else device.index
    )


class HybridExpertBackend(ExpertBackend):
    """One MoE layer split between a GPU backend (local ids) and a `CpuExpertBackend`."""

    name = "hybrid"

    def __init__(
        self,
        gpu_backend: ExpertBackend | None,  # None when no expert of the layer is on the GPU
        gpu_expert_ids: Sequence[int],  # global ids of the GPU backend's experts, local order
        cpu_backend: CpuExpertBackend,
        num_experts: int,
        device: torch.device | str,
    ) -> None:
        if set(gpu_expert_ids) & set(cpu_backend.expert_ids):
            raise ValueError("an expert is placed both on the GPU and on the CPU")
        if len(gpu_expert_ids) + len(cpu_backend.expert_ids) != num_experts:
            raise ValueError("GPU + CPU experts do not cover every routed expert of the layer")
        if (gpu_backend is None) != (len(gpu_expert_ids) == 0):
            raise ValueError("gpu_backend must be given exactly when some experts are on the GPU")
        self.gpu_backend = gpu_backend
        self.cpu_backend = cpu_backend
        self.num_experts = num_experts
        self.device = torch.device(device)
        self.gpu_expert_ids = tuple(gpu_expert_ids)
        self.gpu_local_of = _local_map(num_experts, self.gpu_expert_ids, device)  # [E]
        self._buffers: dict | None = None  # static pinned staging buffers (reserve())
        self._mapped: dict | None = None  # their host-mapped CUDA views (zero-copy) or None
        # True during a graph runner's warm-up: the host actions skip the CPU experts (the
        # warm-up compiles GPU kernels and sizes the allocator; its outputs are dropped)
        self.dry_run = False
        # device wait (moe.host_round_trip): True while a graph runner captures with `signal`
        # (a host -> GPU flag, kernels.stream_wait); `deferred`: this step's launched jobs
        self.device_wait = False
        self.signal = None
        self.deferred: list[HostJob] = []
        self.trace: list | None = None  # benchmarks: the jobs' timeline marks (HostJob._mark)
        self.ready_word = None  # GPU -> host "inputs staged" word instead of an event (HostJob)
        # one-graph device wait (HostJob.complete_in_graph), while a runner captures: the
        # jobs go to `graph_jobs`, the graph writes `graph_word` after the staging copies
        self.graph_jobs: list | None = None
        self.graph_word = None
        self.graph_handshake = None  # its kernels.zero_copy.Handshake when the waits are fused
        # layer-wise GPU prefill (moe.layerwise): long steps run the CPU experts on the device
        self.layerwise = None
        self.layerwise_index = -1
        self.cpu_local_of: torch.Tensor | None = None  # [E] on the device, set with layerwise

    def refresh_cpu_backend(self) -> None:
        """A new CpuExpertBackend over the same expert modules and ids: after their tensors were
        re-pointed (layer-wise prefill stacks them) or experts moved (dynamic re-placement), as
        a CPU backend may hold the tensors' addresses and its own copy of the id map."""
        c = self.cpu_backend
        self.cpu_backend = type(c)(c.experts, c.expert_ids, c.num_experts, c.compute_dtype)

    def reserve(self, max_tokens: int, hidden_size: int, k: int, dtype: torch.dtype,
                zero_copy: bool | None = None) -> None:  # fmt: skip
        """Allocate static pinned host buffers for steps of up to `max_tokens` tokens (before
        capturing CUDA graphs: captured copies read and write these addresses), and choose
        how the steps from here on move data through them: zero-copy kernels when `zero_copy`
        (None: K2SERVE_HYBRID_ZERO_COPY) and the device passes the probe, else memcpys. No-op
        on a CPU device, where the CPU part reads the layer's tensors directly."""
        if self.device.type != "cuda":
            return
        b = self._buffers
        if b is None or b["x"].shape[0] < max_tokens or b["x"].dtype != dtype:
            self._buffers = b = dict(
                x=torch.empty(max_tokens, hidden_size, dtype=dtype, pin_memory=True),
                ids=torch.empty(max_tokens, k, dtype=torch.long, pin_memory=True),
                w=torch.empty(max_tokens, k, dtype=torch.float32, pin_memory=True),
                out=torch.empty(max_tokens, hidden_size, dtype=dtype, pin_memory=True),
            )
        use = use_zero_copy(self.device, zero_copy)
        self._mapped = {n: host_mapped(t) for n, t in b.items()} if use else None

    @property
    def zero_copy(self) -> bool:
        """True when steps stage and read back through host-mapped memory (see reserve)."""
        return self._mapped is not None

    def stage(self, hidden, topk_ids, topk_weights, handshake=None) -> HostJob:
        """Start the CPU part's input copies (see HostJob; zero-copy: one kernel, see
        reserve); no host sync. `handshake` (kernels.zero_copy.Handshake): the staging kernel
        also writes its word (the job's `handshake` says whether it did: zero-copy only); in
        a runner's warm-up (`dry_run`) the fused kernels are launched once eagerly instead
        (Handshake.warm_up: compiled before the capture) and the job is an unfused one."""
        if self.device.type != "cuda" or not hidden.is_cuda:
            out = torch.empty_like(hidden)  # written by finish(): a static output for graphs
            return HostJob(self, hidden, topk_ids, topk_weights, out, cuda=False)
        T, D = hidden.shape
        k = topk_ids.shape[1]
        b = self._buffers
        if b is not None and T <= b["x"].shape[0] and b["x"].dtype == hidden.dtype:
            x, ids, w, out = b["x"][:T], b["ids"][:T, :k], b["w"][:T, :k], b["out"][:T]
            m = self._mapped
            if m is not None:
                mx, mids, mw = m["x"][:T], m["ids"][:T, :k], m["w"][:T, :k]
                if can_stage(hidden, topk_ids, topk_weights, mx, mids, mw):
                    hs = handshake if T else None
                    if hs is not None and self.dry_run:  # a runner's warm-up: compile them
                        hs.warm_up(hidden, topk_ids, topk_weights, mx, mids, mw, m["out"][:T])
                        hs = None
                    stage_to_host(hidden, topk_ids, topk_weights, mx, mids, mw, handshake=hs)
                    return HostJob(self, x, ids, w, out, cuda=True, out_mapped=m["out"][:T],
                                   handshake=hs)  # fmt: skip
        else:  # outside the reserved size (long prefills, eager): fresh pinned buffers
            x = torch.empty(T, D, dtype=hidden.dtype, pin_memory=True)
            ids = torch.empty(T, k, dtype=torch.long, pin_memory=True)
            w = torch.empty(T, k, dtype=torch.float32, pin_memory=True)
            out = torch.empty(T, D, dtype=hidden.dtype, pin_memory=True)
        x.copy_(hidden, non_blocking=True)
        ids.copy_(topk_ids, non_blocking=True)
        w.copy_(topk_weights, non_blocking=True)
        return HostJob(self, x, ids, w, out, cuda=True)

    def gpu_part(self, hidden, topk_ids, topk_weights) -> torch.Tensor:  # [T, hidden]
        """The GPU experts' weighted sum (pairs on CPU experts get weight 0); no host sync."""
        if self.gpu_backend is None:
            return torch.zeros_like(hidden)
        local = self.gpu_local_of[topk_ids.long()]  # [T, k], -1 = on the CPU
        on_gpu = local >= 0
        ids = torch.where(on_gpu, local, torch.zeros_like(local))
        w = torch.where(on_gpu, topk_weights, torch.zeros_like(topk_weights))
        return self.gpu_backend(hidden, ids, w)

    def pieces(self, hidden, topk_ids, topk_weights, gpu=None):
        """Generator: the layer's routed output with the host actions yielded (see HostJob).
        `gpu(hidden)` computes the GPU part (default `gpu_part`; the MoE block adds the shared
        expert there, so it runs while the CPU works). Steps of at least the layer-wise
        threshold stream the CPU experts to the device instead (moe.layerwise; no yield)."""
        lw = self.layerwise
        if lw is not None and lw.use_for(hidden.shape[0]):
            out = self.gpu_part(hidden, topk_ids, topk_weights) if gpu is None else gpu(hidden)
            streamed = lw.run(self.layerwise_index, hidden, topk_ids, topk_weights,
                              self.cpu_local_of)  # fmt: skip
            return out + streamed.to(out.dtype)
        one_graph = self.device_wait and self.graph_jobs is not None
        hs = self.graph_handshake if one_graph or self.dry_run else None  # (see stage)
        job = self.stage(hidden, topk_ids, topk_weights, hs)
        gpu = gpu or (lambda y: self.gpu_part(y, topk_ids, topk_weights))
        if one_graph:  # one graph: no host action
            job.graph_word = self.graph_word
            if job.handshake is None:  # (fused: the staging kernel wrote it)
                job.graph_word.gpu_set()  # after the staging copies
            self.graph_jobs.append(job)
            out = gpu(hidden)
            if not job.waits_in_kernel:  # (fused: the result kernel spins on the flag)
                job.signal.gpu_wait()
            return job.add_result(out)
        if self.device_wait:  # the GPU waits for the CPU's `out` on the signal, in the piece
            yield job.launch
            out = gpu(hidden)
            job.signal.gpu_wait()
            return job.add_result(out)
        yield job.start
        out = gpu(hidden)
        yield job.finish
        return job.add_result(out)

    def complete_deferred(self) -> None:
        """The CPU part of this step's launched jobs (device wait; see HostJob.complete)."""
        while self.deferred:
            self.deferred.pop(0).complete()

    def __call__(self, hidden, topk_ids, topk_weights) -> torch.Tensor:  # [T, hidden]
        return drive(self.pieces(hidden, topk_ids, topk_weights))


__all__ = ["CpuExpertBackend", "HostJob", "HybridExpertBackend", "drive", "use_zero_copy"]
