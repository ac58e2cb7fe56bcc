"""A host -> GPU signal that a CUDA graph can wait on: the GPU stream stalls on a flag in
pinned host memory until the host writes it (CUDA stream memory operations, libcuda via
ctypes), so the work after the wait needs no host launch.

Owns: `CudaHostSignal` (one per hybrid MoE layer), `cuda_host_signal_supported()` (a probe,
once per process and device), `HostReadyWord` (GPU -> host: a number the stream writes into
pinned memory, the host spins on it; an alternative to an event for the staged inputs) and
`host_mapped()` (a pinned host tensor as a CUDA tensor over the same bytes: the spin kernel's
flag, kernels.zero_copy's staging and result buffers).

Protocol of one signal (all four calls are cheap, none allocates):
- `record()` (host, eager, between graph replays): an event after the GPU work that staged the
  CPU's inputs;  `wait_recorded()` (host): block until the GPU got there.
- `gpu_wait()` (enqueued, usually while capturing a graph): the stream waits until the flag is
  1 (`cuStreamWaitValue32`, EQ), then writes 0 (`cuStreamWriteValue32`) to re-arm it for the
  next step. Both are batch mem-op nodes when captured.
- `release()` (host): write 1 (after the host wrote what the GPU reads after the wait; x86
  stores are seen in order, and the GPU reads pinned memory through the coherent PCIe path).
The host writes 1 only after `wait_recorded()` of a later point of the same stream, which is
after the GPU's write of 0 of the previous step: the flag is never 1 twice in a row.

Why stream memory operations and not a spin kernel or `cudaLaunchHostFunc`: the wait runs in
the GPU's front end (no SM held, nothing to compile), it is documented to be capturable, the
V2 entry points are enabled on every platform (CUDA >= 11.7), and no Python runs on a driver
thread (a host function would need the GIL from the driver's callback thread).

Invariant: a released flag must follow every `gpu_wait()` that was launched, or the stream
hangs; callers release in a `finally` (model.cuda_graph.DecodeGraphRunner).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time

import torch

logger = logging.getLogger(__name__)

CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0


@functools.lru_cache(maxsize=1)
def _libcuda():
    """(wait32, write32, host_device_pointer) from libcuda, or None when not available."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None

    def entry(*names):
        for n in names:
            fn = getattr(lib, n, None)
            if fn is not None:
                return fn
        return None

    wait = entry("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    write = entry("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    dptr = entry("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
    if wait is None or write is None or dptr is None:
        return None
    for fn in (wait, write):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    dptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    dptr.restype = ctypes.c_int
    return wait, write, dptr


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


@functools.cache
def _spin_kernel():
    """Triton kernel: spin on a flag in host-mapped memory until it is nonzero, then clear it
    (one program; volatile loads re-read host memory over PCIe each time)."""
    import triton
    import triton.language as tl

    @triton.jit
    def spin_until_set(flag_ptr):
        v = tl.load(flag_ptr, volatile=True)
        while v == 0:
            v = tl.load(flag_ptr, volatile=True)
        tl.store(flag_ptr, 0)

    return spin_until_set


class _HostMapped:
    """__cuda_array_interface__ of `nbytes` bytes at a device address: torch.as_tensor makes
    it a CUDA uint8 tensor without a copy (here: pinned host memory, through unified
    addressing)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2,
                                         "strides": None}  # fmt: skip


def _device_pointer(host_ptr: int) -> int:
    """The device address of pinned host memory (cuMemHostGetDevicePointer); with unified
    addressing (every 64-bit CUDA platform) it is the host address itself, the fallback."""
    lib = _libcuda()
    out = ctypes.c_uint64()
    rc = lib[2](ctypes.byref(out), host_ptr, 0) if lib is not None else 1
    return out.value if rc == 0 else host_ptr


def host_mapped(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same bytes as the pinned host tensor `t` (same dtype, shape,
    strides; no copy): kernels read and write host memory through it over PCIe. `t` must
    stay alive while the view is used (the view does not own the memory)."""
    if not t.is_pinned():
        raise ValueError("host_mapped needs a pinned host tensor")
    storage = t.untyped_storage()
    raw = torch.as_tensor(_HostMapped(_device_pointer(storage.data_ptr()), storage.nbytes()),
                          device="cuda")  # fmt: skip
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def _pinned_word():
    """The one pinned int32 word both directions use: -> (libcuda entry points (wait32,
    write32, host_device_pointer), the word as a host tensor [1] (zero), its device address,
    a ctypes view the host reads and writes it through)."""
    lib = _libcuda()
    if lib is None:
        raise RuntimeError("libcuda stream memory operations are not available")
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # [1]
    host = ctypes.c_int32.from_address(word.data_ptr())
    return lib, word, _device_pointer(word.data_ptr()), host


def _write_value(write, dptr: int, value: int) -> None:
    """Enqueue on the current stream the write of `value` at `dptr` (cuStreamWriteValue32,
    default flags: a memory fence first, so what the stream wrote before is visible first)."""
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check(write(stream, dptr, value, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")


class CudaHostSignal:
    """See the module docstring. `spin`: `gpu_wait()` is a one-program Triton kernel that
    spins on the flag through its host-mapped address and clears it (an SM held during the
    wait; the flag seen within a PCIe read instead of the front end's stream-wait poll), not
    the stream memory operations."""

    def __init__(self, spin: bool = False) -> None:
        (self._wait, self._write, _), self.flag, self._dptr, self._host = _pinned_word()
        # self.flag [1]: 1 = released
        self.event = torch.cuda.Event()
        self.spin = spin
        if spin:  # the flag as a CUDA tensor; the kernel built now, not while capturing
            self._flag_dev = host_mapped(self.flag)
            self._host.value = 1
            _spin_kernel()[(1,)](self._flag_dev)
            torch.cuda.synchronize()
            if self._host.value != 0:
                raise RuntimeError("the spin-wait kernel did not clear the host flag")

    def record(self) -> None:
        self.event.record()

    def wait_recorded(self) -> None:
        self.event.synchronize()

    def gpu_wait(self) -> None:
        if self.spin:
            _spin_kernel()[(1,)](self._flag_dev)
            return
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(self._wait(stream, self._dptr, 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")
        _write_value(self._write, self._dptr, 0)

    def release(self) -> None:
        self._host.value = 1

    def reset(self) -> None:
        """Re-arm from the host (error recovery, after the device is drained)."""
        self._host.value = 0


class HostReadyWord:
    """The other direction, GPU -> host, without an event: `record()` enqueues on the current
    stream a write of the next sequence number into a pinned host word
    (`cuStreamWriteValue32`, default flags: a memory fence first, so what the stream wrote
    before, e.g. the staging copies, is visible when the number is); `wait(seq)` spins on the
    word until it reaches seq (the host thread has nothing else to do; no driver call, no
    event query). An alternative to `event.record()` / `event.synchronize()` for the hybrid
    layers' staged inputs (moe.host_round_trip), chosen per backend at run time: both are
    eager host actions between graph replays, nothing captured changes.

    The write lands within a PCIe round trip after the GPU gets there; a wait that does not
    see it in `timeout_s` raises (the stream is not blocked by this word: nothing waits on it
    on the GPU)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        (_, self._write, _), self.word, self._dptr, self._host = _pinned_word()
        # self.word [1]: the last seq written
        self.seq = 0
        self.timeout_s = timeout_s

    def record(self) -> int:
        """-> the number `wait` waits for (the GPU writes it after the work enqueued so far)."""
        self.seq = (self.seq + 1) & 0x7FFFFFFF
        _write_value(self._write, self._dptr, self.seq)
        return self.seq

    # in-graph form: a constant the capture bakes in, cleared by the host that saw it
    def gpu_set(self) -> None:
        """Enqueue (usually while capturing) the write of 1 after the work before it."""
        _write_value(self._write, self._dptr, 1)

    def wait_set(self) -> None:
        """Spin until the GPU wrote 1, then clear it for the next step (the GPU writes it
        again only after the host's next release: stream order)."""
        self.wait(1)
        self._host.value = 0

    def reset(self) -> None:
        """Clear from the host (error recovery, after the device is drained)."""
        self._host.value = 0

    def wait(self, seq: int) -> None:
        word = self._host
        if word.value == seq:
            return
        n, end = 0, time.perf_counter() + self.timeout_s
        while word.value != seq:
            n += 1
            if (n & 1023) == 0 and time.perf_counter() > end:
                raise RuntimeError(
                    f"the GPU did not write {seq} into the host ready word in "
                    f"{self.timeout_s} s (it holds {word.value})"
                )


def _poll(event: torch.cuda.Event, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not event.query():
        if time.monotonic() > end:
            return False
        time.sleep(1e-4)
    return True


@functools.cache
def cuda_host_signal_supported(device_index: int, spin: bool = False) -> bool:
    """True when a captured graph's `gpu_wait()` holds the stream until `release()` and then
    goes on (checked once, on a side stream; logs why not otherwise). Raises RuntimeError in
    the one case that cannot be undone: a wait that never saw the host's flag leaves that
    stream blocked, and the next device-wide sync would hang (K2SERVE_HYBRID_DEVICE_WAIT=0
    skips the probe)."""
    try:
        with torch.cuda.device(device_index):
            sig = CudaHostSignal(spin=spin)
            x = torch.zeros(1, device="cuda")
            stream = torch.cuda.Stream()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                sig.gpu_wait()
                x.add_(1)
            done = torch.cuda.Event()
            with torch.cuda.stream(stream):
                g.replay()
                done.record()
    except Exception as e:  # noqa: BLE001 - any failure means: use the host round trip
        logger.warning("hybrid overlap: stream memory operations unusable here (%s)", e)
        return False
    time.sleep(0.02)
    held = not done.query()  # the wait holds the stream ...
    sig.release()
    if not _poll(done, 5.0):  # ... until the host writes the flag
        raise RuntimeError(
            "a CUDA graph's stream wait (cuStreamWaitValue32) did not see the host's write in "
            "5 s; that stream stays blocked. Set K2SERVE_HYBRID_DEVICE_WAIT=0 to wait for the "
            "CPU experts on the host instead."
        )
    ok = held and float(x.item()) == 1.0 and int(sig.flag.item()) == 0
    if not ok:
        logger.warning("hybrid overlap: the stream wait did not hold the stream; using the "
                       "host round trip between graph pieces")  # fmt: skip
    return ok


@functools.cache
def host_ready_word_supported(device_index: int) -> bool:
    """True when a HostReadyWord's number arrives after the work before it (checked once:
    a copy, then the word, on a side stream; no stream ever waits on the word, so a failure
    only logs)."""
    try:
        with torch.cuda.device(device_index):
            word = HostReadyWord(timeout_s=2.0)
            stream = torch.cuda.Stream()
            host = torch.zeros(1 << 16, pin_memory=True)
            with torch.cuda.stream(stream):
                dev = torch.full((1 << 16,), 3.0, device="cuda")
                host.copy_(dev, non_blocking=True)
                seq = word.record()
            word.wait(seq)
            ok = float(host[0]) == float(host[-1]) == 3.0
            stream.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure means: use events
        logger.warning("hybrid: GPU-written host ready words unusable here (%s)", e)
        return False
    if not ok:
        logger.warning("hybrid: a ready word arrived before the copy it follows; using events")
    return ok


__all__ = [
    "CudaHostSignal",
    "HostReadyWord",
    "cuda_host_signal_supported",
    "host_mapped",
    "host_ready_word_supported",
]
