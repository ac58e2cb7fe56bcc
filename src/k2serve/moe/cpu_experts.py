"""Experts held in host memory and computed on the CPU, and the GPU + CPU split of one layer.

Owns: `CpuExpertBackend` (a subset of a layer's routed experts, weights in host memory, computed
with torch ops on the CPU's intra-op threads) and `HybridExpertBackend` (routes each (token,
expert) pair to the GPU backend or the CPU backend by placement and sums the two outputs).

Invariants:
- Expert ids in `topk_ids` are the layer's global ids; each backend maps them to its own local
  ids. A pair whose expert is not on a backend contributes nothing there: the CPU backend skips
  it; the GPU backend gets it as local expert 0 with weight 0 (so its kernels keep a fixed
  [T, k] shape and no host sync: CUDA-graph safe), which adds exactly 0.
- CPU experts keep their stored format (INT4 stays packed); each call dequantizes the experts it
  hits, one at a time, in `compute_dtype` (float32 by default: CPUs without AMX run float32
  GEMMs faster than bf16, and it is the more exact choice).
- Overlap (`HybridExpertBackend.pieces`, `HostJob`): the layer's tokens, ids and weights are
  copied to the host BEFORE the GPU part (GPU experts + shared expert) is enqueued; the CPU
  computes while the GPU part runs; the CPU result is then copied back and added. The host
  actions are yielded between GPU pieces, so the runner can replay those pieces as CUDA
  graphs and run only the host round trip eagerly (k2serve.model.cuda_graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from k2serve.moe.base import ExpertBackend


def _local_map(num_experts: int, ids: Sequence[int], device) -> torch.Tensor:
    """[num_experts] int64: global id -> local id, -1 where the expert is elsewhere."""
    m = torch.full((num_experts,), -1, dtype=torch.long)
    m[torch.as_tensor(list(ids), dtype=torch.long)] = torch.arange(len(ids))
    return m.to(device)


class CpuExpertBackend(ExpertBackend):
    name = "cpu"

    def __init__(
        self,
        experts: Sequence[nn.Module],  # the experts in `expert_ids` order, weights on the CPU
        expert_ids: Sequence[int],  # their global ids
        num_experts: int,  # routed experts in the layer
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        if len(experts) != len(expert_ids):
            raise ValueError(f"{len(experts)} experts but {len(expert_ids)} expert ids")
        self.experts = list(experts)
        self.expert_ids = tuple(int(e) for e in expert_ids)
        self.num_experts = num_experts
        self.compute_dtype = compute_dtype
        self.local_of = _local_map(num_experts, self.expert_ids, "cpu")  # [E] on the CPU

    def to_host(self, hidden, topk_ids, topk_weights):
        """Copy what the CPU needs to host memory (waits for the router, not the GPU experts
        enqueued after this call)."""
        ids = topk_ids.to("cpu", torch.long)  # [T, k]
        local = self.local_of[ids]  # [T, k], -1 = not a CPU expert
        rows = (local >= 0).any(dim=1).nonzero()[:, 0]  # tokens with at least one CPU expert
        if rows.numel() == 0:
            return None
        rows_dev = rows.to(hidden.device)
        x = hidden.index_select(0, rows_dev).to("cpu", self.compute_dtype)  # [n, hidden]
        w = topk_weights.index_select(0, rows_dev).to("cpu", torch.float32)  # [n, k]
        return rows, x, local[rows], w

    def compute(self, host, like: torch.Tensor) -> torch.Tensor | None:
        """The CPU experts' weighted sum for the tokens in `host`, scattered into [T, hidden]
        zeros on `like`'s device and dtype; None when no token routes to a CPU expert."""
        if host is None:
            return None
        rows, x, local, w = host
        n, k = local.shape
        out = torch.zeros(n, x.shape[1], dtype=torch.float32)  # [n, hidden]
        flat = local.reshape(-1)  # [n * k]
        for le in flat[flat >= 0].unique().tolist():
            sel = (flat == le).nonzero()[:, 0]  # pair indices routed to this expert
            tok = sel // k
            expert = self.experts[le]
            xe = x[tok]  # [m, hidden]
            h = F.silu(expert.gate_proj(xe)) * expert.up_proj(xe)  # [m, inter]
            y = expert.down_proj(h).to(torch.float32) * w.reshape(-1)[sel, None]  # [m, hidden]
            out.index_add_(0, tok, y)
        full = torch.zeros(like.shape[0], like.shape[1], dtype=like.dtype, device=like.device)
        full.index_copy_(0, rows.to(like.device), out.to(like.device, like.dtype))
        return full

    def __call__(self, hidden, topk_ids, topk_weights) -> torch.Tensor:  # [T, hidden]
        out = self.compute(self.to_host(hidden, topk_ids, topk_weights), hidden)
        return out if out is not None else torch.zeros_like(hidden)

    # ---- asynchronous use (KT-Kernel's submit_forward / sync_forward) --------------------
    def submit(self, hidden, topk_ids, topk_weights) -> None:
        """Start this backend's part for host tensors `hidden [T, hidden]`, `topk_ids [T, k]`,
        `topk_weights [T, k]` on a worker thread (torch ops release the GIL) and return at
        once; `wait()` returns the result. One job in flight at a time."""
        if getattr(self, "_job", None) is not None:
            raise RuntimeError("CpuExpertBackend.submit: the previous job was not waited for")
        pool = getattr(self, "_pool", None)
        if pool is None:  # one persistent worker: no thread start per call
            pool = self._pool = ThreadPoolExecutor(1, thread_name_prefix="k2serve-cpu-experts")
        self._job = pool.submit(self, hidden, topk_ids, topk_weights)

    def __getstate__(self) -> dict:  # copies (deepcopy of a model) get their own worker
        state = dict(self.__dict__)
        state.pop("_pool", None)
        state.pop("_job", None)
        return state

    def wait(self) -> torch.Tensor:  # [T, hidden] on the CPU, dtype of the submitted hidden
        """The result of the job `submit` started (blocks until it is done; re-raises what
        the job raised)."""
        job, self._job = getattr(self, "_job", None), None
        if job is None:
            raise RuntimeError("CpuExpertBackend.wait: nothing was submitted")
        return job.result()


class HostJob:
    """One step's CPU part of one hybrid layer (KT-Kernel's submit_forward / sync_forward).

    The model runs: `job = backend.stage(...)` (GPU: the layer's tokens, ids and weights copied
    to pinned host buffers, non_blocking), host action `job.start`, the GPU part (GPU experts +
    shared expert), host action `job.finish`, then `job.result()` (GPU: the CPU output copied
    back, non_blocking). Between the GPU pieces the driver runs the host actions eagerly, so the
    GPU pieces can be CUDA graphs (k2serve.model.cuda_graph): with static buffers a job is
    re-run by calling `start` / `finish` again after the captured pieces are replayed.
    On a CUDA device `start` records an event and `finish` waits for it, runs the CPU experts
    (submit + wait) while the already-launched GPU part runs, and writes the pinned output
    buffer; on a CPU device `start` submits (the worker thread overlaps the main thread's
    experts) and `finish` waits."""

    def __init__(self, backend, x, ids, w, out, cuda: bool) -> None:
        self.backend = backend
        self.x, self.ids, self.w, self.out = x, ids, w, out  # host tensors ([T, ...])
        self.cuda = cuda
        self.event = torch.cuda.Event() if cuda else None

    def start(self) -> None:
        if self.backend.dry_run:
            return
        if self.event is not None:
            self.event.record()
        else:
            self.backend.cpu_backend.submit(self.x, self.ids, self.w)

    def finish(self) -> None:
        if self.backend.dry_run:  # a warm-up pass: the CPU part contributes zeros
            self.out.zero_()
            return
        cpu = self.backend.cpu_backend
        if self.event is not None:
            self.event.synchronize()  # the staged inputs are in host memory
            cpu.submit(self.x, self.ids, self.w)
        self.out.copy_(cpu.wait())

    def result(self, like: torch.Tensor) -> torch.Tensor:  # [T, hidden] on like's device
        return self.out.to(like.device, like.dtype, non_blocking=True)


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
        # True during a graph runner's warm-up: the host actions skip the CPU experts (the
        # warm-up compiles GPU kernels and sizes the allocator; its outputs are dropped)
        self.dry_run = False
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

    def reserve(self, max_tokens: int, hidden_size: int, k: int, dtype: torch.dtype) -> None:
        """Allocate static pinned host buffers for steps of up to `max_tokens` tokens (before
        capturing CUDA graphs: captured copies read and write these addresses). No-op on a
        CPU device, where the CPU part reads the layer's tensors directly."""
        if self.device.type != "cuda":
            return
        b = self._buffers
        if b is not None and b["x"].shape[0] >= max_tokens and b["x"].dtype == dtype:
            return
        self._buffers = dict(
            x=torch.empty(max_tokens, hidden_size, dtype=dtype, pin_memory=True),
            ids=torch.empty(max_tokens, k, dtype=torch.long, pin_memory=True),
            w=torch.empty(max_tokens, k, dtype=torch.float32, pin_memory=True),
            out=torch.empty(max_tokens, hidden_size, dtype=dtype, pin_memory=True),
        )

    def stage(self, hidden, topk_ids, topk_weights) -> HostJob:
        """Start the CPU part's input copies (see HostJob); no host sync."""
        if self.device.type != "cuda" or not hidden.is_cuda:
            out = torch.empty_like(hidden)  # written by finish(): a static output for graphs
            return HostJob(self, hidden, topk_ids, topk_weights, out, cuda=False)
        T, D = hidden.shape
        k = topk_ids.shape[1]
        b = self._buffers
        if b is not None and T <= b["x"].shape[0] and b["x"].dtype == hidden.dtype:
            x, ids, w, out = b["x"][:T], b["ids"][:T, :k], b["w"][:T, :k], b["out"][:T]
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
        job = self.stage(hidden, topk_ids, topk_weights)
        yield job.start
        if gpu is None:
            out = self.gpu_part(hidden, topk_ids, topk_weights)
        else:
            out = gpu(hidden)
        yield job.finish
        return out + job.result(out)

    def __call__(self, hidden, topk_ids, topk_weights) -> torch.Tensor:  # [T, hidden]
        return drive(self.pieces(hidden, topk_ids, topk_weights))


def drive(gen):
    """Run a pieces generator eagerly: each yielded host action is called where it was
    yielded; returns the generator's return value."""
    try:
        while True:
            next(gen)()
    except StopIteration as stop:
        return stop.value


__all__ = ["CpuExpertBackend", "HostJob", "HybridExpertBackend", "drive"]
