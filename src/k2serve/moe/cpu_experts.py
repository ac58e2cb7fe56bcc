"""Experts held in host memory and computed on the CPU.

Owns: `CpuExpertBackend` (a subset of a layer's routed experts, weights in host memory). The
GPU + CPU split of a layer that drives it is moe.hybrid.HybridExpertBackend.

CpuExpertBackend interface (what the hybrid / overlap code drives):
- `submit(hidden, topk_ids, topk_weights)`: copies what the CPU needs to host memory (this
  waits for the router's outputs on the GPU stream, nothing enqueued after them) and starts the
  CPU experts on a worker thread; returns at once. The native kernel runs with the GIL released.
- `wait() -> [T, hidden]`: the CPU experts' weighted sum, in `hidden`'s dtype and on its device
  (zeros for tokens with no CPU expert). Raises ValueError for an expert id outside [0, E).
- `__call__` = submit + wait, run on the calling thread (no hand-off to the worker thread when
  nothing overlaps). One submit in flight per backend.

Implementations (`impl`):
- "native": kernels/cpu (C++ built on first use): every CPU expert of the layer in one call,
  reading the weights in their checkpoint format (INT4 pack-quantized, FP8 128x128 blocks, bf16;
  float32 for bf16-format experts of a float32 model): no per-expert Python, no dequantized copy,
  activations as given (bf16 or float32), float32 accumulation. Threads from one shared pool
  (K2SERVE_CPU_THREADS), grouped by NUMA node (see kernels.cpu.numa_topology). Prompt-sized
  steps with bf16 activations (at least AMX_MIN_PAIRS pairs per active expert) run the expert
  GEMMs on AMX tiles where the CPU has them (`amx`, K2SERVE_CPU_AMX; kernels/cpu/k2amx.h): each
  weight dequantized once per step to bf16 in L2, activations rounded to bf16 as they are.
- "torch": the fallback when the kernel cannot be built (no compiler), or the shapes are not
  multiples of 32: a loop over the hit experts, each dequantized per call in `compute_dtype`.

Invariants:
- Expert ids in `topk_ids` are the layer's global ids; each backend maps them to its own local
  ids. A pair whose expert is not on a backend contributes nothing there: the CPU backend skips
  it; the GPU backend gets it as local expert 0 with weight 0 (so its kernels keep a fixed
  [T, k] shape and no host sync: CUDA-graph safe), which adds exactly 0.
- The experts' parameters are used in place (the kernel reads the module's tensors; nothing is
  repacked or copied, so memory is not doubled and the modules stay valid for the reference
  path and the state_dict). Replacing a parameter afterwards needs a new backend.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k2serve.kernels import cpu as ck
from k2serve.moe.base import ExpertBackend

logger = logging.getLogger(__name__)


def _local_map(num_experts: int, ids: Sequence[int], device) -> torch.Tensor:
    """[num_experts] int64: global id -> local id, -1 where the expert is elsewhere."""
    m = torch.full((num_experts,), -1, dtype=torch.long)
    m[torch.as_tensor(list(ids), dtype=torch.long)] = torch.arange(len(ids))
    return m.to(device)


@functools.lru_cache(maxsize=1)
def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that runs CPU expert calls (they are serialized by the kernel's pool)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="k2-cpu-moe")


def _expert_format(lin) -> int | None:
    """The kernel's format code for one expert linear, or None when the kernel cannot read it."""
    scheme = getattr(lin, "scheme", None)
    if lin.in_features % 32 or lin.out_features % 32:
        return None
    if scheme == "int4_group":
        ok = lin.group_size == 32 and lin.weight_scale.dtype == torch.bfloat16
        return ck.FMT_INT4 if ok else None
    if scheme == "fp8_block":
        ok = tuple(lin.block) == (128, 128) and lin.weight_scale_inv.dtype == torch.float32
        return ck.FMT_FP8 if ok else None
    if scheme == "bf16":
        return {torch.bfloat16: ck.FMT_BF16, torch.float32: ck.FMT_F32}.get(lin.weight.dtype)
    return None


def _tensors(lin, fmt: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fmt == ck.FMT_INT4:
        return lin.weight_packed, lin.weight_scale
    if fmt == ck.FMT_FP8:
        return lin.weight, lin.weight_scale_inv
    return lin.weight, None


# The AMX path (k2amx.h) runs a step when its (token, expert) pairs per active expert reach this:
# below it the decode path's dot products, which read each weight once per 8 pairs, are faster
# (K2 layer, 384 experts, lent Xeon: 128 tokens = 2.7 pairs: dot 217 ms, AMX 284 ms; 256
# tokens = 5.3 pairs: dot 330 ms, AMX 300 ms)
AMX_MIN_PAIRS = 4.0
# ... and from this many tokens: decode steps stay on the decode path whatever their pairs, so a
# step padded to a CUDA-graph bucket rounds as the same step run eagerly (graphs == eager)
AMX_MIN_TOKENS = 128
# Longer steps go to the kernel in chunks of this many tokens: its per-call scratch grows with
# the step (AMX path: ~160 KB per token, the gathered activations and h in tile layout), and a
# chunk this long costs one more read of the weights (~0.1 s per K2 layer) against seconds of
# products
NATIVE_CHUNK_TOKENS = 4096
# How long the kernel's threads keep spinning after a prewake (a hybrid step's CPU part starts
# once the GPU reached the routing: usually well within this; later, they sleep again)
PREWAKE_USEC = 3000


class _Done:
    """An inline submit's outcome, read by wait() as a Future's (a Future builds a condition
    variable: microseconds per MoE layer for nothing to wait on)."""

    __slots__ = ("value", "error")

    def __init__(self, value, error: BaseException | None) -> None:
        self.value, self.error = value, error

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


class CpuExpertBackend(ExpertBackend):
    name = "cpu"

    def __init__(
        self,
        experts: Sequence[nn.Module],  # the experts in `expert_ids` order, weights on the CPU
        expert_ids: Sequence[int],  # their global ids
        num_experts: int,  # routed experts in the layer
        compute_dtype: torch.dtype | None = None,  # torch path only; None: float32
        *,
        kernel: str | None = None,  # "auto" / "native" / "torch"; None: K2SERVE_CPU_KERNEL
        threads: int | None = None,  # None: K2SERVE_CPU_THREADS, else torch.get_num_threads()
        numa_topology: str | None = None,  # injected cpulists "0-7;8-15"; None: env, then /sys
        amx: bool | None = None,  # AMX tiles for prompt-sized steps; None: K2SERVE_CPU_AMX
        amx_min_pairs: float | None = None,  # ... from this many pairs per expert; None: default
        amx_min_tokens: int | None = None,  # ... and this many tokens; None: AMX_MIN_TOKENS
    ) -> None:
        if len(experts) != len(expert_ids):
            raise ValueError(f"{len(experts)} experts but {len(expert_ids)} expert ids")
        self._init_args = (
            compute_dtype,
            kernel,
            threads,
            numa_topology,
            amx,
            amx_min_pairs,
            amx_min_tokens,
        )
        self.experts = list(experts)
        self.expert_ids = tuple(int(e) for e in expert_ids)
        self.num_experts = num_experts
        self.compute_dtype = compute_dtype or torch.float32
        self.local_of = _local_map(num_experts, self.expert_ids, "cpu")  # [E] int64
        self._local_of32 = self.local_of.to(torch.int32).contiguous()
        self._pending: tuple | None = None
        self._layer = None
        self.impl = "torch"
        self.amx = False  # True: prompt-sized steps run on AMX tiles (native kernel)
        settings = ck.kernel_settings()
        mode = kernel or settings.mode
        if mode not in ck.KERNEL_MODES:
            raise ValueError(f"kernel={mode!r}; expected one of {ck.KERNEL_MODES}")
        if self.experts:
            lib = ck.load_kernel(mode)
            if lib is not None:
                self._init_native(lib, threads or settings.threads,
                                  numa_topology or settings.numa_topology, mode)  # fmt: skip
            if self._layer is not None:
                on = settings.amx if amx is None else amx
                m = AMX_MIN_PAIRS if amx_min_pairs is None else amx_min_pairs
                t = AMX_MIN_TOKENS if amx_min_tokens is None else amx_min_tokens
                self.amx = bool(lib.k2_layer_set_tiles(self._layer, int(on), float(m), t))

    # ------------------------------------------------------------------ native kernel set-up
    def _init_native(self, lib, threads, topology, mode) -> None:
        lins = [(ex.gate_proj, ex.up_proj, ex.down_proj) for ex in self.experts]
        fmts = {_expert_format(lin) for trio in lins for lin in trio}
        if len(fmts) != 1 or None in fmts:
            msg = "expert weights the native CPU kernel does not read (format or shape)"
            if mode == "native":
                raise ValueError(msg)
            logger.warning("%s; CPU experts use the torch path", msg)
            return
        fmt = fmts.pop()
        H, inter = lins[0][0].in_features, lins[0][0].out_features
        keep: list[torch.Tensor] = []
        ptrs: list[int] = []
        for gate, up, down in lins:
            if (gate.in_features, gate.out_features, down.in_features) != (H, inter, inter):
                raise ValueError("CPU experts of one layer must share their shapes")
            for lin in (gate, up, down):
                for t in _tensors(lin, fmt):
                    if t is None:
                        ptrs.append(0)
                        continue
                    if t.device.type != "cpu":
                        raise ValueError(f"CPU expert weight on {t.device}; expected host memory")
                    t = t.detach().contiguous()  # no copy for the loader's tensors
                    keep.append(t)
                    ptrs.append(t.data_ptr())
        nodes = ck.numa_topology(topology)
        n_threads = threads or torch.get_num_threads()
        self._pool_key = (lib, tuple(tuple(n) for n in nodes), n_threads)
        pool = ck.shared_pool(*self._pool_key, os.getpid())
        arr = (ctypes.c_int64 * len(ptrs))(*ptrs)
        layer = lib.k2_layer_create(fmt, len(self.experts), H, inter, arr)
        if pool.num_nodes > 1 and topology is None:  # a real topology: move rows to their node
            node_ids = ck.numa_node_ids()
            if len(node_ids) == pool.num_nodes:
                ids = (ctypes.c_int * len(node_ids))(*node_ids)
                refused = lib.k2_layer_bind(layer, pool._ptr, ids)
                if refused:
                    logger.warning("NUMA: %d weight ranges stay off their node", refused)
        self._lib, self._pool, self._keep, self._fmt = lib, pool, keep, fmt
        self._layer = layer
        self.hidden_size, self.intermediate_size = H, inter
        self.impl = "native"

    # copy.deepcopy / pickle: the kernel's handles are per process, so a copy is rebuilt from its
    # experts (the copies of the modules, with their own tensors)
    def __getstate__(self) -> dict:
        if self._pending is not None:
            raise RuntimeError("CpuExpertBackend: cannot copy with a submit in flight")
        return {"experts": self.experts, "expert_ids": self.expert_ids,
                "num_experts": self.num_experts, "init_args": self._init_args}  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        compute_dtype, kernel, threads, topology, amx, amx_min, amx_tokens = state["init_args"]
        CpuExpertBackend.__init__(self, state["experts"], state["expert_ids"],
                                  state["num_experts"], compute_dtype, kernel=kernel,
                                  threads=threads, numa_topology=topology, amx=amx,
                                  amx_min_pairs=amx_min, amx_min_tokens=amx_tokens)  # fmt: skip

    def __del__(self) -> None:
        layer, self._layer = getattr(self, "_layer", None), None
        if layer:
            self._lib.k2_layer_destroy(layer)

    # ------------------------------------------------------------------ interface
    def submit(self, hidden, topk_ids, topk_weights, *, inline: bool = False, out=None) -> None:
        """Start the CPU experts for this step (see the module docstring); `inline`: compute
        now on this thread (what `__call__` does), so wait() only returns the result. `out`:
        a host tensor [T, hidden] for the result, which wait() then returns (when it has
        hidden's dtype and device, else converted as any result); the native kernel writes
        it directly when it is contiguous bf16 / float32, so no conversion or copy runs after
        the kernel on torch's OpenMP threads, whose spinning afterwards would take the cores
        from the next layer's kernel call."""
        if self._pending is not None:
            raise RuntimeError("CpuExpertBackend.submit: the previous submit was not waited on")
        T = hidden.shape[0]
        ids = topk_ids.to("cpu", torch.int64).contiguous()  # [T, k]
        w = topk_weights.to("cpu", torch.float32).contiguous()  # [T, k]
        x = hidden.to("cpu")
        if self.impl == "native" and x.dtype not in (torch.bfloat16, torch.float32):
            x = x.to(torch.float32)
        x = x.contiguous()  # [T, hidden]
        like = (hidden.dtype, hidden.device, T, hidden.shape[1])
        if T == 0 or not self.experts:
            self._pending = (None, like)
            return
        native = self.impl == "native" and not (inline and ck.dispatch_mode_active())
        run = self._run_native if native else self._run_torch  # a recording mode sees torch ops
        if inline:
            try:
                done = _Done(run(x, ids, w, out), None)
            except Exception as e:  # re-raised by wait(), as from the worker thread
                done = _Done(None, e)
            self._pending = (done, like)
            return
        self._pending = (_executor().submit(run, x, ids, w, out), like)

    def wait(self) -> torch.Tensor:  # [T, hidden]
        """The result of the last submit (see the module docstring): submit's `out` when it
        was given, else a new tensor."""
        if self._pending is None:
            raise RuntimeError("CpuExpertBackend.wait: nothing was submitted")
        fut, (dtype, device, T, H) = self._pending
        self._pending = None
        if fut is None:
            return torch.zeros(T, H, dtype=dtype, device=device)
        out = fut.result()  # [T, hidden] on the CPU; re-raises the worker's error
        return out.to(device=device, dtype=dtype, non_blocking=False)  # no-op when they match

    def __call__(self, hidden, topk_ids, topk_weights) -> torch.Tensor:  # [T, hidden]
        self.submit(hidden, topk_ids, topk_weights, inline=True)
        return self.wait()

    def prewake(self, usec: int = PREWAKE_USEC) -> None:
        """A step comes soon (its routing is known, its inputs are on their way to the host):
        wake the kernel's sleeping threads and keep them spinning for `usec`, so the step
        starts on running threads (no-op on the torch path)."""
        if self.impl == "native":
            self._lib.k2_pool_prewake(self._pool._ptr, usec)

    # the previous two-step interface, kept for callers written against it
    def to_host(self, hidden, topk_ids, topk_weights):
        """= submit(); the returned handle goes to compute()."""
        self.submit(hidden, topk_ids, topk_weights)
        return self

    def compute(self, host, like: torch.Tensor) -> torch.Tensor:
        """= wait() (zeros, not None, when no token routes to a CPU expert)."""
        return self.wait()

    # ------------------------------------------------------------------ workers
    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ValueError(
                f"expert id outside [0, {self.num_experts}) in topk_ids (min {int(ids.min())}, "
                f"max {int(ids.max())}): the router's input was probably not finite"
            )

    def _live_pool(self):
        """The kernel's pool of this process (a forked child: the parent's threads are not
        here, so it gets its own)."""
        if self._pool.pid != os.getpid():
            self._pool = ck.shared_pool(*self._pool_key, os.getpid())
        return self._pool

    def forward_with_shared(self, hidden, topk_ids, topk_weights, shared: CpuExpertBackend,
                            out_dtype: torch.dtype | None = None):  # fmt: skip
        """The routed experts' weighted sum plus `shared`'s one expert (every token, weight 1)
        in one kernel call (k2_moe_forward_shared: one pool job, each output row's float32
        sum rounded once; always the decode path). hidden [T, hidden] host bf16 / float32,
        topk [T, k]; -> [T, hidden] in out_dtype (None: hidden's; bf16 or float32). Both
        backends native, on one pool."""
        if self.impl != "native" or shared.impl != "native" or self._pending is not None:
            raise RuntimeError("forward_with_shared needs two idle native backends")
        pool = self._live_pool()
        if shared._live_pool() is not pool:
            raise RuntimeError("forward_with_shared: the two backends use different pools")
        x = hidden.contiguous()  # [T, hidden]
        ids = topk_ids.to(torch.int64).contiguous()  # [T, k]
        w = topk_weights.to(torch.float32).contiguous()  # [T, k]
        T, k = ids.shape
        out = torch.empty(x.shape, dtype=out_dtype or x.dtype)  # [T, hidden]
        code = {torch.bfloat16: ck.X_BF16, torch.float32: ck.X_F32}
        rc = self._lib.k2_moe_forward_shared(
            self._layer, shared._layer, pool._ptr, T, k, x.data_ptr(), code[x.dtype],
            ids.data_ptr(), w.data_ptr(), self._local_of32.data_ptr(), self.num_experts,
            out.data_ptr(), code[out.dtype],
        )  # fmt: skip
        if rc != 0:
            self._check_ids(ids)
            raise RuntimeError(f"CPU expert kernel (routed + shared) failed (code {rc})")
        return out

    def _run_native(self, x, ids, w, out=None) -> torch.Tensor:
        """x [T, hidden] bf16 / float32, ids [T, k] int64, w [T, k] float32, all contiguous;
        the result in `out` when it is a contiguous host [T, hidden] bf16 / float32 tensor,
        else in a new tensor of x's dtype (the kernel rounds its float32 sums to bf16)."""
        T, k = ids.shape
        H = self.hidden_size
        self._live_pool()
        dst = out
        direct = (
            out is not None
            and out.device.type == "cpu"
            and out.dtype in (torch.bfloat16, torch.float32)
            and out.shape == (T, H)
            and out.is_contiguous()
        )
        if not direct:
            dst = torch.empty(T, H, dtype=x.dtype)  # [T, hidden]
        xcode = ck.X_BF16 if x.dtype == torch.bfloat16 else ck.X_F32
        ocode = ck.X_BF16 if dst.dtype == torch.bfloat16 else ck.X_F32
        xp, ip, wp, op = x.data_ptr(), ids.data_ptr(), w.data_ptr(), dst.data_ptr()
        xb, ob = H * x.element_size(), H * dst.element_size()  # bytes per token
        for t0 in range(0, T, NATIVE_CHUNK_TOKENS):  # tokens are independent
            n = min(NATIVE_CHUNK_TOKENS, T - t0)
            rc = self._lib.k2_moe_forward(
                self._layer, self._pool._ptr, n, k, xp + t0 * xb, xcode, ip + t0 * k * 8,
                wp + t0 * k * 4, self._local_of32.data_ptr(), self.num_experts, op + t0 * ob,
                ocode,
            )  # fmt: skip
            if rc != 0:
                self._check_ids(ids)
                raise RuntimeError(f"CPU expert kernel failed (code {rc})")
        if out is not None and not direct:
            out.copy_(dst)
            return out
        return dst

    def _run_torch(self, x, ids, w, out=None) -> torch.Tensor:
        self._check_ids(ids)
        T, k = ids.shape
        x = x.to(self.compute_dtype)
        acc = torch.zeros(T, x.shape[1], dtype=torch.float32)  # [T, hidden]
        local = self.local_of[ids].reshape(-1)  # [T * k], -1 = not a CPU expert
        for le in local[local >= 0].unique().tolist():
            sel = (local == le).nonzero()[:, 0]  # pair indices routed to this expert
            tok = sel // k
            expert = self.experts[le]
            xe = x[tok]  # [m, hidden]
            h = F.silu(expert.gate_proj(xe)) * expert.up_proj(xe)  # [m, inter]
            y = expert.down_proj(h).to(torch.float32) * w.reshape(-1)[sel, None]  # [m, hidden]
            acc.index_add_(0, tok, y)
        if out is not None:
            out.copy_(acc)
            return out
        return acc
