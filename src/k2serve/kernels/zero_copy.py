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
is missing, or the bits differ), `Handshake` / `fused_wait_supported` (the fused waits
below, and their probe). The choice of path is moe.hybrid's (K2SERVE_HYBRID_ZERO_COPY).

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

Fused waits (`Handshake`, K2SERVE_HYBRID_FUSED_WAIT; the one-graph device wait only): the
staging kernel also writes the layer's ready word (the graph's `cuStreamWriteValue32` node
gone), and with a spinning wait the result kernel spins on the host's flag itself (the spin
kernel gone): one node each instead of two. The memory-model argument, per program of the
staging kernel (grid (T, D / BLOCK): several programs even at T = 1):
  1. every thread stores its data (x, ids, w) into host memory;
  2. `fence.sc.sys` (each thread): its stores are performed at system scope, i.e. in host
     memory where the CPU reads them, before anything it does next (membar.sys);
  3. a CTA barrier: every thread of the program is past its fence;
  4. one `atom.acq_rel.gpu.add` on a counter in device memory: the program's arrival;
  5. the program that finds count == programs - 1 (the last: every other program's step 4,
     and so through steps 1-3 its data, happened before) resets the counter to 0 for the
     next launch, stores 0 into the flag (`st.relaxed.sys`: re-arms it, see below), then
     `fence.sc.sys` + a CTA barrier + `st.relaxed.sys` of 1 into the word.
The host spins on the word (HostReadyWord.wait_set): it can see 1 only after every data store
and the flag's clear are in host memory, so it never reads a stale x / ids / w (x86 does not
perform a load before an older one) and its release (flag <- 1, written after it saw the
word) can never be overwritten by the clear.
The flag protocol of the fused result kernel: the host's flag stays 1 once released (no
program clears it: several programs must all see it), and the NEXT step's staging kernel of
the same layer clears it (step 5), which is in stream order after every program of this
step's result kernel ended, and whose clear is in host memory before the word that lets the
host release again. Each program (each thread: a scalar load in Triton is every thread's)
spins with volatile loads until the flag is nonzero, then `fence.acq_rel.sys` (with the
volatile load = ld.relaxed.sys, an acquire pattern: no later load is performed before the
flag was seen), then the volatile loads of `out` as above. Where a released flag could meet
a staging kernel that has not run yet (error recovery), the host waits for that layer's word
first (moe.host_round_trip.HostJob.unblock). Without a spinning wait (stream waits) only the
word is fused and the stream wait clears the flag as before. Under TRITON_INTERPRET the
fences are no-ops (no inline assembly there; the programs run one after another anyway).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ._triton import HAS_TRITON, cdiv, tl, triton

logger = logging.getLogger(__name__)

BLOCK = 1024  # hidden elements per program (D = 7168: 7 programs a token)

if HAS_TRITON:

    @triton.jit
    def _fence_sc_sys():
        """fence.sc.sys (membar.sys): this thread's earlier stores performed at system scope
        before its later ones (every thread; the asm's value is a dummy)."""
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip

    @triton.jit
    def _fence_acq_rel_sys():
        """fence.acq_rel.sys: after a volatile (relaxed.sys) load, an acquire pattern."""
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip

    @triton.jit
    def _store_sys(ptr, value):
        """st.relaxed.sys of an int32 (every thread, the same value): a strong store at
        system scope, which a fence before it orders after that thread's earlier stores."""
        tl.inline_asm_elementwise("st.relaxed.sys.global.b32 [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False,
                                  pack=1)  # fmt: skip

    @triton.jit
    def _stage_kernel(
        x_ptr, ids_ptr, w_ptr, hx_ptr, hids_ptr, hw_ptr, D,
        x_stride, ids_stride, w_stride, hx_stride, hids_stride, hw_stride,
        word_ptr, flag_ptr, count_ptr,
        K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
        WORD: tl.constexpr, CLEAR: tl.constexpr,
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
        if WORD:  # the fused ready word (module docstring, "Fused waits", steps 2-5)
            _fence_sc_sys()
            tl.debug_barrier()
            last = tl.num_programs(0) * tl.num_programs(1) - 1
            if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == last:
                tl.store(count_ptr, 0)
                if CLEAR:
                    _store_sys(flag_ptr, 0)
                _fence_sc_sys()
                tl.debug_barrier()
                _store_sys(word_ptr, 1)

    @triton.jit
    def _add_kernel(g_ptr, h_ptr, o_ptr, D, g_stride, h_stride, o_stride, flag_ptr,
                    BLOCK: tl.constexpr, WAIT: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < D
        a = tl.load(g_ptr + t * g_stride + cols, mask=m).to(tl.float32)
        if WAIT:  # the fused wait: until the host released the flag (module docstring)
            f = tl.load(flag_ptr, volatile=True)
            while f == 0:
                f = tl.load(flag_ptr, volatile=True)
            _fence_acq_rel_sys()
        # host memory, written by the CPU since the last step: never from a cache (volatile:
        # ld.volatile = ld.relaxed.sys; see the module docstring)
        h = tl.load(h_ptr + t * h_stride + cols, mask=m, volatile=True)
        s = a + h.to(o_ptr.dtype.element_ty).to(tl.float32)
        tl.store(o_ptr + t * o_stride + cols, s.to(o_ptr.dtype.element_ty), mask=m)


class Handshake:
    """One hybrid layer's fused waits (module docstring, "Fused waits"), over pinned host int32
    words [1]: `word_host`, its ready word (kernels.stream_wait.HostReadyWord.word), which the
    staging kernel's last program sets to 1; `flag_host`, its host signal's flag
    (CudaHostSignal with spin), which that program clears and the result kernel spins on, or
    None (stream waits: only the word is fused). `word` / `flag` are their host-mapped CUDA
    views, `count` [1] int32 in device memory the programs' arrival counter (0 between
    launches). Made before a graph capture (a tensor allocated while capturing would be reset
    by a captured memset)."""

    def __init__(self, word_host: torch.Tensor, flag_host: torch.Tensor | None, device) -> None:
        from .stream_wait import host_mapped

        self.word_host, self.flag_host = word_host, flag_host
        self.word = host_mapped(word_host)
        self.flag = host_mapped(flag_host) if flag_host is not None else None
        self.count = torch.zeros(1, dtype=torch.int32, device=device)

    def warm_up(self, hidden, topk_ids, topk_weights, x, ids, w, out) -> None:
        """Launch both fused kernels once, eagerly, on these arguments (the staging's, and
        `out` [T, D] host-mapped with a gpu_out like hidden): a kernel's first launch compiles
        and loads it, which must not happen while a graph is captured. The host plays its
        part (the flag set after the staging cleared it); word and flag are 0 again after.
        Synchronizes the device."""
        stage_to_host(hidden, topk_ids, topk_weights, x, ids, w, handshake=self)
        torch.cuda.synchronize()
        if self.flag_host is not None:
            self.flag_host[0] = 1
            add_from_host(torch.zeros_like(hidden), out, wait_flag=self.flag)
            torch.cuda.synchronize()
            self.flag_host[0] = 0
        self.word_host[0] = 0


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
    handshake: Handshake | None = None,
) -> None:
    """x <- hidden, ids <- topk_ids, w <- topk_weights in one kernel, enqueued on the current
    stream (no host sync; capturable); with `handshake`, then its word <- 1 (and its flag <-
    0) after the data are in host memory (T >= 1)."""
    T, D = hidden.shape
    if T == 0 and handshake is None:
        return
    if T == 0:
        raise ValueError("a fused ready word needs at least one token to stage")
    k = topk_ids.shape[1]
    hs = handshake
    word = flag = count = x  # unused pointers without a handshake (constexpr WORD / CLEAR)
    if hs is not None:
        word, count = hs.word, hs.count
        flag = hs.flag if hs.flag is not None else hs.word
    _stage_kernel[(T, cdiv(D, BLOCK))](
        hidden, topk_ids, topk_weights, x, ids, w, D,
        hidden.stride(0), topk_ids.stride(0), topk_weights.stride(0),
        x.stride(0), ids.stride(0), w.stride(0), word, flag, count,
        K=k, KP=triton.next_power_of_2(k), BLOCK=BLOCK,
        WORD=hs is not None, CLEAR=hs is not None and hs.flag is not None,
    )  # fmt: skip


def add_from_host(
    gpu_out: torch.Tensor, out: torch.Tensor, wait_flag: torch.Tensor | None = None
) -> torch.Tensor:
    """gpu_out [T, D] + out [T, D] (a host-mapped view of the CPU's pinned result) -> a new
    [T, D] tensor of gpu_out's dtype: out rounded to that dtype, the sum in float32, rounded
    (torch's `gpu_out + out.to(gpu_out.dtype)` bit for bit). Enqueue it after the wait, or
    give the wait: `wait_flag` [1] int32 host-mapped (a Handshake's flag), every program
    spins until it is nonzero before it reads `out` (and leaves it set)."""
    T, D = gpu_out.shape
    res = torch.empty_like(gpu_out)
    if T:
        flag = wait_flag if wait_flag is not None else gpu_out
        _add_kernel[(T, cdiv(D, BLOCK))](gpu_out, out, res, D, gpu_out.stride(0), out.stride(0),
                                         res.stride(0), flag, BLOCK=BLOCK,
                                         WAIT=wait_flag is not None)  # fmt: skip
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


def _poll(event, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > end:
            return False
        time.sleep(1e-4)
    return True


@functools.cache
def fused_wait_supported(device_index: int) -> bool:
    """True when the fused waits work on `device_index` (checked once, on a side stream,
    where zero-copy passed its probe): the staging kernel with a Handshake gives the host its
    bits once the word is 1, with the flag cleared and the counter back at 0; the result
    kernel with the flag is still running 20 ms later (it waits) and, once the host sets the
    flag, gives gpu_out + out. Any difference logs why and gives False (the unfused nodes).
    Raises RuntimeError in the one case that cannot be undone: a result kernel that never saw
    the host's flag keeps that stream busy (K2SERVE_HYBRID_FUSED_WAIT=0 skips the probe)."""
    if not zero_copy_supported(device_index):
        return False
    from .stream_wait import HostReadyWord, host_mapped

    flag = torch.ones(1, dtype=torch.int32, pin_memory=True)  # [1], cleared by the staging
    hs = None
    try:
        with torch.cuda.device(device_index):
            g = torch.Generator(device="cuda").manual_seed(1)
            T, D, k = 3, BLOCK + 77, 8
            hidden = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
            tid = torch.randint(0, 384, (T, k), device="cuda", generator=g, dtype=torch.int32)
            tw = torch.rand(T, k, device="cuda", generator=g)
            host = dict(x=torch.zeros(T, D, dtype=torch.bfloat16, pin_memory=True),
                        ids=torch.zeros(T, k, dtype=torch.long, pin_memory=True),
                        w=torch.zeros(T, k, dtype=torch.float32, pin_memory=True),
                        out=torch.randn(T, D).to(torch.bfloat16).pin_memory())  # fmt: skip
            m = {n: host_mapped(t) for n, t in host.items()}
            word = HostReadyWord(timeout_s=2.0)
            hs = Handshake(word.word, flag, "cuda")
            gpu_out = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
            want = gpu_out + host["out"].to("cuda")
            stream, done = torch.cuda.Stream(), torch.cuda.Event()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                stage_to_host(hidden, tid, tw, m["x"], m["ids"], m["w"], handshake=hs)
            word.wait_set()  # raises when the word does not come
            staged = (torch.equal(host["x"], hidden.cpu()) and torch.equal(host["ids"],
                      tid.cpu().long()) and torch.equal(host["w"], tw.cpu())
                      and int(flag[0]) == 0)  # fmt: skip
            with torch.cuda.stream(stream):
                got = add_from_host(gpu_out, m["out"], wait_flag=hs.flag)
                done.record()
            time.sleep(0.02)
            held = not done.query()
    except Exception as e:  # noqa: BLE001 - any failure means: the unfused nodes
        flag[0] = 1  # a result kernel launched before the failure must not stay spinning
        logger.warning("hybrid: fused waits unusable here (%s); separate nodes used", e)
        return False
    flag[0] = 1  # the host's release
    if not _poll(done, 5.0):
        raise RuntimeError(
            "a result kernel spinning on the host's flag did not see it in 5 s; that stream "
            "stays busy. Set K2SERVE_HYBRID_FUSED_WAIT=0 to use separate wait nodes."
        )
    ok = staged and held and torch.equal(got, want) and int(hs.count.item()) == 0
    if not ok:
        logger.warning("hybrid: fused waits gave other results (staged %s, held %s); separate "
                       "nodes used", staged, held)  # fmt: skip
    return ok


__all__ = [
    "Handshake",
    "add_from_host",
    "can_stage",
    "fused_wait_supported",
    "stage_to_host",
    "zero_copy_supported",
]
