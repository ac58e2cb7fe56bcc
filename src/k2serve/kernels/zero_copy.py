"""Zero-copy staging and result of a hybrid MoE layer's CPU part: kernels that read and write
the layer's pinned host buffers through their host-mapped addresses
(kernels.stream_wait.host_mapped), instead of memcpy nodes (each small copy in a graph costs
the copy engine a round of a few us).

Owns: `stage_to_host` (one kernel: hidden [T, D], topk_ids [T, k], topk_weights [T, k] on the
device stored straight into the pinned x / ids / w, casting ids and weights to the buffers'
dtypes as `copy_` would), `add_from_host` (one kernel: gpu_out + the CPU's `out` read from
pinned memory, rounded as torch's `gpu_out + out.to(gpu_out.dtype)`), `zero_copy_supported`
(a probe, once per process and device: both kernels on host-mapped buffers, read back on the
host and compared bit for bit with the memcpy path; false where Triton, CUDA or the mapping
is missing, or the bits differ). The choice of path is moe.hybrid's (K2SERVE_HYBRID_ZERO_COPY).

Ordering (why the GPU never sees a stale or early `out`):
- staging: the stores are posted PCIe writes; what tells the host they landed comes after the
  kernel in stream order: an event (kernel completion makes its writes visible to the host) or
  a ready word / the graph's word written by cuStreamWriteValue32 with default flags, which
  fences the stream's earlier writes first (kernels.stream_wait).
- result: `add_from_host` is enqueued after the layer's wait (cuStreamWaitValue32, or the spin
  kernel, which ends only after it saw the host's flag), so no load of `out` is issued before
  the wait passed: a kernel after a stream wait or after another kernel in the same stream
  (no programmatic dependent launch here) starts only when that one completed. The host wrote
  `out` before the flag (x86 stores are seen in order). The loads of `out` are volatile:
  Triton 3.6 emits `ld.volatile.global.v4.b32` (still 16-byte loads), which PTX gives the
  semantics of `ld.relaxed.sys`: a value coherent at system scope, so the last step's `out`
  at the same address cannot be served from L1 or L2; every load goes to host memory.
  (`cache_modifier=".cv"`, PTX's "consider cached system memory lines stale, fetch again",
  would say the same, but Triton 3.6 drops it when lowering to PTX: a plain `ld.global`.)
  Checked in the compiled PTX by benchmarks/zero_copy_compile.py (no GPU needed); not
  observable under TRITON_INTERPRET (no caches there).
"""

from __future__ import annotations

import functools
import logging

import torch

from ._triton import HAS_TRITON, cdiv, tl, triton

logger = logging.getLogger(__name__)

BLOCK = 1024  # hidden elements per program (D = 7168: 7 programs a token)

if HAS_TRITON:

    @triton.jit
    def _stage_kernel(
        x_ptr, ids_ptr, w_ptr, hx_ptr, hids_ptr, hw_ptr, D,
        x_stride, ids_stride, w_stride, hx_stride, hids_stride, hw_stride,
        K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        m = cols < D
        v = tl.load(x_ptr + t * x_stride + cols, mask=m)
        tl.store(hx_ptr + t * hx_stride + cols, v.to(hx_ptr.dtype.element_ty), mask=m)
        if b == 0:  # the row's routing, once
            j = tl.arange(0, KP)
            mk = j < K
            i = tl.load(ids_ptr + t * ids_stride + j, mask=mk)
            tl.store(hids_ptr + t * hids_stride + j, i.to(hids_ptr.dtype.element_ty), mask=mk)
            w = tl.load(w_ptr + t * w_stride + j, mask=mk)
            tl.store(hw_ptr + t * hw_stride + j, w.to(hw_ptr.dtype.element_ty), mask=mk)

    @triton.jit
    def _add_kernel(g_ptr, h_ptr, o_ptr, D, g_stride, h_stride, o_stride, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < D
        a = tl.load(g_ptr + t * g_stride + cols, mask=m).to(tl.float32)
        # host memory, written by the CPU since the last step: never from a cache (volatile:
        # ld.volatile = ld.relaxed.sys; see the module docstring)
        h = tl.load(h_ptr + t * h_stride + cols, mask=m, volatile=True)
        s = a + h.to(o_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_ptr + t * o_stride + cols, s.to(o_ptr.dtype.element_ty), mask=m)


def _rows_ok(*ts: torch.Tensor) -> bool:
    """2-D with unit inner stride (what the kernels index)."""
    return all(t.dim() == 2 and t.stride(1) == 1 for t in ts)


def can_stage(hidden, topk_ids, topk_weights, x, ids, w) -> bool:
    """True when `stage_to_host` takes these tensors (else use the memcpys)."""
    return (
        HAS_TRITON
        and _rows_ok(hidden, topk_ids, topk_weights, x, ids, w)
        and hidden.shape == x.shape
        and topk_ids.shape == ids.shape == topk_weights.shape == w.shape
        and hidden.dtype == x.dtype
    )


def stage_to_host(
    hidden: torch.Tensor,  # [T, D] on the device
    topk_ids: torch.Tensor,  # [T, k] int32 / int64
    topk_weights: torch.Tensor,  # [T, k] float
    x: torch.Tensor,  # [T, D] host-mapped view of pinned memory, hidden's dtype
    ids: torch.Tensor,  # [T, k] host-mapped (int64)
    w: torch.Tensor,  # [T, k] host-mapped (float32)
) -> None:
    """x <- hidden, ids <- topk_ids, w <- topk_weights in one kernel, enqueued on the current
    stream (no host sync; capturable)."""
    T, D = hidden.shape
    if T == 0:
        return
    k = topk_ids.shape[1]
    _stage_kernel[(T, cdiv(D, BLOCK))](
        hidden, topk_ids, topk_weights, x, ids, w, D,
        hidden.stride(0), topk_ids.stride(0), topk_weights.stride(0),
        x.stride(0), ids.stride(0), w.stride(0),
        K=k, KP=triton.next_power_of_2(k), BLOCK=BLOCK,
    )  # fmt: skip


def add_from_host(gpu_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """gpu_out [T, D] + out [T, D] (a host-mapped view of the CPU's pinned result) -> a new
    [T, D] tensor of gpu_out's dtype: out rounded to that dtype, the sum in float32, rounded
    (torch's `gpu_out + out.to(gpu_out.dtype)` bit for bit). Enqueue it after the wait."""
    T, D = gpu_out.shape
    res = torch.empty_like(gpu_out)
    if T:
        _add_kernel[(T, cdiv(D, BLOCK))](gpu_out, out, res, D, gpu_out.stride(0), out.stride(0),
                                         res.stride(0), BLOCK=BLOCK)  # fmt: skip
    return res


@functools.cache
def zero_copy_supported(device_index: int) -> bool:
    """True when both kernels, on host-mapped pinned buffers of `device_index`, give the bits
    of the memcpy path (checked once: random inputs with T=3, k=8 and a hidden size that is
    not a multiple of BLOCK; int32 ids and bf16 weights cast on the way, as copy_ does).
    Any failure logs why and gives False (the memcpys are used)."""
    if not HAS_TRITON:
        return False
    from .stream_wait import host_mapped

    try:
        with torch.cuda.device(device_index):
            g = torch.Generator(device="cuda").manual_seed(0)
            T, D, k = 3, BLOCK + 77, 8
            hidden = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
            tid = torch.randint(0, 384, (T, k), device="cuda", generator=g, dtype=torch.int32)
            tw = torch.rand(T, k, device="cuda", generator=g).to(torch.bfloat16)
            host = dict(x=torch.zeros(T, D, dtype=torch.bfloat16, pin_memory=True),
                        ids=torch.zeros(T, k, dtype=torch.long, pin_memory=True),
                        w=torch.zeros(T, k, dtype=torch.float32, pin_memory=True),
                        out=torch.randn(T, D).to(torch.bfloat16).pin_memory())  # fmt: skip
            mapped = {n: host_mapped(t) for n, t in host.items()}
            stage_to_host(hidden, tid, tw, mapped["x"], mapped["ids"], mapped["w"])
            gpu_out = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
            got = add_from_host(gpu_out, mapped["out"])
            want = gpu_out + host["out"].to("cuda")
            torch.cuda.synchronize()
            ok = (
                torch.equal(host["x"], hidden.cpu())
                and torch.equal(host["ids"], tid.cpu().long())
                and torch.equal(host["w"], tw.cpu().float())
                and torch.equal(got, want)
            )
    except Exception as e:  # noqa: BLE001 - any failure means: use the memcpys
        logger.warning("hybrid: zero-copy staging unusable here (%s); memcpys used", e)
        return False
    if not ok:
        logger.warning("hybrid: zero-copy staging gave other bits than the memcpys; memcpys used")
    return ok


__all__ = ["add_from_host", "can_stage", "stage_to_host", "zero_copy_supported"]
